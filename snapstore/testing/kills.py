"""What a :func:`snapstore.testing.launch` job is asked to inject and what it saw.

:class:`Kill` (a fault: SIGKILL or SIGSTOP of a host at a step or phase),
:class:`Incarnation` (one run of the whole job, as the supervisor saw it),
and the supervisor's bookkeeping of both: which kills a new process is
armed with, fired kills, hosts fenced because the survivors reported them
missing while their process still ran.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .. import _faults

logger = logging.getLogger("snapstore.testing.supervisor")

#: how long a host must be reported missing, its process alive, before it is fenced
FENCE_AFTER_S = 1.0


@dataclasses.dataclass(frozen=True)
class Kill:
  """SIGKILL ``host`` in incarnation ``incarnation`` once it reaches ``step``.

  ``incarnation`` None: in whichever incarnation gets there, the kills in
  the order given (a soak's faults, where a recovery may heal in place or
  restart in full). A kill not fired by the incarnation that ends the job
  is an error.

  ``freeze``: SIGSTOP instead (a host that hangs: alive, silent, never
  resumed; :func:`launch` fences it in place, see there); with a phase the
  process stops itself there.

  ``phase`` None: the supervisor kills it when its store's PROGRESS reports
  ``step`` (it is then in that step's save or the next train step), or
  ``delay_s`` seconds later: a real host fails at any moment, not in step with
  the job's progress file. A phase (``step``, ``capture``, ``replica``,
  ``manifest``, ``persistent``, ``restore``; see ``_faults``): the process
  SIGKILLs itself at that point of that step. Kills of one incarnation at
  the same step fire together. ``lose_store`` also wipes the host's RAM
  store (a replaced machine).
  """

  host: int
  step: int
  incarnation: int | None = 0
  lose_store: bool = False
  phase: str | None = None
  delay_s: float = 0.0
  freeze: bool = False

  def __post_init__(self) -> None:
    if not 0.0 <= self.delay_s < float("inf"):
      raise ValueError(f"delay_s must be a finite number >= 0, got {self.delay_s!r}")
    if self.delay_s and self.phase is not None:
      raise ValueError("delay_s is for supervisor kills; a phase kill fires at its phase")
    if self.phase is not None and self.phase not in _faults.PHASES:
      raise ValueError(f"unknown phase {self.phase!r}; one of {_faults.PHASES}")


@dataclasses.dataclass
class Incarnation:
  """One run of the whole job, as the supervisor saw it."""

  number: int
  num_hosts: int
  started: float
  ended: float = 0.0
  exit_codes: dict[int, int] = dataclasses.field(default_factory=dict)
  killed: list[int] = dataclasses.field(default_factory=list)
  kill_time: float | None = None
  restore: dict[str, Any] | None = None  # host 0's first RestoreResult.summary()
  restores: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # all of them
  replaced: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # in place
  fenced: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # hung, killed
  fallback: str | None = None  # why an in-place job restarted in full
  resizes: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # ran short, grew
  unreplaced: list[int] = dataclasses.field(default_factory=list)  # the job ended first
  digests: dict[str, str] = dataclasses.field(default_factory=dict)  # step -> state digest

  @property
  def ok(self) -> bool:
    return bool(self.exit_codes) and all(c == 0 for c in self.exit_codes.values())

  @property
  def failure(self) -> str | None:
    bad = {h: c for h, c in self.exit_codes.items() if c != 0 and h not in self.killed}
    if self.killed:
      return f"SIGKILL host {sorted(self.killed)}"
    return f"exit codes {bad}" if bad else None

  def as_dict(self) -> dict[str, Any]:
    return dict(dataclasses.asdict(self), ok=self.ok, failure=self.failure)


def _fence(inc: Incarnation, procs: dict[int, subprocess.Popen[bytes]],
           started: dict[int, float], report_dir: Path, now: float) -> None:
  """Kills each host that a survivor has reported missing for
  :data:`FENCE_AFTER_S` while its process still runs (alive but silent:
  the service declared it dead); it is then replaced like a dead one. A
  report older than the host's current process (a replacement still
  starting) is not about it."""
  for path in report_dir.glob(f"missing-inc{inc.number}-host*.json"):
    try:
      doc = json.loads(path.read_text())
      missing, since = [int(h) for h in doc["missing"]], float(doc["since"])
    except (OSError, ValueError, KeyError, TypeError):
      continue  # (written atomically; a bad one is not ours to trust)
    for h in missing:
      p = procs.get(h)
      if (p is None or p.poll() is not None or since < started.get(h, now)
          or time.time() - since < FENCE_AFTER_S):
        continue
      logger.warning("incarnation %d: host %d is missing from the job since %.1f s ago but "
                     "its process runs: fenced (SIGKILL) and replaced", inc.number, h,
                     time.time() - since)
      p.send_signal(signal.SIGKILL)
      p.wait()  # (the other survivors' reports of it see it gone)
      inc.fenced.append({"host": h, "pid": p.pid, "missing_since": since,
                         "fenced": time.time()})


def _restart_reason(report_dir: Path, number: int, host: int) -> str:
  try:
    return str(json.loads((report_dir / f"restart-inc{number}-host{host}.json").read_text()))
  except (OSError, ValueError):
    return "no reason given"


def _arming(pending: Sequence[Kill], h: int) -> list[Kill]:
  """The phase kills a new process of host ``h`` is armed with: all of its
  pending ones, earliest step first; a restore kill only when it is the
  host's next kill (a second fault: this process's restore heals the one
  before)."""
  mine = [k for k in pending if k.host == h]
  return sorted((k for k in mine if k.phase is not None
                 and (k.phase != "restore" or k is mine[0])), key=lambda k: k.step)


def _stopped(pid: int) -> bool:
  """Whether process ``pid`` is stopped by a signal (SIGSTOP; not a
  debugger's trace stop; Linux ``/proc``)."""
  try:
    stat = Path(f"/proc/{pid}/stat").read_text()
  except OSError:
    return False
  return stat.rsplit(")", 1)[-1].split()[0] == "T"


def _fired(k: Kill, pending: list[Kill], carried: list[Kill]) -> None:
  for where in (pending, carried):  # (by identity: two equal kills are two faults)
    where[:] = [x for x in where if x is not k]


def _record_kill(inc: Incarnation, k: Kill, store: Path, machine: Path | None = None
                 ) -> None:
  inc.killed.append(k.host)
  inc.kill_time = inc.kill_time or time.time()
  logger.info("incarnation %d: %s host %d at step %d%s", inc.number,
              "SIGSTOP" if k.freeze else "SIGKILL", k.host, k.step,
              f" ({k.phase})" if k.phase else "")
  if k.lose_store:
    where = machine if machine is not None else store
    if not store.is_dir():
      raise RuntimeError(f"{k}: cannot wipe host {k.host}'s store: {store} does not "
                         "exist. Is that the worker's store (--store-dir, --run-id)?")
    shutil.rmtree(where)
