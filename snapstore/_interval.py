"""``interval="auto"``: the snapshot interval that maximizes goodput.

Young/Daly: with a snapshot costing ``C`` seconds of lost progress and a job
mean time between failures ``M`` (a host's MTBF divided by the hosts), the
optimal period is ``sqrt(2 C M)``; in steps, ``max(1, floor(sqrt(2 C M) /
step))`` (floor: never snapshot less often than optimal). CheckFreq (FAST'21)
tunes its checkpoint frequency online the same way.

``C`` is measured, per snapshot: the time ``save`` blocked the training loop
(capture, and waiting for the previous drain), plus the slowdown of the
steps a background drain overlaps. The slowdown is the median step with a
drain in flight minus the median step without one, once there are steps of
both kinds; before that (interval 1 leaves no step without a drain) the
drain's whole duration counts: an upper bound, so the interval can only
grow from there. A step is the time between ``save`` calls less what
``save`` blocked (counted once, as blocking); ``step`` is their median.
"""

from __future__ import annotations

import collections
import math
import statistics

from .options import AutoInterval, Interval


def young_daly_steps(cost_s: float, mtbf_s: float, step_s: float) -> int:
  """Snapshot every this many steps: ``max(1, floor(sqrt(2 C M) / step))``."""
  if step_s <= 0:
    return 1
  return max(1, math.floor(math.sqrt(2.0 * max(cost_s, 0.0) * mtbf_s) / step_s))


class FixedSchedule:
  """A snapshot every ``interval`` steps (``step % interval == 0``)."""

  def __init__(self, interval: int):
    self.interval = interval
    self.reason = f"fixed: every {interval} steps"

  def due(self, step: int, now: float, drain_busy_until: float) -> bool:
    return step % self.interval == 0

  def on_snapshot(self, step: int, blocking_s: float) -> None:
    pass

  def on_drain(self, drain_s: float) -> None:
    pass


class YoungDalySchedule:
  """Online Young/Daly interval from a window of recent measurements.
  ``save`` (training thread) and the drain thread report to it."""

  def __init__(self, job_mtbf_s: float, window: int = 32):
    self.job_mtbf_s = job_mtbf_s
    self._last_snapshot: int | None = None
    self._blocking: collections.deque[float] = collections.deque(maxlen=window)
    self._drain: collections.deque[float] = collections.deque(maxlen=window)
    self._busy_steps: collections.deque[float] = collections.deque(maxlen=window)
    self._free_steps: collections.deque[float] = collections.deque(maxlen=window)
    self._last_call: float | None = None
    self._blocked = 0.0  # what the last save blocked, not part of its step
    self.interval = 1
    self.reason = "auto: no snapshot measured yet"

  def due(self, step: int, now: float, drain_busy_until: float) -> bool:
    """A ``save`` call at ``now``; a drain ran until ``drain_busy_until``.
    Records the step just ended (with or without a drain), then says whether
    ``step`` is a snapshot step."""
    if self._last_call is not None:
      busy = drain_busy_until > self._last_call
      step_s = max(0.0, now - self._last_call - self._blocked)
      (self._busy_steps if busy else self._free_steps).append(step_s)
    self._last_call, self._blocked = now, 0.0
    return self._last_snapshot is None or step - self._last_snapshot >= self.interval

  def on_snapshot(self, step: int, blocking_s: float) -> None:
    self._last_snapshot = step
    self._blocked = blocking_s
    self._blocking.append(blocking_s)
    self._update()

  def on_drain(self, drain_s: float) -> None:
    self._drain.append(drain_s)

  def cost(self) -> tuple[float, str]:
    """(seconds a snapshot costs the job, how that was measured)."""
    blocking = statistics.median(self._blocking)
    if len(self._busy_steps) >= 3 and len(self._free_steps) >= 3:
      slow = max(0.0, statistics.median(self._busy_steps) -
                 statistics.median(self._free_steps))
      return blocking + slow, f"blocking {blocking:.4f} s + measured slowdown {slow:.4f} s"
    drain = statistics.median(self._drain) if self._drain else 0.0
    return blocking + drain, (f"blocking {blocking:.4f} s + drain {drain:.4f} s (an upper "
                              "bound until steps without a drain are seen)")

  def _update(self) -> None:
    steps = list(self._busy_steps) + list(self._free_steps)
    if not self._blocking or len(steps) < 3:
      return
    step = statistics.median(steps)
    cost, how = self.cost()
    self.interval = young_daly_steps(cost, self.job_mtbf_s, step)
    self.reason = (f"auto, Young/Daly: sqrt(2 x cost {cost:.4f} s x job MTBF "
                   f"{self.job_mtbf_s:.0f} s) / step {step:.4f} s -> every {self.interval} "
                   f"steps; cost = {how}")


Schedule = FixedSchedule | YoungDalySchedule


def schedule_for(interval: Interval, hosts: int) -> Schedule:
  """The policy for ``SnapshotOptions.interval`` (:class:`AutoInterval`:
  Young/Daly with the job's MTBF, one host's divided by ``hosts``)."""
  if isinstance(interval, AutoInterval):
    return YoungDalySchedule(interval.host_mtbf_s / max(hosts, 1))
  return FixedSchedule(interval.steps)
