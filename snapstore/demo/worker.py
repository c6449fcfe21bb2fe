"""One host of a multi-process training job (run by ``snapstore.testing.supervisor``).

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
import os
import signal
import time
from pathlib import Path
from typing import Any


def _parser() -> argparse.ArgumentParser:
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
  return p


class _Worker:
  """This host's side of the job: restore or init, train, record (its
  report, and host 0's digests and restores for the supervisor)."""

  def __init__(self, a: argparse.Namespace, started: float) -> None:
    from snapstore.testing import in_place_from_env, init_from_env
    self.a = a
    self.host, self.host_count, self.inc = init_from_env()
    import jax

    import snapstore
    from snapstore.demo.example import ModelConfig
    self.cfg = ModelConfig() if a.batch is None else ModelConfig(batch=a.batch)
    self.in_place = in_place_from_env()
    self.full_devices = self.host_count * jax.local_device_count()
    self.opts = snapstore.SnapshotOptions(
        interval=snapstore.Every(1 if a.snapshots else 10**9), keep=a.keep,
        store=snapstore.HostFiles(dir=a.store), run_id=a.run_id,
        persistent_interval=a.checkpoint_every,
        redundancy=(snapstore.Parity(a.parity_k) if a.redundancy == "parity"
                    else snapstore.Replicas(a.replicas)),
        replica_interval=a.replica_interval, hosts_per_domain=a.hosts_per_domain)
    attempt = int(os.environ.get("SNAPSTORE_ATTEMPT", "0"))
    self.report: dict[str, Any] = {
        "host": self.host, "incarnation": self.inc, "attempt": attempt, "pid": os.getpid(),
        "in_place": self.in_place, "losses": {}, "digests": {}, "trained": {}, "times": {},
        "save_s": {}, "started": started, "restores": [], "recoveries": [], "phases": []}
    self.out = Path(a.out) / (f"inc{self.inc}-host{self.host}"
                              + (f"-r{attempt}" if attempt else "") + ".json")
    self.mgr: Any = None
    self.start_of_pass = 0

  def mark(self, name: str) -> None:  # a timeline of this process, for the demo's report
    self.report["phases"].append((name, time.time()))

  def write(self) -> None:  # atomically: a SIGKILL must not leave a torn report
    from snapstore._manifest import write_atomic
    self.report["save_metrics"] = self.mgr.metrics.as_dict()
    write_atomic(self.out, json.dumps(self.report).encode())

  def digest(self, trainer: Any, state: Any, step: int) -> str:
    """The global state's sha256 (every host gets every byte: one jitted
    all-gather on the trainer's mesh)."""
    from snapstore.testing import global_digest, report_digest
    value = global_digest(state, trainer.replicated)
    if self.host == 0:
      report_digest(step, value, self.inc)
    return value

  def restore_or_init(self, trainer: Any, hosts: list[int] | None = None) -> tuple[Any, int]:
    import snapstore
    from snapstore.testing import report_restore
    t0 = time.time()
    try:
      r = self.mgr.restore(trainer.abstract_state())
    except snapstore.NothingToRestoreError:
      return trainer.init_state(), 1
    if self.host == 0:  # the supervisor's incarnation report
      report_restore(r.summary(), self.inc)
    report = self.report
    report["restores"].append(dict(r.summary(), started=t0, ended=time.time(),
                                   devices=trainer.mesh.size, hosts=hosts))
    report.setdefault("restore", report["restores"][-1])
    report["restore_start"], report["restore_end"] = t0, time.time()
    if self.a.digest_restore:
      report["digests"][r.step] = report["restores"][-1]["digest"] = self.digest(
          trainer, r.state, r.step)
    return r.state, r.step + 1

  def train(self, trainer: Any, state: Any, s: int) -> tuple[Any, float]:
    t_step = time.perf_counter()
    state, out = trainer.step(state, s)
    loss = float(out)  # blocks until the step is done everywhere
    if s == self.start_of_pass:
      self.mark("first step")
    pad = self.a.min_step_s * self.full_devices / trainer.mesh.size  # one batch, shared
    time.sleep(max(0.0, pad - (time.perf_counter() - t_step)))
    if self.a.digest_every_step or s == self.a.steps:
      # before the save: a snapshot of step s is then always of a digest on
      # record (a loss right after the save still leaves the snapshot whole)
      self.report["trained"][s] = self.digest(trainer, state, s)
    t_save = time.perf_counter()
    self.mgr.save(s, state)
    self.report["save_s"][s] = time.perf_counter() - t_save  # what the loop waits for
    return state, loss

  def record(self, trainer: Any, state: Any, s: int, loss: float) -> None:
    self.report["losses"][s] = loss
    self.report["times"][s] = time.time()
    if s in self.report["trained"]:
      self.report["digests"][s] = self.report["trained"][s]
    self.write()

  def run(self) -> None:
    """Restore (or init), then train to the last step, restarting never."""
    from snapstore.demo.example import Trainer
    trainer = Trainer(self.cfg)
    state, start = self.restore_or_init(trainer)
    self.write()
    for s in range(start, self.a.steps + 1):
      state, loss = self.train(trainer, state, s)
      self.record(trainer, state, s, loss)

  def run_in_place(self) -> Any:
    """Train to the last step in ``live()`` blocks, healing in place: a
    failed block is discarded and every process restores together."""
    from snapstore import recovery
    from snapstore.demo.example import Trainer, make_mesh
    a, report = self.a, self.report
    job = recovery.InPlace()
    trainer: Trainer | None = None
    state, s = None, 0
    failures: tuple[type[BaseException], ...] = (*job.FAILURES, recovery.RestartRequired)
    while s <= a.steps:
      done = 0  # steps of this block: they count once its exit barrier passes
      try:
        with job.live() as devices:
          if job.changed:  # the first pass, or the job healed: everyone restores
            self.mark("membership")
            trainer = Trainer(self.cfg, make_mesh(devices))
            self.mark("trainer")
            state, s = self.restore_or_init(trainer, hosts=list(job.hosts))
            report["resizes"] = [r.as_dict() for r in job.resizes]
            self.start_of_pass = s
            self.mark("restored")
            trainer.compile(state)
            self.mark("compiled")
            self.write()
            continue  # the exit barrier: every first step starts compiled, together
          # The steps of a block count only if every process ends them all
          # (a failure inside discards the block; the snapshots of its
          # finished steps stay, so the rewind is still one step).
          assert trainer is not None  # built on the first pass
          if (a.short_steps is not None and len(job.hosts) < self.host_count
              and s - self.start_of_pass >= a.short_steps):
            time.sleep(0.05)  # hold: the next block may take the replacement in
            continue
          while done < a.live_every and s + done <= a.steps:
            state, loss = self.train(trainer, state, s + done)
            self.record(trainer, state, s + done, loss)
            done += 1
        s += done
        report["resizes"] = [r.as_dict() for r in job.resizes]
      except failures as e:
        self._failed(job, e)
    return job

  def _failed(self, job: Any, e: BaseException) -> None:
    """A failed block: wait for the job to heal, or exit for a full restart."""
    from snapstore import recovery
    self.mark(f"failed: {type(e).__name__}")
    try:
      if isinstance(e, recovery.RestartRequired):  # from live(): no order left
        raise e
      job.failed(e)
    except recovery.RestartRequired as why:  # launch restarts the whole job
      self.report["fallback"] = str(why)
      self.write()
      # no cleanup: a drain or an Orbax save may wait on the dead peer
      os._exit(recovery.RESTART_EXIT_CODE)
    finally:
      self.report["recoveries"] = [r.as_dict() for r in job.recoveries]
      self.report["resizes"] = [r.as_dict() for r in job.resizes]
      self.report["aborts"] = job.watchdog.aborts if job.watchdog else []


def main() -> int:
  started = time.time()
  faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <pid>`: every thread's stack, to the log
  w = _Worker(_parser().parse_args(), started)
  import snapstore
  job = None
  with snapstore.SnapshotManager(w.opts, persistent=w.a.persistent) as w.mgr:
    w.report["restore_start"] = time.time()
    if w.in_place:
      job = w.run_in_place()
    else:
      w.run()
    w.mgr.wait_until_finished()
  w.write()
  if job is not None:
    job.close()
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
