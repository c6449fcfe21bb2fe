"""A manager's save path: one snapshot in flight at a time.

:class:`Saver` captures a step on the caller's thread (until the state's
buffers are safe from the next step), then drains it (copies, checksums,
the manifest commit) on one background thread. Under
``FailurePolicy.CONTINUE`` a failed capture or drain is counted and logged,
and training goes on; the last complete snapshot stays restorable.

Between drains it faults in, on a background thread, the host memory a
restore of the newest snapshot would copy into (``prefault_restore``).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from typing import Any

import jax
import numpy as np

from . import _arena, _backends, _faults, _interval, _planner, _switch, _watermark, errors
from ._arena import ArenaCache
from ._tree import LeafSpec
from .metrics import SaveMetrics
from .options import BusyPolicy, Every, FailurePolicy, SnapshotOptions

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class _Agreement:
  """A retention agreement started at the capture of ``step``; ``read``
  waits for the job's reduction and returns it."""

  step: int
  read: Callable[[], np.ndarray]


def _reraise(e: BaseException) -> np.ndarray:
  raise e


class Saver:
  """Captures and drains snapshots into ``backend``, counting in ``metrics``.
  ``reduce_min``: starts the element-wise minimum over the job's hosts of an
  int32 vector (collective; on one process, the vector itself) and returns
  its reader: the job agrees on its retention watermark with it at every
  capture (:mod:`._watermark`), read at the next one where every store has
  3 slots or more (``keep >= 2``, no ``budget_bytes``: it runs during the
  step), else before evicting."""

  def __init__(self, backend: _backends.Backend[Any], options: SnapshotOptions,
               metrics: SaveMetrics, schedule: _interval.Schedule,
               arenas: ArenaCache,
               reduce_min: Callable[[np.ndarray], Callable[[], np.ndarray]] = (
                   lambda v: lambda: v)) -> None:
    self.backend, self.options, self.metrics = backend, options, metrics
    self.schedule, self.arenas = schedule, arenas
    metrics.interval, metrics.interval_reason = schedule.interval, schedule.reason
    self.reduce_min = reduce_min
    # the newest step every store held at the last agreement (None: none yet)
    self.watermark: int | None = None
    self._agreeing: _Agreement | None = None  # started at the last capture, unread
    self._fresh = True  # the last agreement read succeeded (else: no snapshot until one does)
    # Overlapped (:meth:`_capture_now`) where every store has 3 slots or more,
    # decided from the options alone: the same on every process, whose
    # collectives must come in one order.
    self._overlaps = options.keep >= 2 and getattr(options.store, "budget_bytes", None) is None
    self.inflight: futures.Future[None] | None = None
    self.inflight_step = -1  # the step whose snapshot ``inflight`` drains
    self.done_at = 0.0  # when the last drain finished (the schedule's clock)
    self.drainer = futures.ThreadPoolExecutor(1, thread_name_prefix="snapstore-drain")
    self.prefaulting: threading.Thread | None = None
    self._failures_logged: set[str] = set()  # RAM-tier failure kinds logged once
    self.prefault_ahead()  # a store that holds a snapshot: a restore may come first

  def running(self) -> bool:
    return self.inflight is not None and not self.inflight.done()

  def due(self, step: int, t_enter: float) -> bool:
    """Whether the schedule says ``step`` (entered at ``t_enter``) is a
    snapshot step: the time since the last drain ended counts, or none
    while one runs."""
    return self.schedule.due(step, t_enter, t_enter if self.running() else self.done_at)

  def start(self, step: int, header: _backends.Header, specs: Sequence[LeafSpec],
            leaves: Sequence[Any], t_enter: float) -> bool:
    """Captures ``step`` and hands it to the drain thread; False if skipped
    (busy under ``BusyPolicy.SKIP``, or a RAM-tier failure under CONTINUE)."""
    try:
      pending, t0 = self._capture(step, header, specs, leaves)
    except (errors.BudgetExceededError, errors.StoreError) as e:
      # a run's first snapshot that cannot fit is a misconfiguration: raised
      if (self.options.failure_policy is FailurePolicy.RAISE
          or self.metrics.snapshots_started == 0):
        raise
      self.store_failed(step, e)
      return False
    if pending is None:
      return False
    self.inflight, self.inflight_step = self.drainer.submit(self._drain, pending), step
    m = self.metrics
    m.snapshots_started += 1
    m.capture_seconds = time.perf_counter() - t0
    m.capture_seconds_total += m.capture_seconds
    staging = getattr(pending, "staging", None)  # host files: what the capture staged
    if staging is not None:
      m.staged_bytes, m.copied_before_return_bytes = staging.staged_bytes, staging.copied_bytes
      m.stall_seconds = staging.stall_seconds
      m.stall_seconds_total += staging.stall_seconds
    self.schedule.on_snapshot(step, time.perf_counter() - t_enter)
    m.interval, m.interval_reason = self.schedule.interval, self.schedule.reason
    return True

  def _capture(self, step: int, header: _backends.Header, specs: Sequence[LeafSpec],
               leaves: Sequence[Any]) -> tuple[Any, float]:
    """Waits for (or skips past) the snapshot in flight, raises its error,
    then captures this step (None: skipped under ``BusyPolicy.SKIP``)."""
    if self.running():
      if self.options.busy_policy is BusyPolicy.SKIP:
        self.metrics.skipped_busy += 1
        logger.info("step %d: previous snapshot still draining; skipped (policy SKIP)", step)
        return None, 0.0
      t = time.perf_counter()
      futures.wait([self.inflight])  # type: ignore[list-item]
      self.metrics.waited_busy += 1
      self.metrics.wait_seconds += time.perf_counter() - t
    self.settle()  # the last snapshot's failure: raised, or counted (this step goes on)
    t0 = time.perf_counter()
    faulting = _arena.faulting_seconds()  # (fresh memory a backend makes here)
    try:
      return self._capture_now(step, header, specs, leaves), t0
    finally:
      self.metrics.first_touch_seconds += _arena.faulting_seconds() - faulting

  def _capture_now(self, step: int, header: _backends.Header, specs: Sequence[LeafSpec],
                   leaves: Sequence[Any]) -> Any:
    # From the step, not a count of this process's snapshots: a replacement
    # healed in place (count 0) would move replicas while its peers do not
    # (mismatched collectives: gloo aborts the process on the size mismatch).
    travel = self.options.carries_replicas(step)
    copies = self.options.copies
    due, overlap = self._agree_due(step), self._overlaps
    try:
      self._learn()  # the last capture's agreement, if it started one (overlapped)
      if due and not overlap:
        self._learn(self._start(step))  # agreed and read before anything is evicted
      if not self._fresh:
        raise errors.StoreError(
            f"step {step}: the hosts' last agreement on which snapshot every store holds "
            "failed; nothing is deleted and no snapshot is taken until one succeeds")
    except errors.StoreError:
      if due and overlap:  # every process starts one at a due capture, read or not
        self._agreeing = self._start(step)
      raise
    header = dataclasses.replace(header, watermark=-1 if self.watermark is None
                                 else self.watermark, retain=not (due and overlap))
    try:
      with _switch.collections_paused(self.options.pause_gc):
        return self.backend.capture(header, specs, leaves, replicas=copies if travel else 0)
    except RuntimeError as e:
      gone = [s.path for s, x in zip(specs, leaves, strict=True)
              if isinstance(x, jax.Array) and x.is_deleted()]
      if not gone:
        raise
      more = f" (and {len(gone) - 1} more)" if len(gone) > 1 else ""
      raise errors.DeletedLeafError(
          f"step {step}: leaf {gone[0]!r}{more} was deleted, e.g. donated to a jitted step "
          "that has run since: save the state a step returns before passing it to the next "
          "one. Nothing of this step was saved.") from e
    finally:  # (raised or not: every process makes the same collective calls)
      if due and overlap:
        self._agreeing = self._start(step)

  def _agree_due(self, step: int) -> bool:
    """Whether the capture of ``step`` agrees anew: unless, with snapshots
    every ``n`` steps, the snapshot ``n`` steps back carried no replicas
    (``replica_interval`` > 1): then no step that could raise the watermark
    was saved since the last agreement, and the last one learned stands
    (deletions protect it as ever). From the step and the options alone,
    the same on every process (a collective must run on all or none)."""
    every = self.options.interval.steps if isinstance(self.options.interval, Every) else None
    return (every is None or self.options.copies == 0
            or self.options.carries_replicas(step - every))

  def _start(self, step: int) -> _Agreement:
    """Starts the job's agreement on its retention watermark at the capture
    of ``step`` from every store's record of the steps it holds now
    (:mod:`._watermark`). Collective: one reduction, dispatched (a failure
    to dispatch is raised when it is read)."""
    def protected(s: int) -> bool:  # every piece of it survives a lost domain
      return self.options.copies == 0 or self.options.carries_replicas(s)
    mine = _watermark.combine(
        _watermark.record(step, [s for s in held if protected(s)], self.watermark)
        for held in self.backend.held_steps())
    t = time.perf_counter()
    try:
      read = self.reduce_min(mine)
    except jax.errors.JaxRuntimeError as e:
      read = functools.partial(_reraise, e)
    self.metrics.agree_seconds_total += time.perf_counter() - t
    return _Agreement(step, read)

  def _learn(self, agreement: _Agreement | None = None) -> None:
    """Learns the watermark from ``agreement`` (None: the one in flight, if
    any): ``self.watermark``, ``metrics.watermark`` (-1 for none). Raises
    StoreError if the hosts could not agree (a peer died): then nothing is
    deleted and this step is not saved, nor any until an agreement succeeds."""
    if agreement is None:
      agreement, self._agreeing = self._agreeing, None
      if agreement is None:
        return
    t = time.perf_counter()
    try:
      reduced = agreement.read()
    except jax.errors.JaxRuntimeError as e:
      self._fresh = False
      raise errors.StoreError(
          f"step {agreement.step}: the hosts could not agree which snapshot every store "
          f"holds ({e}); nothing was deleted and this step has no snapshot") from e
    finally:
      self.metrics.agree_seconds_total += time.perf_counter() - t
    self._fresh = True
    self.watermark = _watermark.settle(agreement.step, reduced)
    self.metrics.watermark = -1 if self.watermark is None else self.watermark
    try:  # (adopted stores older than it go: .hostfiles.adopt)
      self.backend.watermark_moved(self.watermark)
    except OSError as e:  # never a training job down for the RAM tier
      logger.warning("step %d: an adopted store was not deleted: %s", agreement.step, e)

  def restored(self, step: int | None) -> None:
    """Every host restored ``step`` (None: none from RAM): the stores keep it
    until a newer one is agreed; an agreement in flight is dropped."""
    self.watermark, self._agreeing, self._fresh = step, None, True
    self.backend.restore_done(step)

  def store_failed(self, step: int, e: BaseException) -> None:
    """A RAM-tier failure under ``FailurePolicy.CONTINUE``: counted, logged
    once per cause; the last complete snapshot stays restorable."""
    self.metrics.store_failures += 1
    self.metrics.last_store_failure = f"step {step}: {e}"
    cause = type(e).__name__
    if cause not in self._failures_logged:
      self._failures_logged.add(cause)
      logger.warning("step %d: the RAM tier failed and this step has no snapshot; training "
                     "goes on (FailurePolicy.CONTINUE; counted in metrics.store_failures, "
                     "logged once per kind): %s", step, e)

  def _drain(self, pending: Any) -> None:
    _faults.point("drain", pending.header.step)
    t0 = time.perf_counter()
    faulting = _arena.faulting_seconds()
    try:
      with _switch.lowered(self.options.drain_switch_interval_s), \
          _switch.collections_paused(self.options.pause_gc):
        nbytes = self.backend.drain(pending)  # drops the capture's views, inside the pause
    finally:
      self.metrics.first_touch_seconds += _arena.faulting_seconds() - faulting
    if not self.options.prefault_restore:  # (else kept in place for a recovery)
      self.arenas.trim()  # the last restore's memory, if the state left it
    self.prefault_ahead()
    self.done_at = time.perf_counter()
    self.schedule.on_drain(self.done_at - t0)
    m = self.metrics
    m.snapshots_committed += 1
    m.bytes_snapshotted += nbytes
    m.drain_seconds = time.perf_counter() - t0
    m.drain_seconds_total += m.drain_seconds
    m.ahead_seconds = getattr(self.backend, "ahead_seconds", lambda: 0.0)()  # (optional)

  def prefault_ahead(self) -> None:
    """Faults in, on a background thread, the host memory a restore of the
    newest snapshot here copies into (``SnapshotOptions.prefault_restore``;
    :meth:`ArenaCache.prefault`), unless an arena is kept or being made."""
    if (not self.options.prefault_restore or self.backend.prefetch_pool is None
        or (self.prefaulting is not None and self.prefaulting.is_alive())
        or self.arenas.kept_bytes):  # (after: it waits while a prefault runs)
      return
    try:
      nbytes = _planner.own_bytes(self.backend.manifests())
    except Exception as e:  # noqa: BLE001 - an optimization: never fail a save or a start
      logger.warning("restore memory not faulted in ahead: %r", e)
      return
    if nbytes:
      self.prefaulting = threading.Thread(target=self.arenas.prefault, args=(nbytes,),
                                          name="snapstore-prefault", daemon=True)
      self.prefaulting.start()

  def raise_drain_error(self) -> None:
    f = self.inflight
    if f is not None and f.done() and f.exception() is not None:
      self.inflight = None
      raise errors.DrainFailedError(
          f"the background snapshot of step {self.inflight_step} failed: {f.exception()!r}",
          step=self.inflight_step) from f.exception()

  def settle(self) -> errors.DrainFailedError | None:
    """Once the snapshot in flight is done: its failure, raised under
    ``FailurePolicy.RAISE``, else counted (:meth:`store_failed`) and
    returned; None if it committed (or none was in flight)."""
    self.wait()
    try:
      self.raise_drain_error()
    except errors.DrainFailedError as e:
      if self.options.failure_policy is FailurePolicy.RAISE:
        raise
      self.store_failed(self.inflight_step, e)
      return e
    return None

  def wait(self) -> None:
    """Blocks until the snapshot in flight is committed or failed."""
    if self.inflight is not None:
      futures.wait([self.inflight])

  def close(self) -> None:
    self.drainer.shutdown(wait=True)
    if self.prefaulting is not None:
      self.arenas.interrupt()
      self.prefaulting.join()
