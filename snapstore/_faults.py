"""Fault points: a process SIGKILLs itself at a named phase of a given step.

Armed only by the environment, which ``snapstore.launch`` sets for the host
and incarnation a ``Kill(phase=...)`` names::

  SNAPSTORE_FAULT=<phase>@<step>[,...]     e.g. manifest@6 or capture@9,replica@12

Phases: ``step`` (a train step computed and the previous snapshot
committed, before this step's snapshot; in loops that call it, like
``snapstore.integrations.maxtext.train``), ``capture`` (half the leaves
captured), ``replica`` (a replica transfer dispatched, not awaited),
``manifest`` (the data and the manifest's temp file written, not renamed),
``persistent`` (the step's async Orbax save dispatched, not committed),
``restore`` (a plan chosen; on a multi-host job its copies verified and
agreed on, before any leaf is cut or piece moved). The kill is a real
SIGKILL of the calling process: no handler, no flush, no cleanup runs,
exactly as when a host dies.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

logger = logging.getLogger(__name__)

PHASES = ("step", "capture", "replica", "manifest", "persistent", "restore")
ENV = "SNAPSTORE_FAULT"


def parse(value: str | None) -> tuple[tuple[str, int], ...]:
  """``<phase>@<step>[,<phase>@<step>...]``: the points armed (none for empty)."""
  out = []
  for spec in (value or "").split(","):
    if not spec:
      continue
    phase, _, step = spec.partition("@")
    if phase not in PHASES or not step.lstrip("-").isdigit():
      raise ValueError(f"{ENV}={value!r}: expected <phase>@<step>[,...], phase one of "
                       f"{PHASES}")
    out.append((phase, int(step)))
  return tuple(out)


_ARMED = parse(os.environ.get(ENV))


def armed(phase: str, step: int) -> bool:
  """Whether :func:`point` would kill at ``phase`` of ``step`` (a caller may
  first settle what the kill should find, e.g. a step computed)."""
  return any(p == phase and s in (step, -1) for p, s in _ARMED)


def point(phase: str, step: int) -> None:
  """SIGKILLs this process if the environment armed ``phase`` at ``step``
  (``step`` -1 in the environment matches any step)."""
  if not armed(phase, step):
    return
  sys.stderr.write(f"snapstore fault point: SIGKILL at {phase} of step {step}\n")
  sys.stderr.flush()
  os.kill(os.getpid(), signal.SIGKILL)
