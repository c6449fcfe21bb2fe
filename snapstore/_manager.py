"""SnapshotManager: orchestration only.

The manager decides *when* (interval, busy policy, persistent interval)
and *which incarnation* writes, and starts each restore. Where snapshots
live is a backend's business (:mod:`._backends`, chosen once here); what to
restore, one attempt after another, is :mod:`._restore`'s; who takes part
in a restore is the job's (:mod:`._peers`); building leaves from pieces is
the assembler's (:mod:`._assemble`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent import futures
from typing import Any

import jax
import orbax.checkpoint as ocp

from . import (
    _arena,
    _backends,
    _faults,
    _interval,
    _peers,
    _planner,
    _reports,
    _restore,
    _switch,
    errors,
)
from ._arena import ArenaCache
from ._layout import LeafSpec, flatten, tree_digest
from ._manifest import check_extra
from ._persistent import OrbaxTier
from .metrics import RestoreResult, SaveMetrics
from .options import MAX_INT, BusyPolicy, FailurePolicy, SnapshotOptions

logger = logging.getLogger(__name__)

class SnapshotManager:
  """Keeps per-step snapshots of a train state in host RAM, beside Orbax.

  Args:
    options: a :class:`SnapshotOptions`.
    persistent: the persistent tier: an ``orbax.checkpoint.CheckpointManager``,
      an :class:`OrbaxTier`, a path (local or ``gs://``), or None.
    slices: single controller (Pathways) only: failure domain -> its devices;
      one store per domain, all held by this process.

  Collective calls: on a multi-controller job (``jax.distributed``) every
  process must construct the manager, ``save`` the same steps and
  ``restore`` together. Threading: call ``save``/``restore``/
  ``wait_until_finished`` from one thread (the training loop). ``save``
  returns once the state's buffers are safe from the next step; the copy,
  the checksums and the manifest commit run on a background thread, whose
  errors the next ``save`` or ``wait_until_finished`` raises as
  :class:`DrainFailedError`.
  """

  def __init__(self, options: SnapshotOptions | None = None, *,
               persistent: OrbaxTier | ocp.CheckpointManager | str | os.PathLike[str]
               | None = None,
               slices: Mapping[int, Sequence[jax.Device]] | None = None):
    self.options = options or SnapshotOptions()
    self.host = jax.process_index()
    self.num_hosts = jax.process_count()
    self._copy_pool = futures.ThreadPoolExecutor(
        self.options.copy_threads, thread_name_prefix="snapstore-copy")
    self.backend = _backends.choose(self.options, host=self.host, num_hosts=self.num_hosts,
                                    slices=slices, pool=self._copy_pool)
    self._peers = _peers.for_job(self.host, self.num_hosts)
    if persistent is None or isinstance(persistent, OrbaxTier):
      self.persistent = persistent
    else:
      self.persistent = OrbaxTier(persistent)
    prev_step, prev_inc = self.backend.read_progress()
    incarnation = self.options.incarnation
    if incarnation is None:
      incarnation = _reports.incarnation_from_env()
    if incarnation is None:
      seen = [m.incarnation for m in self.backend.manifests()] + [prev_inc]
      # a replaced host starts empty: agree on the max.
      (incarnation,) = self._peers.agree_max(max(seen) + 1)
      if incarnation > MAX_INT:
        raise errors.StoreError(
            f"the stores name incarnation {incarnation - 1}, the most there can be; "
            f"inspect them ({self.backend.describe()}) or pass incarnation=")
    self.incarnation: int = incarnation
    self._newest_step = prev_step
    self._lineage_step: int | None = None  # the last step passed to save, this lineage
    self._failures_logged: set[str] = set()  # RAM-tier failure kinds logged once
    self._capture_started = 0.0
    self.metrics = SaveMetrics()
    self._drainer = futures.ThreadPoolExecutor(1, thread_name_prefix="snapstore-drain")
    self._arenas = ArenaCache()  # restore memory, reused (._arena)
    self._prefaulting: threading.Thread | None = None
    self._prefault_ahead()  # a store that holds a snapshot: a restore may come first
    self._inflight: futures.Future[None] | None = None
    self._inflight_done_at = 0.0
    self.schedule = _interval.schedule_for(self.options.interval, self.options.host_mtbf_s,
                                           max(self.num_hosts, len(self.backend.store_ids())))
    self.metrics.interval, self.metrics.interval_reason = (self.schedule.interval,
                                                           self.schedule.reason)
    self._closed = False

  # ------------------------------------------------------------------ save
  def save(self, step: int, state: Any, *, extra: Any = None,
           force: bool = False) -> bool:
    """Snapshots ``state`` at ``step`` if the interval says so (or ``force``).

    Returns True if a snapshot was started, False if this step is not a
    snapshot step or was skipped under ``BusyPolicy.SKIP`` (counted in
    ``metrics.skipped_busy``). Saves to the persistent tier on its interval.
    Blocks only until the state's buffers are safe from the next step (and,
    under ``BusyPolicy.WAIT``, until the previous snapshot is complete).
    Collective on a multi-controller job.
    """
    self._check_open()
    t_enter = time.perf_counter()
    if type(step) is not int or not 0 <= step <= MAX_INT:
      raise ValueError(f"step must be an int in [0, 2**48], got {step!r}")
    if self._lineage_step is not None and step < self._lineage_step:
      raise errors.StepOrderError(
          f"save of step {step} after step {self._lineage_step} (incarnation "
          f"{self.incarnation}): a restore would still pick the later step. To go back, "
          f"restore(step=...) first (a restore starts a new lineage); to start over, use "
          "a new run_id.")
    self._lineage_step = step
    self._newest_step = max(self._newest_step, step)
    self.backend.write_progress(self._newest_step, self.incarnation)
    running = self._inflight is not None and not self._inflight.done()
    snap = self.schedule.due(step, t_enter, t_enter if running else self._inflight_done_at)
    snap = snap or force
    persist = self.persistent is not None and self.options.should_persist(step)
    if not (snap or persist):
      return False
    check_extra(extra)
    specs, leaves, _ = flatten(state)
    if persist and self.persistent is not None:
      _faults.point("orbax", step)
      self.persistent.save(step, specs, leaves, extra)
      self.metrics.persistent_saves += 1
      _faults.point("persistent", step)
    if not snap:
      return False
    try:
      pending = self._capture(step, specs, leaves, extra)
    except (errors.BudgetExceededError, errors.StoreError) as e:
      # a run's first snapshot that cannot fit is a misconfiguration: raised
      if (self.options.failure_policy is FailurePolicy.RAISE
          or self.metrics.snapshots_started == 0):
        raise
      self._store_failed(step, e)
      return False
    if pending is None:
      return False
    t0 = self._capture_started
    self._inflight = self._drainer.submit(self._drain, pending)
    self.metrics.snapshots_started += 1
    self.metrics.capture_seconds = time.perf_counter() - t0
    self.metrics.capture_seconds_total += self.metrics.capture_seconds
    self.schedule.on_snapshot(step, time.perf_counter() - t_enter)
    self.metrics.interval, self.metrics.interval_reason = (self.schedule.interval,
                                                           self.schedule.reason)
    return True

  def _capture(self, step: int, specs: Sequence[LeafSpec], leaves: Sequence[Any],
               extra: Any) -> Any:
    """Waits for (or skips past) the snapshot in flight, raises its error,
    then captures this step (None: skipped under ``BusyPolicy.SKIP``)."""
    if self._inflight is not None and not self._inflight.done():
      if self.options.busy_policy is BusyPolicy.SKIP:
        self.metrics.skipped_busy += 1
        logger.info("step %d: previous snapshot still draining; skipped (policy SKIP)", step)
        return None
      t = time.perf_counter()
      futures.wait([self._inflight])
      self.metrics.waited_busy += 1
      self.metrics.wait_seconds += time.perf_counter() - t
    try:
      self._raise_drain_error()
    except errors.DrainFailedError as e:
      if self.options.failure_policy is FailurePolicy.RAISE:
        raise
      self._store_failed(step, e)  # and this step is snapshotted as usual
    self._capture_started = time.perf_counter()
    faulting = _arena.faulting_seconds()  # a new slot is made here (host files)
    try:
      return self._capture_now(step, specs, leaves, extra)
    finally:
      self.metrics.first_touch_seconds += _arena.faulting_seconds() - faulting

  def _capture_now(self, step: int, specs: Sequence[LeafSpec], leaves: Sequence[Any],
                   extra: Any) -> Any:
    header = _backends.Header(
        run_id=self.options.run_id, incarnation=self.incarnation, step=step,
        num_hosts=max(self.num_hosts, len(self.backend.store_ids())),
        tree_digest=tree_digest(specs), chunk_bytes=self.options.chunk_bytes,
        leaves=tuple(specs), extra=extra)
    # From the step, not a count of this process's snapshots: a replacement
    # healed in place (count 0) would move replicas while its peers do not
    # (mismatched collectives: gloo aborts the process on the size mismatch).
    travel = self.options.carries_replicas(step)
    copies = 1 if self.options.redundancy == "parity" else self.options.replicas
    try:
      with _switch.collections_paused(self.options.pause_gc):
        pending = self.backend.capture(header, specs, leaves,
                                       replicas=copies if travel else 0)
    except RuntimeError as e:
      gone = [s.path for s, x in zip(specs, leaves, strict=True)
              if isinstance(x, jax.Array) and x.is_deleted()]
      if not gone:
        raise
      raise errors.DeletedLeafError(
          f"step {step}: leaf {gone[0]!r}{f' (and {len(gone) - 1} more)' if len(gone) > 1 else ''}"
          " was deleted, e.g. "
          "donated to a jitted step that has run since: save the state a step returns "
          "before passing it to the next one. Nothing of this step was saved.") from e
    return pending

  def _store_failed(self, step: int, e: BaseException) -> None:
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
    t0 = time.perf_counter()
    faulting = _arena.faulting_seconds()
    try:
      with _switch.lowered(self.options.drain_switch_interval_s), \
          _switch.collections_paused(self.options.pause_gc):
        nbytes = self.backend.drain(pending)  # drops the capture's views, inside the pause
    finally:
      self.metrics.first_touch_seconds += _arena.faulting_seconds() - faulting
    if not self.options.prefault_restore:  # (else kept in place for a recovery)
      self._arenas.trim()  # the last restore's memory, if the state left it
    self._prefault_ahead()
    self._inflight_done_at = time.perf_counter()
    self.schedule.on_drain(self._inflight_done_at - t0)
    self.metrics.snapshots_committed += 1
    self.metrics.bytes_snapshotted += nbytes
    self.metrics.drain_seconds = time.perf_counter() - t0
    self.metrics.drain_seconds_total += self.metrics.drain_seconds

  def _prefault_ahead(self) -> None:
    """Faults in, on a background thread, the host memory a restore of the
    newest snapshot here copies into (``SnapshotOptions.prefault_restore``;
    :meth:`ArenaCache.prefault`), unless an arena is kept or being made."""
    if (not self.options.prefault_restore or self.backend.prefetch_pool is None
        or (self._prefaulting is not None and self._prefaulting.is_alive())
        or self._arenas.kept_bytes):  # (after: it waits while a prefault runs)
      return
    try:
      nbytes = _planner.own_bytes(self.backend.manifests())
    except Exception as e:  # noqa: BLE001 - an optimization: never fail a save or a start
      logger.warning("restore memory not faulted in ahead: %r", e)
      return
    if nbytes:
      self._prefaulting = threading.Thread(target=self._arenas.prefault, args=(nbytes,),
                                           name="snapstore-prefault", daemon=True)
      self._prefaulting.start()

  def _raise_drain_error(self) -> None:
    f = self._inflight
    if f is not None and f.done() and f.exception() is not None:
      self._inflight = None
      raise errors.DrainFailedError(
          f"the background snapshot failed: {f.exception()!r}") from f.exception()

  def wait_until_finished(self) -> None:
    """Blocks until the in-flight snapshot (and persistent save) is committed."""
    if self._inflight is not None:
      futures.wait([self._inflight])
    if self.persistent is not None:
      self.persistent.wait_until_finished()
    self._raise_drain_error()

  # --------------------------------------------------------------- domains
  def forget_domains(self, domains: Sequence[int], reason: str) -> None:
    """Single controller: the host memory of ``domains`` (slices) is gone
    (their workers were lost); drop what their stores held."""
    for d in domains:
      logger.warning("slice %d: its host-RAM snapshots are lost (%s)", d, reason)
    if self._inflight is not None:  # else it could commit to a store wiped here
      futures.wait([self._inflight])  # (its error, if any, comes with the next save)
    self.backend.forget_domains(domains, reason)

  def set_active_domains(self, domains: Sequence[int]) -> None:
    """Single controller: the slices that are up now. Snapshots (and their
    cross-slice copies) go to these only, until the next call."""
    self.backend.set_active_domains(domains)

  # ------------------------------------------------------------- queries
  def snapshot_steps(self) -> list[int]:
    """Steps with a complete snapshot manifest in the stores this process holds."""
    return sorted({m.step for m in _planner.fence(self.backend.manifests())})

  def all_steps(self) -> list[int]:
    """Steps restorable from any tier (snapshots of this host, committed Orbax)."""
    steps = set(self.snapshot_steps())
    if self.persistent is not None:
      steps.update(self.persistent.committed_steps())
    return sorted(steps)

  def latest_step(self) -> int | None:
    steps = self.all_steps()
    return steps[-1] if steps else None

  # ------------------------------------------------------------- restore
  def restore(self, abstract_state: Any, *, step: int | None = None) -> RestoreResult:
    """Restores the freshest usable step (or ``step``) into ``abstract_state``'s layout.

    ``abstract_state`` is a pytree of ``jax.ShapeDtypeStruct`` (with
    shardings), concrete arrays, numpy arrays or scalars, with the structure
    that was saved. Sources, freshest first: a complete, checksum-valid
    snapshot (a bad copy: the next copy, else an older step); else the newest
    committed persistent step. Blocks; collective on a multi-controller job.
    """
    self._check_open()
    if step is not None and (type(step) is not int or not 0 <= step <= MAX_INT):
      raise TypeError(f"step must be an int in [0, 2**48] or None, got {step!r}")
    self._lineage_step = None  # a restore starts a new lineage (the result sets its step)
    return _restore.Restore(self, abstract_state, step, self._settle_inflight()).run()

  def _settle_inflight(self) -> list[str]:
    """Waits for the snapshot in flight; a failed one is noted, not raised."""
    try:
      self.wait_until_finished()
    except errors.DrainFailedError as e:  # e.g. its slice died mid-copy
      logger.warning("the snapshot in flight was not completed and is not used: %s", e)
      return [f"the snapshot in flight was not completed and is not used: {e}"]
    return []

  # ------------------------------------------------------------ lifecycle
  def _check_open(self) -> None:
    if self._closed:
      raise RuntimeError("this SnapshotManager is closed")

  def close(self) -> None:
    """Waits for in-flight work, then releases threads and memory."""
    if self._closed:
      return
    try:
      self.wait_until_finished()
    finally:
      self._closed = True
      self._drainer.shutdown(wait=True)
      self._copy_pool.shutdown(wait=True)
      if self.persistent is not None:
        self.persistent.close()
      self.backend.close()
      if self._prefaulting is not None:
        self._arenas.interrupt()
        self._prefaulting.join()
      self._arenas.release()

  def __enter__(self) -> SnapshotManager:
    return self

  def __exit__(self, *exc: object) -> None:
    self.close()
