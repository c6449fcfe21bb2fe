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
from snapstore.testing import init_from_env

ROWS = 8  # a device's rows of the leaf


def expected(step: int, rows: int) -> np.ndarray:
  """The leaf after ``step`` steps, computed on the host: the job's own
  arithmetic, so a restore is checked bitwise against it."""
  a = np.arange(rows * 16, dtype=np.float32).reshape(rows, 16)
  for s in range(1, step + 1):
    a = a * np.float32(0.5) + np.float32(s)
  return a


def main() -> int:
  p = argparse.ArgumentParser()
  p.add_argument("--steps", type=int, required=True)
  p.add_argument("--store", required=True)
  p.add_argument("--out", required=True)
  p.add_argument("--redundancy", choices=("replica", "parity"), default="replica")
  a = p.parse_args()
  host, _, inc = init_from_env()
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("d",))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
  rows = ROWS * len(jax.devices())
  redundancy = snapstore.Parity(k=3) if a.redundancy == "parity" else snapstore.Replicas(1)
  opts = snapstore.SnapshotOptions(keep=2, store=snapstore.HostFiles(dir=a.store), run_id="job",
                                   hosts_per_domain=1, redundancy=redundancy)
  step_fn = jax.jit(lambda x, s: x * np.float32(0.5) + s.astype(np.float32),
                    out_shardings=sharding, donate_argnums=0)

  def state_at(step: int) -> dict:
    return {"a": jax.device_put(expected(step, rows), sharding), "step": step}

  report: dict = {"host": host, "incarnation": inc}
  out = Path(a.out) / f"inc{inc}-host{host}.json"

  def write() -> None:
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(report))
    os.replace(tmp, out)

  with snapstore.SnapshotManager(opts) as mgr:
    try:
      r = mgr.restore({"a": jax.ShapeDtypeStruct((rows, 16), np.float32, sharding=sharding),
                       "step": 0})
      got = np.concatenate([np.asarray(s.data) for s in sorted(
          r.state["a"].addressable_shards, key=lambda s: s.index[0].start)])
      mine = [s.index[0] for s in r.state["a"].addressable_shards]
      want = np.concatenate([expected(r.step, rows)[i] for i in sorted(
          mine, key=lambda i: i.start)])
      report["restore"] = {"step": r.step, "source": r.source.value,
                           "bitwise": bool(np.array_equal(got, want)
                                           and r.state["step"] == r.step)}
      state, start = r.state, r.step
    except snapstore.NothingToRestoreError as e:
      report["restore"] = {"step": None, "error": str(e)}
      state, start = state_at(0), 0
    write()
    for s in range(start + 1, a.steps + 1):
      state = {"a": step_fn(state["a"], np.int32(s)), "step": s}
      mgr.save(s, state)
      report["trained"] = s
      report["metrics"] = mgr.metrics.as_dict()
      write()
    try:
      mgr.wait_until_finished()
    except snapstore.DrainFailedError:
      pass  # counted; its store keeps what it had
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
