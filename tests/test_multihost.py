"""Real processes (jax.distributed on CPU, gloo), real SIGKILL, a replaced host.

4 hosts x 2 devices, 2 failure domains of 2 hosts, replicas=1. The reference is
an uninterrupted run of the same job; the restored state's digest (of the
global state, gathered across hosts) and every later loss must equal it.
"""

import json
import random
import shutil
import uuid
from pathlib import Path

import pytest

from snapstore.launch import Kill, launch

STEPS = 7


def run_job(tmp_path, name, kills=()):
  out = tmp_path / name
  out.mkdir()
  store = Path("/dev/shm") / f"snapstore-mh-{uuid.uuid4().hex[:8]}"
  try:
    incs = launch("snapstore._worker",
                  ["--steps", str(STEPS), "--out", str(out), "--store", str(store),
                   "--hosts-per-domain", "2"],
                  num_hosts=4, devices_per_host=2, store_dir=store, run_id="job",
                  kills=kills, timeout_s=240, log_dir=out)
  finally:
    shutil.rmtree(store, ignore_errors=True)
  last = incs[-1].number
  return incs, json.loads((out / f"inc{last}-host0.json").read_text())


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  incs, report = run_job(tmp_path_factory.mktemp("ref"), "ref")
  assert len(incs) == 1 and incs[0].ok
  return report


def test_killed_host_replaced_with_empty_store_restores_from_replicas(reference, tmp_path):
  kill_step = random.Random(1234).randint(5, STEPS - 1)
  incs, report = run_job(tmp_path, "kill",
                         [Kill(host=1, step=kill_step, lose_store=True)])
  assert [i.killed for i in incs] == [[1], []]
  assert incs[-1].ok
  r = report["restore"]
  assert r["source"] == "snapshot"
  # PROGRESS says step kill_step was being saved: its snapshot may or may not
  # have completed; the restore is at most one step behind.
  assert kill_step - 1 <= r["step"] <= kill_step
  assert r["rewind_steps"] == r["newest_step"] - r["step"] <= 1
  step = str(r["step"])
  assert report["digests"][step] == reference["digests"][step]
  for s in range(r["step"] + 1, STEPS + 1):
    assert report["losses"][str(s)] == reference["losses"][str(s)], s
  assert report["digests"][str(STEPS)] == reference["digests"][str(STEPS)]
