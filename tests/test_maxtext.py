"""Real MaxText (its own pre-training loop) with snapstore: 2 processes x 2
CPU devices under ``snapstore launch``, a seeded SIGKILL after a train step.

The reference is an uninterrupted run of the same job. A resumed run must
restore a RAM snapshot at most one step back (snapshots on) or MaxText's
own Orbax checkpoint (snapshots off), and every later loss and the final
global state must equal the reference's bitwise.

Needs MaxText (``pip install -e '.[maxtext]'``, Python >= 3.12); skipped
without it.
"""

import json
import random
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

maxtext = pytest.importorskip(
    "maxtext", reason="MaxText is not installed (pip install -e '.[maxtext]', Python >= 3.12)")

from snapstore.launch import Kill, launch  # noqa: E402

STEPS = 8
PERIOD = 3  # MaxText's own Orbax checkpoint period
# The process SIGKILLs itself after this step trained (seeded), never on
# MaxText's checkpoint period: there its Orbax step would equal the killed
# step and rightly be preferred to the snapshot one step back.
KILL = random.Random(5).choice([s for s in range(PERIOD + 1, STEPS - 1) if s % PERIOD])
MODULE = "snapstore.integrations.maxtext.train"
TINY = ["dataset_type=synthetic", "per_device_batch_size=1", "max_target_length=32",
        "base_emb_dim=32", "base_num_query_heads=2", "base_num_kv_heads=2",
        "base_mlp_dim=64", "base_num_decoder_layers=1", "head_dim=16", "vocab_size=128",
        "hardware=cpu", "enable_checkpointing=true", "async_checkpointing=false",
        f"checkpoint_period={PERIOD}", f"steps={STEPS}", "log_period=1000",
        "enable_goodput_recording=false", "monitor_goodput=false"]


def base_yml() -> str:
  return str(Path(maxtext.__file__).parent / "configs" / "base.yml")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
  return tmp_path_factory.mktemp("maxtext-jax-cache")


class Run:
  def __init__(self, tmp_path: Path, cache_dir: Path, name: str, snapshots: bool):
    self.out = tmp_path / name
    self.out.mkdir()
    self.store = Path("/dev/shm") / f"snapstore-mt-{uuid.uuid4().hex[:8]}"
    self.args = [base_yml(), *TINY, f"run_name={name}",
                 f"base_output_directory={tmp_path / 'orbax'}",
                 f"jax_cache_dir={cache_dir}", f"snapshot_store_dir={self.store}",
                 f"snapshot_interval={1 if snapshots else 0}", "snapshot_keep=2",
                 "snapshot_replicas=1"]
    self.name = name

  def run(self, kills=()):
    env = {"JAX_PLATFORMS": "cpu", "DECOUPLE_GCLOUD": "TRUE"}
    try:
      self.incs = launch(MODULE, self.args, num_hosts=2, devices_per_host=2,
                         store_dir=self.store, run_id=self.name, kills=kills,
                         timeout_s=280, log_dir=self.out, env=env)
    finally:
      shutil.rmtree(self.store, ignore_errors=True)
    last = self.incs[-1].number
    self.report = json.loads((self.out / f"maxtext-inc{last}-host0.json").read_text())
    return self


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cache_dir):
  run = Run(tmp_path_factory.mktemp("mt-ref"), cache_dir, "ref", snapshots=True).run()
  assert len(run.incs) == 1 and run.incs[0].ok
  assert sorted(map(int, run.report["losses"])) == list(range(STEPS))
  return run


def check_resumed(run, reference, *, source, step):
  inc = run.incs[-1]
  assert len(run.incs) == 2 and run.incs[0].killed == [1] and inc.ok
  r = run.report["restores"][-1]
  assert r["source"] == source and r["step"] == step, r
  for s in range(step + 1, STEPS):
    assert run.report["losses"][str(s)] == reference.report["losses"][str(s)], s
  final = str(STEPS - 1)
  assert inc.digests[final] == reference.incs[0].digests[final]
  return r


def test_killed_maxtext_resumes_from_a_ram_snapshot_one_step_back(
    reference, tmp_path, cache_dir):
  run = Run(tmp_path, cache_dir, "snap", snapshots=True).run(
      [Kill(host=1, step=KILL, phase="step")])
  # Killed after step `kill` trained, before its snapshot: the newest
  # complete snapshot is step kill - 1, one step back.
  r = check_resumed(run, reference, source="snapshot", step=KILL - 1)
  assert r["rewind_steps"] <= 1
  # The restored state equals the reference's state at that step, bitwise
  # (the reference digests its restores only; the first loss after the
  # restore is a function of that state and the step's batch).
  assert run.report["losses"][str(KILL)] == reference.report["losses"][str(KILL)]


def test_snapshots_off_resumes_from_maxtexts_orbax_checkpoint(reference, tmp_path, cache_dir):
  run = Run(tmp_path, cache_dir, "orbax", snapshots=False).run(
      [Kill(host=1, step=KILL, phase="step")])
  orbax_step = KILL // PERIOD * PERIOD
  assert KILL - orbax_step >= 1
  r = check_resumed(run, reference, source="maxtext", step=orbax_step)
  assert "snapshots are off" in r["why"]


def test_an_unknown_snapshot_key_is_an_error_naming_it(tmp_path):
  proc = subprocess.run(
      [sys.executable, "-m", MODULE, base_yml(), "snapshot_intervall=1"],
      capture_output=True, text=True, timeout=120)
  assert proc.returncode == 2
  assert "unknown snapstore key 'snapshot_intervall'" in proc.stderr


def test_a_bad_snapshot_value_in_the_yml_is_an_error_naming_it(tmp_path):
  yml = tmp_path / "my.yml"
  yml.write_text(f"base_config: {base_yml()}\nsnapshot_keep: 0\n")
  proc = subprocess.run([sys.executable, "-m", MODULE, str(yml)],
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 2
  assert "snapshot_keep=0" in proc.stderr


def test_an_unsupported_maxtext_version_is_refused_by_name(monkeypatch):
  from maxtext import version
  from snapstore.integrations.maxtext.train import UnsupportedMaxTextError, check_maxtext
  assert check_maxtext() == version.__version__
  monkeypatch.setattr(version, "__version__", "0.1.0")
  with pytest.raises(UnsupportedMaxTextError, match=r"maxtext 0\.1\.0 is installed"):
    check_maxtext()
