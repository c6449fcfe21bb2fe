"""The supervisor's stall watch: a job whose processes all live but whose steps stopped.

A multi-controller job can hang with every process alive: a collective that
one process never joins, a cached program whose collectives run in a
different order on each device (jaxlib 0.12.1, ``docs/limits.md``), a host
frozen outside JAX's heartbeat. Nothing exits, so a supervisor that waits for
exits waits until its job timeout, and learns nothing. :class:`StallWatch`
follows each host's progress (its store's ``PROGRESS``, written by every
``SnapshotManager.save`` call, snapshot or not) and says when no host has
advanced for the watch period while every process was alive:

* while the job trains: ``max(min_s, steps x`` the median step ``)``, the
  median over every step interval seen in this job (so a slower model gets a
  longer period);
* after a process started or exited (start-up, a restore, a replacement
  joining, the first step's compile): ``max(startup_s,`` the above ``)``.

A fixed ``period_s`` replaces both. The supervisor then has every process
write its Python stacks into its log (``faulthandler`` on ``SIGUSR1``,
registered by :mod:`._boot` before the worker's module runs), stops the job
and raises :class:`snapstore.errors.JobStalledError`.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Mapping

# The defaults. A step interval counts once the job advanced twice after an
# event (the first step after one carries compiles and restores).
MIN_S = 60.0
STEPS = 20.0
STARTUP_S = 120.0
KEEP = 200  # step intervals kept for the median


@dataclasses.dataclass(frozen=True, kw_only=True)
class StallPolicy:
  """When :func:`snapstore.testing.launch` calls a job stalled (module doc).

  Args:
    period_s: a fixed watch period; None derives it from the step time.
    min_s, steps: while training, ``max(min_s, steps x median step)``.
    startup_s: the least period after a process started or exited.
  """

  period_s: float | None = None
  min_s: float = MIN_S
  steps: float = STEPS
  startup_s: float = STARTUP_S

  def __post_init__(self) -> None:
    for name in ("min_s", "steps", "startup_s"):
      if not 0 < getattr(self, name) < float("inf"):
        raise ValueError(f"StallPolicy.{name} must be a finite number > 0, "
                         f"got {getattr(self, name)!r}")
    if self.period_s is not None and not 0 < self.period_s < float("inf"):
      raise ValueError(f"StallPolicy.period_s must be a finite number > 0 or None, "
                       f"got {self.period_s!r}")


class StallWatch:
  """One job's progress and its watch period (module doc). Times are
  ``time.monotonic()`` seconds; the supervisor's poll loop calls
  :meth:`event` on each process start or exit, :meth:`observe` with every
  host's progress, and :meth:`stalled_for` to ask."""

  def __init__(self, policy: StallPolicy) -> None:
    self.policy = policy
    self._intervals: list[float] = []  # seconds a step, the whole job (every incarnation)
    self._seen: dict[int, tuple[int, int]] = {}
    self._since = 0.0  # when progress (or an event) last happened
    self._advances = 0  # times the job advanced since the last event
    self._last: tuple[int, float] | None = None  # (newest step, when) since the event

  def event(self, now: float) -> None:
    """A process started or exited: the clock starts again, with the
    start-up allowance."""
    self._since, self._advances, self._last = now, 0, None

  def observe(self, progress: Mapping[int, tuple[int, int]], now: float) -> None:
    """Each host's (newest step saved, its incarnation) as read now."""
    if dict(progress) == self._seen:
      return
    if not self._seen:  # the first reading: what was there before, no progress
      self._seen = dict(progress)
      return
    self._seen = dict(progress)
    self._since = now
    self._advances += 1
    newest = max((s for s, _ in progress.values()), default=-1)
    if self._last is not None and newest > self._last[0] and self._advances > 1:
      per_step = (now - self._last[1]) / (newest - self._last[0])
      self._intervals = [*self._intervals[-KEEP + 1:], per_step]
    self._last = (newest, now)

  @property
  def median_step_s(self) -> float | None:
    return statistics.median(self._intervals) if self._intervals else None

  @property
  def stepping(self) -> bool:
    """Whether the job advanced since the last event (past start-up)."""
    return self._advances > 0

  def period_s(self) -> float:
    p = self.policy
    if p.period_s is not None:
      return p.period_s
    median = self.median_step_s
    training = max(p.min_s, p.steps * median) if median is not None else p.min_s
    return training if self.stepping else max(p.startup_s, training)

  def stalled_for(self, now: float) -> float | None:
    """Seconds without progress, if that is past the period; else None."""
    quiet = now - self._since
    return quiet if quiet > self.period_s() else None

  def phase(self) -> str:
    """Where the job stopped, in words, from the progress seen."""
    steps = {h: s for h, (s, _) in sorted(self._seen.items()) if s >= 0}
    if not self.stepping:
      return ("start-up: joining, restoring, or the first step since a process started "
              f"(no step saved since; the hosts' last steps {steps or 'none'})")
    return f"training: no host went past step {max(steps.values(), default=-1)} ({steps})"
