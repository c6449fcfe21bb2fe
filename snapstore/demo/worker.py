"""One host of a multi-process training job (run by ``snapstore.launch``).

``python -m snapstore.demo.worker --steps N --out DIR --store DIR --run-id R
[--persistent PATH --checkpoint-every K] [--hosts-per-domain H] [--replicas R]``

Restores from the freshest snapshot (or Orbax) if there is one, trains to
step N with a snapshot every step, and writes ``DIR/inc<i>-host<h>.json``:
the restore result, the loss of each step and digests of the global state
(gathered across hosts) at the restored and the last step, or after every
step with ``--digest-every-step`` (for bitwise comparison with an
uninterrupted run).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path

import jax


def main() -> int:
  started = time.time()
  p = argparse.ArgumentParser()
  p.add_argument("--steps", type=int, required=True)
  p.add_argument("--out", required=True)
  p.add_argument("--store", required=True)
  p.add_argument("--run-id", default="job")
  p.add_argument("--persistent", default=None)
  p.add_argument("--checkpoint-every", type=int, default=0)
  p.add_argument("--hosts-per-domain", type=int, default=None)
  p.add_argument("--replicas", type=int, default=1)
  p.add_argument("--replica-interval", type=int, default=1,
                 help="replicas travel with every this-many-th snapshot")
  p.add_argument("--keep", type=int, default=2, help="snapshots kept per host")
  p.add_argument("--snapshots", type=int, default=1, help="0: GCS-only baseline")
  p.add_argument("--digest-restore", action=argparse.BooleanOptionalAction, default=True,
                 help="global state digest of the restored step")
  p.add_argument("--min-step-s", type=float, default=0.0,
                 help="pad each train step to this many seconds (a slower model)")
  p.add_argument("--digest-every-step", action="store_true",
                 help="global state digest after every step (else at restore and end)")
  a = p.parse_args()
  from snapstore.launch import init_from_env, report_digest  # noqa: PLC0415
  host, _, inc = init_from_env()
  import numpy as np  # noqa: PLC0415
  from jax.experimental import multihost_utils  # noqa: PLC0415

  import snapstore  # noqa: PLC0415
  from snapstore._manifest import write_atomic  # noqa: PLC0415
  from snapstore.demo.example import ModelConfig, Trainer  # noqa: PLC0415

  trainer = Trainer(ModelConfig())

  def digest(state, step: int) -> str:
    h = hashlib.sha256()
    for x in jax.tree.leaves(state):
      if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
      h.update(np.asarray(multihost_utils.process_allgather(x, tiled=True)).tobytes())
    if host == 0:
      report_digest(step, h.hexdigest(), inc)
    return h.hexdigest()

  opts = snapstore.SnapshotOptions(
      interval=1 if a.snapshots else 10**9, keep=a.keep, store_dir=a.store, run_id=a.run_id,
      persistent_interval=a.checkpoint_every, replicas=a.replicas,
      replica_interval=a.replica_interval,
      hosts_per_domain=a.hosts_per_domain)
  report = {"host": host, "incarnation": inc, "losses": {}, "digests": {}, "times": {},
            "started": started}

  def write() -> None:  # atomically: a SIGKILL must not leave a torn report
    report["save_metrics"] = mgr.metrics.as_dict()
    write_atomic(out, json.dumps(report).encode())
  out = Path(a.out) / f"inc{inc}-host{host}.json"
  with snapstore.SnapshotManager(opts, persistent=a.persistent) as mgr:
    report["restore_start"] = time.time()
    try:
      r = mgr.restore(trainer.abstract_state())
      state, start = r.state, r.step + 1
      report["restore"] = r.summary()
      report["restore_end"] = time.time()
      if a.digest_restore:
        report["digests"][r.step] = digest(state, r.step)
    except snapstore.NothingToRestoreError:
      state, start = trainer.init_state(), 1
    write()
    for s in range(start, a.steps + 1):
      t_step = time.perf_counter()
      state, loss = trainer.step(state, s)
      report["losses"][s] = float(loss)
      time.sleep(max(0.0, a.min_step_s - (time.perf_counter() - t_step)))
      mgr.save(s, state)
      report["times"][s] = time.time()
      if a.digest_every_step or s == a.steps:
        report["digests"][s] = digest(state, s)
      write()
    mgr.wait_until_finished()
  write()
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
