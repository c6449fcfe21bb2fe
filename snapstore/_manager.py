"""SnapshotManager: orchestration only. It decides *when* (the intervals)
and *which incarnation* writes (:mod:`._fencing`), and applies each
restore's outcome. Where snapshots live is a backend's business
(:mod:`._backends`); what to restore, :mod:`._restore`'s; who takes part,
the job's (:mod:`snapstore._multihost`)."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping, Sequence
from concurrent import futures
from typing import Any

import jax
import orbax.checkpoint as ocp

from . import (
    _backends,
    _faults,
    _fencing,
    _interval,
    _jax_compat,
    _multihost,
    _planner,
    _restore,
    _save,
    errors,
)
from ._arena import ArenaCache
from ._manifest import check_extra, check_inline
from ._persistent import OrbaxTier
from ._tree import flatten
from .metrics import RestoreResult, SaveMetrics, Source
from .options import SnapshotOptions

logger = logging.getLogger(__name__)

class SnapshotManager:
  """Keeps per-step snapshots of a train state in host RAM, beside Orbax.

  Collective: on a multi-controller job (``jax.distributed``) every process
  constructs the manager, calls ``save`` with the same steps and ``restore``
  together. Threads: ``save``, ``restore``, ``wait_until_finished`` and the
  domain calls from one thread (the training loop); the copy, checksums and
  manifest commit of a snapshot run on a background thread. Its failure is
  counted in ``metrics.store_failures`` (``FailurePolicy.CONTINUE``, the
  default) or raised by the next ``save``, ``wait_until_finished`` or
  ``close`` (``RAISE``: :class:`DrainFailedError`).

  Args:
    options: a :class:`SnapshotOptions` (None: the defaults).
    persistent: the persistent tier: an ``orbax.checkpoint.CheckpointManager``,
      an :class:`OrbaxTier`, a path (local or ``gs://``), or None.
    slices: single controller (Pathways) only: failure domain -> its devices;
      one store per domain, all held by this process.

  Raises:
    ValueError: ``slices`` with ``jax.distributed``, or ``PinnedHost()`` without
      (the store value's ``build`` says why it cannot serve this job).
    StoreError: the store cannot be used (:class:`UnsafeStoreError`: unsafe).
  """

  def __init__(self, options: SnapshotOptions | None = None, *,
               persistent: OrbaxTier | ocp.CheckpointManager | str | os.PathLike[str]
               | None = None,
               slices: Mapping[int, Sequence[jax.Device]] | None = None):
    self.options = options or SnapshotOptions()
    self.host, self.num_hosts = jax.process_index(), jax.process_count()
    _jax_compat.check_cpu_cache()  # (a warning where this jaxlib's cache hangs)
    self._copy_pool = futures.ThreadPoolExecutor(
        self.options.copy_threads, thread_name_prefix="snapstore-copy")
    self._backend: _backends.Backend[Any] = _backends.build(self.options.store, self.options,
        host=self.host, num_hosts=self.num_hosts, slices=slices, pool=self._copy_pool)
    self._peers = _multihost.for_job(self.host, self.num_hosts)
    self.persistent = (persistent if persistent is None or isinstance(persistent, OrbaxTier)
                       else OrbaxTier(persistent))
    self._newest_step, prev_inc = self._backend.read_progress()
    self.incarnation: int = _fencing.first_incarnation(
        self.options, self._backend.manifests(), prev_inc, self._peers.agree_max,
        self._backend.describe())
    self._lineage_step: int | None = None  # the last step passed to save, this lineage
    self.metrics = SaveMetrics()
    self._arenas = ArenaCache()  # restore memory, reused (._arena)
    self._job_size = max(self.num_hosts, len(self._backend.store_ids()))
    self._saver = _save.Saver(self._backend, self.options, self.metrics,
                              _interval.schedule_for(self.options.interval, self._job_size),
                              self._arenas, self._peers.start_reduce_min)
    self._closed = False

  def save(self, step: int, state: Any, *, extra: Any = None, force: bool = False) -> bool:
    """Snapshots ``state`` at ``step`` if the interval says so (or ``force``),
    and saves it to the persistent tier on its interval. Collective on a
    multi-controller job; the training thread. Blocks until the buffers are
    safe from the next step (``BusyPolicy.WAIT``: and the last snapshot done).

    Args:
      step: an int in [0, 2**48], not below the last one saved (or restored).
      state: a pytree of ``jax.Array``, numpy arrays and scalars.
      extra: msgpack-able data restored with the step (a data iterator's).
      force: snapshot this step whatever the interval.

    Returns:
      True if a snapshot was started; False if the step is no snapshot step,
      was skipped under ``BusyPolicy.SKIP`` (``metrics.skipped_busy``), or
      the RAM tier failed under ``FailurePolicy.CONTINUE``
      (``metrics.store_failures``).

    Raises:
      InvalidStepError: ``step`` is not an int in [0, 2**48].
      StepOrderError: ``step`` is older than the last one saved.
      UnsupportedLeafError: a leaf a restore could not read back.
      UnsupportedExtraError: ``extra`` is not msgpack-able, or it and the
        state's strings are too big for a manifest (32 MiB).
      DeletedLeafError: an array whose buffer was donated or deleted.
      BudgetExceededError: the store cannot hold a snapshot in its budget
        (or its filesystem has no room for a new slot); ``StoreError``: it
        cannot be written. On a run's first snapshot (a misconfiguration),
        or any under ``FailurePolicy.RAISE``. (A new slot is made by the
        drain: a filesystem that refuses it after all fails that drain.)
      DrainFailedError: the previous snapshot failed in the background
        (``FailurePolicy.RAISE``; CONTINUE counts it and goes on).
      ClosedError: the manager is closed.
    """
    self._check_open()
    t_enter = time.perf_counter()
    _fencing.check_step(step)
    _fencing.check_order(step, self._lineage_step, self.incarnation)
    self._lineage_step = step
    self._newest_step = max(self._newest_step, step)
    self._backend.write_progress(self._newest_step, self.incarnation)
    snap = force or self._saver.due(step, t_enter)
    persist = self.persistent is not None and self.options.should_persist(step)
    if not (snap or persist):
      return False
    extra_bytes = check_extra(extra)
    specs, leaves, _ = flatten(state)
    check_inline(extra_bytes, leaves)
    if persist and self.persistent is not None:
      _faults.point("orbax", step)
      self.persistent.save(step, specs, leaves, extra)
      self.metrics.persistent_saves += 1
      _faults.point("persistent", step)
    if not snap:
      return False
    header = _backends.Header.for_snapshot(self.options, incarnation=self.incarnation, step=step,
                                           num_hosts=self._job_size, specs=specs, extra=extra)
    return self._saver.start(step, header, specs, leaves, t_enter)

  def wait_until_finished(self) -> bool:
    """Blocks until the snapshot in flight (and the persistent save) is
    done. The training thread; not collective.

    Returns:
      True if that snapshot committed (or none was in flight); False if it
      failed and ``FailurePolicy.CONTINUE`` counted it
      (``metrics.store_failures``, ``metrics.last_store_failure``). Nothing
      of a failed step is committed; the snapshots before it stay.

    Raises:
      DrainFailedError: it failed, under ``FailurePolicy.RAISE``.
    """
    return self._finish() is None

  def _finish(self) -> errors.DrainFailedError | None:
    """:meth:`wait_until_finished`, returning the failure it counted."""
    self._saver.wait()
    if self.persistent is not None:
      self.persistent.wait_until_finished()
    return self._saver.settle()

  @property
  def store(self) -> Any:
    """The store value that built the backend (``options.store``, ``Auto()`` resolved)."""
    return self._backend.spec

  def forget_domains(self, domains: Sequence[int], reason: str) -> None:
    """Single controller: drops what the stores of ``domains`` (slices whose
    host memory is gone) held. The training thread; waits for the snapshot
    in flight (its error comes with the next ``save``).

    Args:
      domains: the failure domains lost.
      reason: why, for the log.
    """
    for d in domains:
      logger.warning("slice %d: its host-RAM snapshots are lost (%s)", d, reason)
    self._saver.wait()  # else it could commit to a store wiped here
    self._backend.forget_domains(domains, reason)

  def set_active_domains(self, domains: Sequence[int]) -> None:
    """Single controller: snapshots (and their cross-slice copies) go to
    ``domains`` only until the next call. The training thread; no wait.

    Args:
      domains: the failure domains (slices) that are up.
    """
    self._backend.set_active_domains(domains)

  def snapshot_steps(self) -> list[int]:
    """Returns the steps with a complete snapshot manifest, not fenced, in
    the stores this process holds, ascending. Local; any thread."""
    return sorted({m.step for m in _planner.fence(self._backend.manifests())})

  def all_steps(self) -> list[int]:
    """Returns the steps restorable from this process's snapshots or the
    persistent tier (committed), ascending. Local."""
    steps = set(self.snapshot_steps())
    if self.persistent is not None:
      steps.update(self.persistent.committed_steps())
    return sorted(steps)

  def latest_step(self) -> int | None:
    """Returns the newest of :meth:`all_steps`, None if there is none."""
    steps = self.all_steps()
    return steps[-1] if steps else None

  def restore(self, abstract_state: Any, *, step: int | None = None) -> RestoreResult:
    """Restores the freshest usable step (or ``step``) into ``abstract_state``'s
    layout: a complete, checksum-valid snapshot (a bad copy: another copy,
    else an older step), else the newest committed persistent step.
    Collective on a multi-controller job; the training thread; blocks.

    Args:
      abstract_state: the saved structure, as ``jax.ShapeDtypeStruct`` (with
        shardings), arrays or scalars.
      step: restore this step only (None: the freshest).

    Returns:
      A :class:`RestoreResult`: the state, its step and source, the steps
      lost, why fresher ones were not used. Later saves continue from it.

    Raises:
      InvalidStepError: ``step`` is not None or an int in [0, 2**48].
      TreeMismatchError: ``abstract_state`` does not match what was saved.
      NothingToRestoreError: no snapshot and no persistent step (or
        ``StepNotFoundError``: none of ``step``). Nothing was deleted.
      ClosedError: the manager is closed.
    """
    self._check_open()
    _fencing.check_step(step, optional=True)
    self._lineage_step = None  # a restore starts a new lineage (the result sets its step)
    notes = _restore.settle(self._finish)
    job = _restore.Restore(_restore.Inputs(
        backend=self._backend, peers=self._peers, persistent=self.persistent,
        options=self.options, arenas=self._arenas, host=self.host,
        newest_step=self._newest_step, incarnation=self.incarnation),
        abstract_state, step, notes)
    try:
      result, _ = job.run()  # (and its outcome, job.outcome: applied here)
    finally:  # raised or not, what it decided holds (the incarnation, lost domains)
      self._apply(job.outcome)
    # every host restored this step: the stores keep it until a newer one is agreed
    self._saver.restored(result.step if result.source is Source.SNAPSHOT else None)
    return result

  def _apply(self, outcome: _restore.Outcome) -> None:
    """A restore's outcome: with ``save``, the only writer of the fencing state."""
    self.incarnation, self._lineage_step = outcome.incarnation, outcome.lineage_step
    if outcome.lost_domains:
      self.forget_domains(outcome.lost_domains, "its store raised on read")
      if outcome.active_domains is not None:
        self._backend.set_active_domains(outcome.active_domains)

  def _check_open(self) -> None:
    if self._closed:
      raise errors.ClosedError("this SnapshotManager is closed; make a new one")

  def close(self) -> None:
    """Waits for in-flight work, then releases threads, stores and memory.
    Idempotent; the training thread (``with`` calls it).

    Raises:
      DrainFailedError: the snapshot in flight failed, under
        ``FailurePolicy.RAISE`` (released all the same).
    """
    if self._closed:
      return
    try:
      self.wait_until_finished()
    finally:
      self._closed = True
      self._saver.close()
      self._copy_pool.shutdown(wait=True)
      if self.persistent is not None:
        self.persistent.close()
      self._backend.close()
      self._arenas.release()

  def __enter__(self) -> SnapshotManager:
    return self

  def __exit__(self, exc_type: object, *exc: object) -> None:
    if exc_type is None:
      self.close()
      return
    try:  # an error already on its way out is never replaced by the drain's
      self.close()
    except errors.DrainFailedError as e:
      logger.warning("closing after an error: %s", e)
