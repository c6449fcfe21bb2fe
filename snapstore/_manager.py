"""SnapshotManager: orchestration only.

The manager decides *when* (interval, busy policy, persistent interval)
and *which incarnation* writes, and starts each restore. Where snapshots
live is a backend's business (:mod:`._backends`, chosen once here); what to
restore, one attempt after another, is :mod:`._restore`'s; who takes part
in a restore is the job's (:mod:`snapstore._multihost.peers`); building leaves from pieces is
the assembler's (:mod:`._assemble`).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping, Sequence
from concurrent import futures
from typing import Any

import jax
import orbax.checkpoint as ocp

from . import _backends, _faults, _interval, _multihost, _planner, _reports, _restore, _save, errors
from ._arena import ArenaCache
from ._manifest import check_extra
from ._persistent import OrbaxTier
from ._tree import flatten, tree_digest
from .metrics import RestoreResult, SaveMetrics, Source
from .options import MAX_INT, SnapshotOptions, StoreKind

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
    self._backend = _backends.build_backend(
        self.options, host=self.host, num_hosts=self.num_hosts, slices=slices,
        pool=self._copy_pool)
    self._peers = _multihost.for_job(self.host, self.num_hosts)
    if persistent is None or isinstance(persistent, OrbaxTier):
      self.persistent = persistent
    else:
      self.persistent = OrbaxTier(persistent)
    prev_step, prev_inc = self._backend.read_progress()
    incarnation = self.options.incarnation
    if incarnation is None:
      incarnation = _reports.incarnation_from_env()
    if incarnation is None:
      seen = [m.incarnation for m in self._backend.manifests()] + [prev_inc]
      # a replaced host starts empty: agree on the max.
      (incarnation,) = self._peers.agree_max(max(seen) + 1)
      if incarnation > MAX_INT:
        raise errors.StoreError(
            f"the stores name incarnation {incarnation - 1}, the most there can be; "
            f"inspect them ({self._backend.describe()}) or pass incarnation=")
    self.incarnation: int = incarnation
    self._newest_step = prev_step
    self._lineage_step: int | None = None  # the last step passed to save, this lineage
    self.metrics = SaveMetrics()
    self._arenas = ArenaCache()  # restore memory, reused (._arena)
    self._schedule = _interval.schedule_for(
        self.options.interval,
        max(self.num_hosts, len(self._backend.store_ids())))
    self.metrics.interval, self.metrics.interval_reason = (self._schedule.interval,
                                                           self._schedule.reason)
    self._saver = _save.Saver(self._backend, self.options, self.metrics, self._schedule,
                              self._arenas, self._peers.reduce_min)
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
    self._backend.write_progress(self._newest_step, self.incarnation)
    snap = self._schedule.due(step, t_enter,
                              t_enter if self._saver.running() else self._saver.done_at)
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
    header = _backends.Header(
        run_id=self.options.run_id, incarnation=self.incarnation, step=step,
        num_hosts=max(self.num_hosts, len(self._backend.store_ids())),
        tree_digest=tree_digest(specs), chunk_bytes=self.options.chunk_bytes,
        leaves=tuple(specs), extra=extra)
    return self._saver.start(step, header, specs, leaves, t_enter)

  def wait_until_finished(self) -> None:
    """Blocks until the in-flight snapshot (and persistent save) is committed."""
    self._saver.wait()
    if self.persistent is not None:
      self.persistent.wait_until_finished()
    self._saver.raise_drain_error()

  @property
  def store_kind(self) -> StoreKind:
    """Where this manager keeps snapshots (chosen once from the options)."""
    return self._backend.kind

  # --------------------------------------------------------------- domains
  def forget_domains(self, domains: Sequence[int], reason: str) -> None:
    """Single controller: the host memory of ``domains`` (slices) is gone
    (their workers were lost); drop what their stores held."""
    for d in domains:
      logger.warning("slice %d: its host-RAM snapshots are lost (%s)", d, reason)
    self._saver.wait()  # else it could commit to a store wiped here (its error, if any,
    # comes with the next save)
    self._backend.forget_domains(domains, reason)

  def set_active_domains(self, domains: Sequence[int]) -> None:
    """Single controller: the slices that are up now. Snapshots (and their
    cross-slice copies) go to these only, until the next call."""
    self._backend.set_active_domains(domains)

  # ------------------------------------------------------------- queries
  def snapshot_steps(self) -> list[int]:
    """Steps with a complete snapshot manifest in the stores this process holds."""
    return sorted({m.step for m in _planner.fence(self._backend.manifests())})

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
    notes = self._settle_inflight()
    job = _restore.Restore(_restore.Inputs(
        backend=self._backend, peers=self._peers, persistent=self.persistent,
        options=self.options, arenas=self._arenas, host=self.host,
        newest_step=self._newest_step, incarnation=self.incarnation),
        abstract_state, step, notes)
    try:
      result, outcome = job.run()
    except BaseException:
      self._apply(job.outcome)  # what it had agreed (incarnation, lost domains) holds
      raise
    self._apply(outcome)
    # every host restored this step: the stores keep it until a newer one is agreed
    self._saver.watermark = result.step if result.source is Source.SNAPSHOT else None
    return result

  def _apply(self, outcome: _restore.Outcome) -> None:
    """A restore's outcome: with ``save``, the only writer of the fencing state."""
    self.incarnation, self._lineage_step = outcome.incarnation, outcome.lineage_step
    if outcome.lost_domains:
      self.forget_domains(outcome.lost_domains, "its store raised on read")
      if outcome.active_domains is not None:
        self._backend.set_active_domains(outcome.active_domains)

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
      self._saver.close()
      self._copy_pool.shutdown(wait=True)
      if self.persistent is not None:
        self.persistent.close()
      self._backend.close()
      self._arenas.release()

  def __enter__(self) -> SnapshotManager:
    return self

  def __exit__(self, *exc: object) -> None:
    self.close()
