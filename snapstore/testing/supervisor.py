"""A local supervisor that stands in for JobSet: N host processes, restarts, faults.

``launch`` starts ``num_hosts`` processes of a training module with
``jax.distributed`` on CPU (gloo collectives, ``devices_per_host`` devices
each). When any process dies, the others are killed and the whole job
restarts as a new incarnation — what the JAX coordination service forces on a
real multi-controller job. Faults are real SIGKILLs: ``Kill(host, step)``
is sent by the supervisor when that host's store reports the step (its
``PROGRESS`` file); ``Kill(host, step, phase=...)`` arms a fault point in the
library so the process kills itself inside capture, replica transfer,
manifest write or restore; ``lose_store=True`` also wipes the host's RAM
store, modelling a replaced machine.

Each process gets its identity from the environment: ``SNAPSTORE_COORDINATOR``,
``SNAPSTORE_NUM_HOSTS``, ``SNAPSTORE_HOST``, ``SNAPSTORE_INCARNATION``,
``SNAPSTORE_DEVICES_PER_HOST``; ``SNAPSTORE_REPORT_DIR`` is where the workers
leave what the incarnation report carries (:mod:`snapstore._reports`: host
0's worker its restores and digests, the engine missing hosts, resizes and
the reason for a full restart). A worker that wants its restore in the
report calls :func:`snapstore.testing.report_restore` (:mod:`.worker` has
the others).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .. import _faults
from .._backends import read_progress
from .._jax_compat import without_cpu_cache
from .._reports import IN_PLACE_ENV, RESTART_EXIT_CODE
from ..errors import JobStalledError
from .job import Job, check_args, placements, reserve_port
from .kills import (
    Incarnation,
    Kill,
    _arming,
    _fence,
    _fired,
    _record_kill,
    _restart_reason,
    _stopped,
)
from .stall import StallPolicy, StallWatch

logger = logging.getLogger(__name__)

#: in ``launch``'s args, the directory of the host's machine (``machines``)
MACHINE = "{machine}"
POLL_S = 0.02  # how often the supervisor reads PROGRESS and process states
FENCE_POLL_S = 0.25  # how often it reads the survivors' reports of missing hosts
PROGRESS_POLL_S = 0.25  # how often the stall watch reads every host's progress
STACKS_WAIT_S = 1.5  # how long stalled processes get to write their stacks


def launch(module: str, args: Sequence[str], *, num_hosts: int, devices_per_host: int,
           store_dir: str | os.PathLike[str], run_id: str, kills: Sequence[Kill] = (),
           shrink_to: int | None = None, max_incarnations: int = 3,
           timeout_s: float = 300.0, log_dir: str | os.PathLike[str] | None = None,
           env: dict[str, str] | None = None,
           between: Callable[[Incarnation], None] | None = None,
           bind_address: str = "127.0.0.1", in_place: bool = False,
           host_service: bool = True, max_replacements: int = 8,
           min_hosts: int | None = None,
           replacement_delay_s: float = 0.0,
           teardown_delay_s: float = 0.0,
           stall: StallPolicy | None = None,
           machines: Sequence[Sequence[int]] | None = None) -> list[Incarnation]:
  """Runs ``python -m module args`` on ``num_hosts`` local processes until all
  exit 0, restarting the whole job after a failure (or, ``in_place``,
  replacing the failed host alone). The JAX coordination service listens
  on ``bind_address`` only (loopback by default).

  Args:
    module, args, num_hosts, devices_per_host: what runs, on how many
      processes, with how many CPU devices each.
    store_dir: the workers' ``HostFiles.dir``, where the supervisor reads
      each host's progress (a kill it cannot see happen is an error).
    run_id, kills: the workers' ``SnapshotOptions.run_id``; faults to inject.
    shrink_to: restart with fewer hosts (the first ``shrink_to`` stores kept).
    max_incarnations, timeout_s: runs of the job allowed; its time limit.
    log_dir, env: logs and reports (default: under the store); more environment.
    between: run after a failed incarnation, before the next (to damage stores).
    in_place: the workers recover in place (:mod:`snapstore.recovery`): the
      supervisor hosts the coordination service, and a worker that dies is
      replaced alone, with the same host id (``Incarnation.replaced``). A
      worker exiting with ``recovery.RESTART_EXIT_CODE``, more than
      ``max_replacements`` replacements, or a JAX without the APIs it needs
      restart the whole job instead (``Incarnation.fallback`` says why).
    host_service: False leaves the service in process 0 (``jax.distributed``'s
      way): losing host 0 then ends the incarnation.
    min_hosts: in place, the survivors go on while at least this many hosts
      are live, without waiting for a replacement
      (:class:`snapstore.recovery.ResizePolicy`), and grow back when it
      joins; each change is in ``Incarnation.resizes``, and replacements not
      yet started when a worker finishes in ``Incarnation.unreplaced``.
    replacement_delay_s: each replacement starts this much later (no spare
      host at once); without ``in_place``, the incarnation after a failure.
    teardown_delay_s: a full restart: after a host fails, the others run on
      this long (or until they exit), as under a slow scheduler.
    stall: when a job whose processes all live but whose steps stopped is
      called stalled (:class:`StallPolicy`; default: no step for
      ``max(60 s, 20 x the median step)``, 120 s after a process started or
      exited). Every process then writes its Python stacks into its log, the
      job is stopped and :class:`snapstore.errors.JobStalledError` raised.
    machines: ``machines[i][h]``: the machine host ``h`` runs on in
      incarnation ``i`` (the last entry repeats), its store under
      ``store_dir/machine-<m>`` (``{machine}`` in ``args``; without
      ``machines``: ``store_dir``); ``lose_store`` then loses the machine.

  Each process logs to ``log_dir/inc<N>-host<H>.log``; one the job no longer
  needs, or alive when ``launch`` raises (Ctrl-C, a signal), is killed.

  Returns:
    One :class:`Incarnation` per run of the job, the last one succeeded.

  Raises:
    ValueError: ``min_hosts`` without ``in_place`` or out of range; a delay < 0.
    RuntimeError: the job still fails after ``max_incarnations``.
    TimeoutError: the job ran past ``timeout_s``.
    JobStalledError: a ``TimeoutError``: the job stalled (``stall``).
  """
  check_args(num_hosts, in_place, min_hosts, replacement_delay_s=replacement_delay_s,
              teardown_delay_s=teardown_delay_s)
  placed = placements(machines, num_hosts, in_place)
  # (each process logs, by default beside the reports: a stall's stacks land there)
  report_dir = Path(log_dir) if log_dir else Path(store_dir) / run_id / "reports"
  report_dir.mkdir(parents=True, exist_ok=True)
  job = Job(module, list(args), devices_per_host, store_dir, run_id, list(kills),
            [k for k in kills if k.incarnation is None],  # fired in any incarnation
            time.monotonic() + timeout_s, timeout_s, report_dir, report_dir, env or {},
            bind_address, in_place, host_service, max_replacements, min_hosts,
            replacement_delay_s, teardown_delay_s, StallWatch(stall or StallPolicy()),
            placed)
  return _incarnations(job, num_hosts, max_incarnations, between, shrink_to)


def _incarnations(job: Job, hosts: int, max_incarnations: int,
                  between: Callable[[Incarnation], None] | None,
                  shrink_to: int | None) -> list[Incarnation]:
  """Runs the job until an incarnation succeeds; restarts it after each
  failure (see :func:`launch`)."""
  out: list[Incarnation] = []
  for number in range(max_incarnations):
    inc, failed = Supervisor(job, number, hosts).run()
    out.append(inc)
    if not failed:
      return out
    if between is not None:
      between(inc)
    if job.replacement_delay_s and not job.in_place:  # no spare host until then
      time.sleep(max(0.0, (inc.kill_time or inc.ended) + job.replacement_delay_s
                     - time.time()))
    if shrink_to:
      hosts = shrink_to
  raise RuntimeError(f"job still failing after {max_incarnations} incarnations; "
                     f"logs: {job.log_dir}")


class Supervisor:
  """One incarnation of a :func:`launch` job: it starts the processes, then
  polls until every process has exited (or one failed): it fires the kills
  that are due, starts the replacements that are due (in place), fences
  hosts reported missing, and reaps exits; then it collects the workers'
  reports into the :class:`Incarnation`."""

  def __init__(self, job: Job, number: int, hosts: int) -> None:
    self.job, self.hosts = job, hosts
    self.inc = Incarnation(number, hosts, time.time())
    self.pending = ([k for k in job.kills if k.incarnation == number and k.host < hosts]
                    + [k for k in job.carried if k.host < hosts])
    self.armed: dict[int, list[Kill]] = {}  # what each host's running process was armed with
    self.sent: set[int] = set()  # pids signalled here (their phase kills did not fire)
    self.attempts = dict.fromkeys(range(hosts), 0)
    self.procs: dict[int, subprocess.Popen[bytes]] = {}
    self.started: dict[int, float] = {}  # when each host's process started
    self.due_at: dict[int, float] = {}  # host -> when its replacement starts (in place)
    self.seen_at: dict[int, float] = {}  # step -> when a host to kill there reported it
    self.service: Any = None
    self.extra_env: dict[str, str] = {}
    self.failed = False
    self.failed_at: float | None = None  # time.monotonic() of the first failure
    self.logs: dict[int, Path] = {}  # each host's current log

  def run(self) -> tuple[Incarnation, bool]:
    """Runs the incarnation; returns it and whether it failed."""
    job, inc = self.job, self.inc
    reservation = reserve_port(job.bind_address)
    self.port = reservation.getsockname()[1]
    for stale in (self._report("restore"), self._report("digests"), self._report("resize"),
                  *job.report_dir.glob(f"restart-inc{inc.number}-host*.json")):
      stale.unlink(missing_ok=True)
    try:
      self._serve()
      self.procs = {h: self._start(h) for h in range(self.hosts)}
      self.started = dict.fromkeys(self.procs, time.time())
      fence_at = progress_at = 0.0
      while self.procs.keys() - inc.exit_codes.keys():
        if time.monotonic() > job.deadline:
          self._dump_stacks()
          self._kill_all("timed out")
          raise TimeoutError(f"job did not finish in {job.timeout_s} s (incarnation "
                             f"{inc.number}); each process's Python stacks are at the end of "
                             f"its log in {job.log_dir}")
        now = time.monotonic()
        self._fire_due_kills(now)
        self._start_due_replacements()
        if self.extra_env and self.service is not None and now >= fence_at:
          fence_at = now + FENCE_POLL_S
          _fence(inc, self.procs, self.started, job.report_dir, now)
        self._reap()
        if now >= progress_at:
          progress_at = now + PROGRESS_POLL_S
          self._watch_progress(now)
        if self.failed and self.failed_at is None:
          self.failed_at = time.monotonic()
        if (self.failed_at is not None
            and time.monotonic() >= self.failed_at + job.teardown_delay_s):
          # the coordination service would abort the rest: do it now.
          for h, p in self.procs.items():
            if p.poll() is None:
              p.kill()
            inc.exit_codes[h] = p.wait()
          break
        time.sleep(POLL_S)
      for p in self.procs.values():  # (a frozen host the job finished without)
        if p.poll() is None:
          p.kill()
          p.wait()
    finally:
      self._kill_all("launch is ending")
      if self.service is not None:
        self.service.shutdown()
      reservation.close()
    self._finish()
    return inc, self.failed

  def _watch_progress(self, now: float) -> None:
    """Feeds the stall watch every host's progress; with every process
    alive and none of it for the watch period, stops the job (:mod:`.stall`)."""
    job, inc = self.job, self.inc
    job.watch.observe({h: read_progress(job.store_of(inc.number, h))
                       for h in range(self.hosts)}, now)
    quiet = job.watch.stalled_for(now)
    if (quiet is None or self.due_at or self.failed
        or any(p.poll() is not None for p in self.procs.values())):
      return
    phase = job.watch.phase()
    self._dump_stacks()
    self._kill_all("stalled")
    logs = tuple(str(self.logs[h]) for h in sorted(self.logs))
    raise JobStalledError(
        f"job stalled in incarnation {inc.number}: every process alive, no host advanced "
        f"for {quiet:.0f} s (watch period {job.watch.period_s():.0f} s); phase: {phase}. "
        f"Stopped; each process's Python stacks are at the end of its log in {job.log_dir}",
        phase=phase, incarnation=inc.number, logs=logs)

  def _dump_stacks(self) -> None:
    """Every live process writes every thread's Python stack into its log
    (``faulthandler`` on SIGUSR1, registered by :mod:`._boot`); a frozen one
    is resumed first so that it can."""
    live = [p for p in self.procs.values() if p.poll() is None]
    for p in live:
      with contextlib.suppress(ProcessLookupError):
        if _stopped(p.pid):
          p.send_signal(signal.SIGCONT)
        p.send_signal(signal.SIGUSR1)
    if live:
      time.sleep(STACKS_WAIT_S)

  def _kill_all(self, why: str) -> None:
    """Kills every process of this incarnation that still runs, and says so."""
    live = {h: p for h, p in self.procs.items() if p.poll() is None}
    for p in live.values():
      with contextlib.suppress(ProcessLookupError):
        p.kill()
    for p in live.values():
      p.wait()
    if live:
      logger.warning("incarnation %d: %s: killed the job's processes %s (hosts %s)",
                     self.inc.number, why, [p.pid for p in live.values()], sorted(live))

  def _report(self, kind: str) -> Path:
    return self.job.report_dir / f"{kind}-inc{self.inc.number}.json"

  def _serve(self) -> None:
    """In place: the workers' environment, and the coordination service
    here unless ``host_service`` is off."""
    if not self.job.in_place:
      return
    from .. import recovery  # imports jax: only when asked
    inc = self.inc
    inc.fallback = recovery.unsupported()
    if inc.fallback is not None:
      logger.warning("in-place recovery is off, full restarts instead: %s", inc.fallback)
      return
    self.extra_env = {IN_PLACE_ENV: "1"}
    if self.job.min_hosts is not None:
      self.extra_env[recovery.MIN_HOSTS_ENV] = str(self.job.min_hosts)
    if self.job.host_service:
      address = f"{self.job.bind_address}:{self.port}"
      self.service = recovery.start_service(address, self.hosts)
      self.extra_env[recovery.SERVICE_ENV] = "external"

  def _start(self, h: int) -> subprocess.Popen[bytes]:
    job, address = self.job, f"{self.job.bind_address}:{self.port}"
    penv = dict(os.environ, **job.env, **self.extra_env)
    penv.update(SNAPSTORE_COORDINATOR=address, SNAPSTORE_COORDINATOR_BIND=address,
                SNAPSTORE_NUM_HOSTS=str(self.hosts),
                SNAPSTORE_HOST=str(h), SNAPSTORE_INCARNATION=str(self.inc.number),
                SNAPSTORE_DEVICES_PER_HOST=str(job.devices_per_host),
                SNAPSTORE_REPORT_DIR=str(job.report_dir),
                SNAPSTORE_ATTEMPT=str(self.attempts[h]))
    penv.pop(_faults.ENV, None)
    penv = without_cpu_cache(penv)  # (jaxlib 0.12.1's cached programs hang on CPU)
    self.armed[h] = _arming(self.pending, h)
    if self.armed[h]:
      penv[_faults.ENV] = ",".join(f"{k.phase}@{k.step}" + (":stop" if k.freeze else "")
                                   for k in self.armed[h])
    name = f"inc{self.inc.number}-host{h}" + (f"-r{self.attempts[h]}" if self.attempts[h]
                                               else "")
    where = str(job.machine_dir(self.inc.number, h))
    cmd = [sys.executable, "-m", "snapstore.testing._boot", job.module,
           *(a.replace(MACHINE, where) for a in job.args)]
    self.logs[h] = job.log_dir / f"{name}.log"
    job.watch.event(time.monotonic())
    with open(self.logs[h], "wb") as log:  # the child keeps its copy
      return subprocess.Popen(cmd, env=penv, stdout=log, stderr=subprocess.STDOUT,
                              preexec_fn=die_with_parent)

  def _fire_due_kills(self, now: float) -> None:
    """The supervisor's kills whose host reported their step (``delay_s``
    ago); those at the same step fire together."""
    job, inc = self.job, self.inc
    for k in self.pending:
      if (k.phase is None and k.step not in self.seen_at and
          read_progress(job.store_of(inc.number, k.host))[0] >= k.step):
        self.seen_at[k.step] = now
    due = [k for k in self.pending if k.phase is None and k.step in self.seen_at
           and now - self.seen_at[k.step] >= k.delay_s]
    if not due:
      return
    step = min(k.step for k in due)
    for k in [k for k in due if k.step == step]:
      p = self.procs[k.host]
      if p.poll() is not None:  # it exited on its own meanwhile
        if k.incarnation is not None:  # (a carried kill waits for its replacement)
          self.pending.remove(k)
        continue
      inc.kill_time = inc.kill_time or time.time()
      self.sent.add(p.pid)
      if k.freeze:  # alive and silent: no exit for the reaper to see
        p.send_signal(signal.SIGSTOP)
      else:
        p.send_signal(signal.SIGKILL)
        p.wait()
      _record_kill(inc, k, job.store_of(inc.number, k.host),
                   job.lost_with(inc.number, k.host))
      _fired(k, self.pending, job.carried)

  def _start_due_replacements(self) -> None:
    inc = self.inc
    for h in [h for h, t in self.due_at.items() if time.time() >= t]:
      del self.due_at[h]
      self.procs[h] = self._start(h)  # the same host id; the others keep running
      self.started[h] = time.time()
      next(r for r in reversed(inc.replaced) if r["host"] == h)["started"] = self.started[h]
    if self.due_at and any(c == 0 for c in inc.exit_codes.values()):  # the job is ending
      inc.unreplaced = sorted(self.due_at)
      for h in self.due_at:
        del self.procs[h]
      self.due_at.clear()

  def _reap(self) -> None:
    """Each exit: a host frozen at its armed point is recorded; in place, a
    dead host is replaced (after ``replacement_delay_s``) unless it asked
    for a full restart or the replacements ran out; otherwise its exit code
    counts, and a nonzero one fails the incarnation."""
    job, inc = self.job, self.inc
    for h, p in self.procs.items():
      if h in self.due_at:  # dead, its replacement not started yet
        continue
      freeze = next((k for k in self.armed.get(h, ()) if k.freeze), None)
      if (freeze is not None and p.poll() is None and p.pid not in self.sent
          and _stopped(p.pid)):  # it froze at its (first) armed freeze
        del self.armed[h]
        _record_kill(inc, freeze, job.store_of(inc.number, freeze.host),
                     job.lost_with(inc.number, freeze.host))
        _fired(freeze, self.pending, job.carried)
      if h in inc.exit_codes or p.poll() is None:
        continue
      job.watch.event(time.monotonic())
      code = p.returncode
      fenced = any(f["pid"] == p.pid for f in inc.fenced)
      if self.armed.get(h) and code == -signal.SIGKILL and p.pid not in self.sent \
          and not fenced:
        k = self.armed.pop(h)[0]  # its first armed point killed it
        _record_kill(inc, k, job.store_of(inc.number, k.host),
                   job.lost_with(inc.number, k.host))
        _fired(k, self.pending, job.carried)
      if self.extra_env and code not in (0, RESTART_EXIT_CODE):
        if self.service is None and h == 0:
          inc.fallback = "host 0 died, and the coordination service died with it"
        elif len(inc.replaced) < job.max_replacements:
          self.attempts[h] += 1
          inc.replaced.append({"host": h, "exit_code": code, "died": time.time()})
          self.due_at[h] = time.time() + job.replacement_delay_s
          logger.info("incarnation %d: host %d exited %d; replaced in place%s", inc.number,
                      h, code, f" in {job.replacement_delay_s:g} s"
                      if job.replacement_delay_s else "")
          continue
        else:
          inc.fallback = f"more than {job.max_replacements} replacements"
      elif self.extra_env and code == RESTART_EXIT_CODE:
        inc.fallback = (f"host {h} asked for a full restart (exit {code}): "
                        f"{_restart_reason(job.report_dir, inc.number, h)}")
      inc.exit_codes[h] = code
      self.failed = self.failed or code != 0

  def _finish(self) -> None:
    """The workers' reports into the incarnation; a kill that never fired
    in a job that finished is an error."""
    job, inc = self.job, self.inc
    inc.ended = time.time()
    if self._report("restore").exists():
      inc.restores = json.loads(self._report("restore").read_text())
      inc.restore = inc.restores[0]
    if self._report("digests").exists():
      inc.digests = json.loads(self._report("digests").read_text())
    if self._report("resize").exists():
      inc.resizes = json.loads(self._report("resize").read_text())
    if self.failed:
      return
    if job.carried:
      raise RuntimeError(f"{len(job.carried)} kills never fired, the first "
                         f"{job.carried[0]}: the job ended before it reached them")
    unseen = [k for k in self.pending if k.phase is None]
    if unseen:
      k = unseen[0]
      raise RuntimeError(
          f"kill {k} never fired: host {k.host} never reported step {k.step} in "
          f"{job.store_of(inc.number, k.host)}. Is that the worker's store "
          "(--store-dir, --run-id), and does the job reach that step?")


try:  # (loaded here: a forked child must not dlopen while another thread may hold its lock)
  _PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform == "linux" else None
except (OSError, AttributeError):
  _PRCTL = None


def die_with_parent() -> None:
  """In a worker, before it runs (Linux): SIGKILL when the supervisor's
  thread that started it ends, so that no worker outlives a supervisor that
  was killed."""
  if _PRCTL is not None:
    _PRCTL(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
