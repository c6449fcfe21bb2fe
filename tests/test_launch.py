"""``snapstore launch``: the coordination service on loopback only, and kill
specs that cannot fire are errors (real processes, jax.distributed on CPU)."""

import json
import os
from pathlib import Path

import pytest

from snapstore.testing import Kill, launch

ROOT = Path(__file__).resolve().parents[1]
ENV = {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


@pytest.mark.slow  # real multi-process jobs: the full suite only
def test_the_coordination_service_listens_on_loopback_only(tmp_path, store_dir):
  out = tmp_path / "listening.json"
  incs = launch("tests._probe_worker", [str(out)], num_hosts=2, devices_per_host=1,
                store_dir=store_dir, run_id="probe", timeout_s=120, env=ENV,
                log_dir=tmp_path)
  assert incs[-1].ok
  assert json.loads(out.read_text()) == ["127.0.0.1"]


@pytest.mark.slow
def test_a_kill_whose_store_the_supervisor_cannot_see_is_an_error(tmp_path, store_dir):
  worker_store = tmp_path / "the-workers-store"
  with pytest.raises(RuntimeError, match="never fired"):
    launch("snapstore.demo.worker", ["--steps", "3", "--out", str(tmp_path), "--store",
                                     str(worker_store)],
           num_hosts=2, devices_per_host=1, store_dir=store_dir, run_id="job",
           kills=[Kill(host=1, step=2)], timeout_s=180, log_dir=tmp_path)


@pytest.mark.parametrize("bad", [{"delay_s": -1.0}, {"delay_s": float("nan")},
                                 {"delay_s": 0.5, "phase": "step"}])
def test_a_kill_delay_must_be_finite_and_for_supervisor_kills(bad):
  with pytest.raises(ValueError, match="delay_s"):
    Kill(host=1, step=3, **bad)


@pytest.mark.slow
def test_a_delayed_kill_fires_that_long_after_its_step(tmp_path, store_dir):
  """Steps padded to 0.3 s and a kill 1.5 s after host 1 reports step 2:
  host 1 records later steps first (a kill at once would stop it at 2)."""
  incs = launch("snapstore.demo.worker",
                ["--steps", "10", "--out", str(tmp_path), "--store", str(store_dir),
                 "--run-id", "job", "--min-step-s", "0.3"],
                num_hosts=2, devices_per_host=1, store_dir=store_dir, run_id="job",
                kills=[Kill(host=1, step=2, delay_s=1.5)], timeout_s=240, log_dir=tmp_path)
  assert incs[0].killed == [1] and incs[-1].ok
  times = json.loads((tmp_path / "inc0-host1.json").read_text())["times"]
  assert max(map(int, times)) >= 4
