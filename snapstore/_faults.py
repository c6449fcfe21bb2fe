"""Fault points: a process SIGKILLs (or freezes) itself at a named phase of a step.

Armed only by the environment, which ``snapstore.testing.supervisor`` sets for the host
and incarnation a ``Kill(phase=...)`` names::

  SNAPSTORE_FAULT=<phase>@<step>[:stop][,...]   e.g. manifest@6 or capture@9,orbax@12:stop

Phases: ``step`` (a train step computed and the previous snapshot
committed, before this step's snapshot; in loops that call it, like
``snapstore.integrations.maxtext.train``), ``capture`` (half the leaves
captured), ``replica`` (a replica transfer dispatched, not awaited),
``drain`` (the background copy about to start: the step captured, nothing
of it in the store yet), ``manifest`` (the data and the manifest's temp file written, not renamed),
``orbax`` (the step's Orbax save about to begin: the other processes wait
for this one inside theirs), ``persistent`` (the step's async Orbax save
dispatched, not committed),
``restore`` (a plan chosen; on a multi-host job its copies verified and
agreed on, before any leaf is cut or piece moved). The kill is a real
SIGKILL of the calling process: no handler, no flush, no cleanup runs,
exactly as when a host dies. ``:stop`` sends SIGSTOP instead: every thread
of the process stops there, alive and silent, as when a host hangs.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

logger = logging.getLogger(__name__)

PHASES = ("step", "capture", "replica", "drain", "manifest", "orbax", "persistent",
          "restore")
ENV = "SNAPSTORE_FAULT"


def parse(value: str | None) -> tuple[tuple[str, int, bool], ...]:
  """``<phase>@<step>[:stop][,...]``: the points armed, as (phase, step,
  freeze) (none for empty)."""
  out = []
  for spec in (value or "").split(","):
    if not spec:
      continue
    point_, _, how = spec.partition(":")
    phase, _, step = point_.partition("@")
    if phase not in PHASES or not step.lstrip("-").isdigit() or how not in ("", "stop"):
      raise ValueError(f"{ENV}={value!r}: expected <phase>@<step>[:stop][,...], phase one "
                       f"of {PHASES}")
    out.append((phase, int(step), how == "stop"))
  return tuple(out)


_ARMED = parse(os.environ.get(ENV))


def armed(phase: str, step: int) -> bool:
  """Whether :func:`point` would kill at ``phase`` of ``step`` (a caller may
  first settle what the kill should find, e.g. a step computed)."""
  return _first(phase, step) is not None


def _first(phase: str, step: int) -> tuple[str, int, bool] | None:
  return next((a for a in _ARMED if a[0] == phase and a[1] in (step, -1)), None)


def point(phase: str, step: int) -> None:
  """SIGKILLs (or, ``:stop``, freezes) this process if the environment armed
  ``phase`` at ``step`` (``step`` -1 in the environment matches any step)."""
  hit = _first(phase, step)
  if hit is None:
    return
  how = signal.SIGSTOP if hit[2] else signal.SIGKILL
  sys.stderr.write(f"snapstore fault point: {how.name} at {phase} of step {step}\n")
  sys.stderr.flush()
  os.kill(os.getpid(), how)
