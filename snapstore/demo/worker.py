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
import faulthandler
import json
import signal
import time
from pathlib import Path
from typing import Any


def main() -> int:
  started = time.time()
  faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <pid>`: every thread's stack, to the log
  p = argparse.ArgumentParser()
  p.add_argument("--steps", type=int, required=True)
  p.add_argument("--out", required=True)
  p.add_argument("--store", required=True)
  p.add_argument("--run-id", default="job")
  p.add_argument("--persistent", default=None)
  p.add_argument("--checkpoint-every", type=int, default=0)
  p.add_argument("--hosts-per-domain", type=int, default=None)
  p.add_argument("--replicas", type=int, default=1)
  p.add_argument("--redundancy", choices=("replica", "parity"), default="replica")
  p.add_argument("--parity-k", type=int, default=3)
  p.add_argument("--replica-interval", type=int, default=1,
                 help="replicas travel with every this-many-th snapshot")
  p.add_argument("--keep", type=int, default=2, help="snapshots kept per host")
  p.add_argument("--snapshots", type=int, default=1, help="0: GCS-only baseline")
  p.add_argument("--digest-restore", action=argparse.BooleanOptionalAction, default=True,
                 help="global state digest of the restored step")
  p.add_argument("--min-step-s", type=float, default=0.0,
                 help="pad each train step to this many seconds on all the job's devices "
                      "(a slower model); on fewer, the same global batch takes "
                      "proportionally longer")
  p.add_argument("--digest-every-step", action="store_true",
                 help="global state digest after every step (else at restore and end)")
  p.add_argument("--live-every", type=int, default=1, choices=range(1, 1001),
                 metavar="K", help="in place: steps per live() block (one membership "
                                   "barrier each), 1 to 1000")
  p.add_argument("--short-steps", type=int, default=None, metavar="K",
                 help="in place, with launch --min-hosts: while the job runs on fewer "
                      "hosts, train K steps, then hold until it grows back (a grow at a "
                      "known step, for tests)")
  p.add_argument("--batch", type=int, default=None,
                 help="global batch (default the model's 8; a job that may go on with "
                      "fewer hosts needs one every data-parallel degree divides, e.g. 24)")
  a = p.parse_args()
  from snapstore.launch import global_digest, in_place_from_env, init_from_env, report_digest
  host, host_count, inc = init_from_env()
  import os

  import jax

  import snapstore
  from snapstore._manifest import write_atomic
  from snapstore.demo.example import ModelConfig, Trainer, make_mesh

  cfg = ModelConfig() if a.batch is None else ModelConfig(batch=a.batch)
  in_place = in_place_from_env()
  full_devices = host_count * jax.local_device_count()

  def digest(trainer: Trainer, state, step: int) -> str:
    """The global state's sha256 (every host gets every byte: one jitted
    all-gather on the trainer's mesh)."""
    value = global_digest(state, trainer.replicated)
    if host == 0:
      report_digest(step, value, inc)
    return value

  opts = snapstore.SnapshotOptions(
      interval=1 if a.snapshots else 10**9, keep=a.keep, store_dir=a.store, run_id=a.run_id,
      persistent_interval=a.checkpoint_every, replicas=a.replicas,
      redundancy=a.redundancy, parity_k=a.parity_k,
      replica_interval=a.replica_interval,
      hosts_per_domain=a.hosts_per_domain)
  attempt = int(os.environ.get("SNAPSTORE_ATTEMPT", "0"))
  report: dict[str, Any] = {
      "host": host, "incarnation": inc, "attempt": attempt, "pid": os.getpid(),
      "in_place": in_place, "losses": {}, "digests": {}, "trained": {}, "times": {}, "save_s": {},
      "started": started, "restores": [], "recoveries": [], "phases": []}

  def mark(name: str) -> None:  # a timeline of this process, for the demo's report
    report["phases"].append((name, time.time()))

  def write() -> None:  # atomically: a SIGKILL must not leave a torn report
    report["save_metrics"] = mgr.metrics.as_dict()
    write_atomic(out, json.dumps(report).encode())
  out = Path(a.out) / (f"inc{inc}-host{host}" + (f"-r{attempt}" if attempt else "") + ".json")

  def restore_or_init(trainer: Trainer, hosts: list[int] | None = None):
    t0 = time.time()
    try:
      r = mgr.restore(trainer.abstract_state())
    except snapstore.NothingToRestoreError:
      return trainer.init_state(), 1
    report["restores"].append(dict(r.summary(), started=t0, ended=time.time(),
                                   devices=trainer.mesh.size, hosts=hosts))
    report.setdefault("restore", report["restores"][-1])
    report["restore_start"], report["restore_end"] = t0, time.time()
    if a.digest_restore:
      report["digests"][r.step] = report["restores"][-1]["digest"] = digest(
          trainer, r.state, r.step)
    return r.state, r.step + 1

  def train(trainer: Trainer, state, s: int):
    t_step = time.perf_counter()
    state, out = trainer.step(state, s)
    loss = float(out)  # blocks until the step is done everywhere
    if s == start_of_pass[0]:
      mark("first step")
    pad = a.min_step_s * full_devices / trainer.mesh.size  # the devices share one batch
    time.sleep(max(0.0, pad - (time.perf_counter() - t_step)))
    t_save = time.perf_counter()
    mgr.save(s, state)
    report["save_s"][s] = time.perf_counter() - t_save  # what the loop waits for
    return state, loss

  def record(trainer: Trainer, state, s: int, loss: float) -> None:
    report["losses"][s] = loss
    report["times"][s] = time.time()
    if a.digest_every_step or s == a.steps:
      report["digests"][s] = report["trained"][s] = digest(trainer, state, s)
    write()

  with snapstore.SnapshotManager(opts, persistent=a.persistent) as mgr:
    report["restore_start"] = time.time()
    start_of_pass = [0]
    trainer: Trainer | None
    if not in_place:
      trainer = Trainer(cfg)
      state, start = restore_or_init(trainer)
      write()
      for s in range(start, a.steps + 1):
        state, loss = train(trainer, state, s)
        record(trainer, state, s, loss)
    else:
      from snapstore import recovery
      job = recovery.InPlace()
      trainer = None
      s = 0
      start_of_pass = [0]
      failures: tuple[type[BaseException], ...] = (*job.FAILURES, recovery.RestartRequired)
      while s <= a.steps:
        done = 0  # steps of this block: they count once its exit barrier passes
        try:
          with job.live() as devices:
            if job.changed:  # the first pass, or the job healed: everyone restores
              mark("membership")
              trainer = Trainer(cfg, make_mesh(devices))
              mark("trainer")
              state, s = restore_or_init(trainer, hosts=list(job.hosts))
              report["resizes"] = [r.as_dict() for r in job.resizes]
              start_of_pass[0] = s
              mark("restored")
              trainer.compile(state)
              mark("compiled")
              write()
              continue  # the exit barrier: every first step starts compiled, together
            # The steps of a block count only if every process ends them all
            # (a failure inside discards the block; the snapshots of its
            # finished steps stay, so the rewind is still one step).
            assert trainer is not None  # built on the first pass
            if (a.short_steps is not None and len(job.hosts) < host_count
                and s - start_of_pass[0] >= a.short_steps):
              time.sleep(0.05)  # hold: the next block may take the replacement in
              continue
            while done < a.live_every and s + done <= a.steps:
              state, loss = train(trainer, state, s + done)
              record(trainer, state, s + done, loss)
              done += 1
          s += done
          report["resizes"] = [r.as_dict() for r in job.resizes]
        except failures as e:
          mark(f"failed: {type(e).__name__}")
          try:
            if isinstance(e, recovery.RestartRequired):  # from live(): no order left
              raise e
            job.failed(e)
          except recovery.RestartRequired as why:  # launch restarts the whole job
            report["fallback"] = str(why)
            write()
            # no cleanup: a drain or an Orbax save may wait on the dead peer
            os._exit(recovery.RESTART_EXIT_CODE)
          finally:
            report["recoveries"] = [r.as_dict() for r in job.recoveries]
            report["resizes"] = [r.as_dict() for r in job.resizes]
            report["aborts"] = job.watchdog.aborts if job.watchdog else []
    mgr.wait_until_finished()
  write()
  if in_place:
    job.close()
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
