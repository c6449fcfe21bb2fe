"""Real MaxText (its own pre-training loop) with snapstore: 2 processes x 2
CPU devices under ``snapstore launch``, a seeded SIGKILL after a train step.

The reference is an uninterrupted run of the same job. A resumed run must
restore a RAM snapshot at most one step back (snapshots on) or MaxText's
own Orbax checkpoint (snapshots off), and every later loss and the final
global state must equal the reference's bitwise.

Needs MaxText (Python >= 3.12, ``pip install --no-deps -r
requirements/maxtext-0.2.5-cpu.txt``); skipped without it.
"""

import json
import random
import subprocess
import sys

import pytest

maxtext = pytest.importorskip(
    "maxtext", reason="MaxText is not installed (Python >= 3.12: pip install --no-deps -r "
           "requirements/maxtext-0.2.5-cpu.txt)")

from benchmarks.maxtext import MODULE, base_yml, grain_args, run_job  # noqa: E402
from snapstore.testing import Kill  # noqa: E402

pytestmark = pytest.mark.slow  # real multi-process jobs: the full suite only

STEPS = 8
PERIOD = 3  # MaxText's own Orbax checkpoint period
# The process SIGKILLs itself after this step trained (seeded), never on
# MaxText's checkpoint period: there its Orbax step would equal the killed
# step and rightly be preferred to the snapshot one step back.
KILL = random.Random(5).choice([s for s in range(PERIOD + 1, STEPS - 1) if s % PERIOD])


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
  return tmp_path_factory.mktemp("maxtext-jax-cache")


class Run:
  def __init__(self, tmp_path, cache_dir, name, snapshots, data=("dataset_type=synthetic",)):
    self.work, self.cache_dir, self.name, self.snapshots = tmp_path, cache_dir, name, snapshots
    self.data = data

  def run(self, kills=()):
    self.incs, self.report = run_job(self.work, self.name, steps=STEPS, period=PERIOD,
                                     snapshots=self.snapshots, cache_dir=self.cache_dir,
                                     kills=kills, data=self.data)
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


def test_killed_maxtext_resumes_one_step_back_then_a_newer_maxtext_checkpoint_wins(
    reference, tmp_path, cache_dir):
  """One job, two kills. Host 1 dies after step KILL trained, before its
  snapshot: the newest complete snapshot, one step back, is restored. The
  next incarnation dies right after MaxText's own checkpoint of a period
  step, before that step's snapshot: its Orbax step is one newer than the
  newest snapshot, and MaxText's restore is used (and reported, not the
  snapshot read before the comparison). Every loss after each restore and
  the final state equal the reference's bitwise."""
  newer = STEPS // PERIOD * PERIOD
  assert KILL < newer < STEPS - 1
  run = Run(tmp_path, cache_dir, "snap", snapshots=True).run(
      [Kill(host=1, step=KILL, phase="step"),
       Kill(host=1, step=newer, phase="step", incarnation=1)])
  assert [i.killed for i in run.incs] == [[1], [1], []] and run.incs[-1].ok
  first = json.loads((tmp_path / "snap" / "maxtext-inc1-host0.json").read_text())
  r = first["restores"][-1]
  assert r["source"] == "snapshot" and r["step"] == KILL - 1 and r["rewind_steps"] <= 1, r
  # The losses it wrote before it died (MaxText writes a step's metrics
  # later, so the last may be missing) equal the reference's. The final
  # digest below proves the rest: incarnation 2 resumes from the Orbax step
  # incarnation 1 computed from this restore.
  seen = [s for s in range(KILL, newer + 1) if str(s) in first["losses"]]
  for s in seen:
    assert first["losses"][str(s)] == reference.report["losses"][str(s)], s
  r = run.report["restores"][-1]
  assert r["source"] == "maxtext" and r["step"] == newer, r
  assert f"Orbax step {newer} is newer than snapshot step {newer - 1}" in r["why"]
  assert run.incs[-1].restore["source"] == "maxtext"
  for s in range(newer + 1, STEPS):
    assert run.report["losses"][str(s)] == reference.report["losses"][str(s)], s
  final = str(STEPS - 1)
  assert run.incs[-1].digests[final] == reference.incs[0].digests[final]


def test_snapshots_off_resumes_from_maxtexts_orbax_checkpoint(reference, tmp_path, cache_dir):
  run = Run(tmp_path, cache_dir, "orbax", snapshots=False).run(
      [Kill(host=1, step=KILL, phase="step")])
  orbax_step = KILL // PERIOD * PERIOD
  assert KILL - orbax_step >= 1
  r = check_resumed(run, reference, source="maxtext", step=orbax_step)
  assert "snapshots are off" in r["why"]


def test_grain_data_resumes_where_the_snapshot_left_its_iterator(tmp_path, cache_dir):
  """With grain data the iterator's state is in the snapshot: the resumed
  run reads the batches the uninterrupted one read (its losses prove it)."""
  data = grain_args(tmp_path)
  ref = Run(tmp_path, cache_dir, "gref", snapshots=True, data=data).run()
  run = Run(tmp_path, cache_dir, "grain", snapshots=True, data=data).run(
      [Kill(host=1, step=KILL, phase="step")])
  check_resumed(run, ref, source="snapshot", step=KILL - 1)


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
