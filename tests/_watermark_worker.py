"""A job whose train step needs no other host (``tests/test_watermark.py``).

Each process of ``snapstore.testing.launch`` restores (or starts at step 0),
then trains ``--steps`` steps of an elementwise update of a state sharded
over every device of the job, with a snapshot every step: 4 failure
domains of one host each, ``keep=2``, replicas or parity. Killed inside a
step's replica exchange, a host leaves the others going on (nothing of
their step waits for it) until the supervisor tears the job down; their
saves fail or, where their half of the exchange did not touch the dead
host, commit. What a host writes to ``--out`` (``inc<n>-host<h>.json``):
the restore (step, source, and whether the state is bitwise the one the
job computes for that step), the last step it trained and the RAM tier's
counters.
"""

import argparse
import json
import os
from pathlib import Path

import jax
import numpy as np

import snapstore
from snapstore.testing import in_place_from_env, init_from_env

ROWS = 8  # a device's rows of the leaf


def expected(step: int, rows: int) -> np.ndarray:
  """The leaf after ``step`` steps, computed on the host: the job's own
  arithmetic, so a restore is checked bitwise against it."""
  a = np.arange(rows * 16, dtype=np.float32).reshape(rows, 16)
  for s in range(1, step + 1):
    a = a * np.float32(0.5) + np.float32(s)
  return a


def _restore(mgr: snapstore.SnapshotManager, sharding, rows: int) -> tuple[dict, int, dict]:
  """(state, step, what the report says of it): the newest snapshot, else step 0."""
  try:
    r = mgr.restore({"a": jax.ShapeDtypeStruct((rows, 16), np.float32, sharding=sharding),
                     "step": 0})
  except snapstore.NothingToRestoreError as e:
    return {"a": jax.device_put(expected(0, rows), sharding), "step": 0}, 0, {
        "step": None, "error": str(e)}
  shards = sorted(r.state["a"].addressable_shards, key=lambda s: s.index[0].start)
  got = np.concatenate([np.asarray(s.data) for s in shards])
  want = np.concatenate([expected(r.step, rows)[s.index[0]] for s in shards])
  return r.state, r.step, {"step": r.step, "source": r.source.value,
                           "bitwise": bool(np.array_equal(got, want)
                                           and r.state["step"] == r.step)}


def _step_fn(sharding):
  return jax.jit(lambda x, s: x * np.float32(0.5) + s.astype(np.float32),
                 out_shardings=sharding, donate_argnums=0)


def _sharding(devices):
  mesh = jax.sharding.Mesh(np.array(devices), ("d",))
  return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))


def main() -> int:
  p = argparse.ArgumentParser()
  p.add_argument("--steps", type=int, required=True)
  p.add_argument("--store", required=True)
  p.add_argument("--out", required=True)
  p.add_argument("--redundancy", choices=("replica", "parity"), default="replica")
  p.add_argument("--live-every", type=int, default=3, help="in place: steps per live() block")
  a = p.parse_args()
  host, _, inc = init_from_env()
  rows = ROWS * len(jax.devices())
  redundancy = snapstore.Parity(k=3) if a.redundancy == "parity" else snapstore.Replicas(1)
  opts = snapstore.SnapshotOptions(keep=2, store=snapstore.HostFiles(dir=a.store), run_id="job",
                                   hosts_per_domain=1, redundancy=redundancy)
  report: dict = {"host": host, "incarnation": inc, "restores": []}
  out = Path(a.out) / f"inc{inc}-host{host}.json"

  def write() -> None:
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(report))
    os.replace(tmp, out)

  def train(mgr, step_fn, state: dict, s: int) -> dict:
    state = {"a": step_fn(state["a"], np.int32(s)), "step": s}
    jax.block_until_ready(state["a"])
    mgr.save(s, state)
    report["trained"], report["metrics"] = s, mgr.metrics.as_dict()
    write()
    return state

  with snapstore.SnapshotManager(opts) as mgr:
    if in_place_from_env():
      _in_place(mgr, a, rows, report, write, train)
    else:
      sharding = _sharding(jax.devices())
      state, start, report["restore"] = _restore(mgr, sharding, rows)
      write()
      step_fn = _step_fn(sharding)
      for s in range(start + 1, a.steps + 1):
        state = train(mgr, step_fn, state, s)
    try:
      mgr.wait_until_finished()
    except snapstore.DrainFailedError:
      pass  # counted; its store keeps what it had
  return 0


def _in_place(mgr, a, rows: int, report: dict, write, train) -> None:
  """Trains in ``live()`` blocks of ``--live-every`` steps, healing in place:
  a block that fails is discarded and every process restores together."""
  from snapstore import recovery
  job = recovery.InPlace()
  state, s, step_fn = None, 0, None
  while s < a.steps:
    done = 0
    try:
      with job.live() as devices:
        if job.changed:  # the first pass, or the job healed: everyone restores
          sharding = _sharding(devices)
          step_fn = _step_fn(sharding)
          state, s, got = _restore(mgr, sharding, rows)
          report["restores"].append(got)
          report["restore"] = got
          write()
          continue
        while done < a.live_every and s + done < a.steps:
          state = train(mgr, step_fn, state, s + done + 1)
          done += 1
      s += done
    except (*job.FAILURES, recovery.RestartRequired) as e:
      report.setdefault("failed_at", []).append(s + done + 1)  # the step it was in
      write()
      try:
        if isinstance(e, recovery.RestartRequired):
          raise
        job.failed(e)
      except recovery.RestartRequired:
        report["fallback"] = str(e)
        write()
        os._exit(recovery.RESTART_EXIT_CODE)
  job.close()


if __name__ == "__main__":
  raise SystemExit(main())
