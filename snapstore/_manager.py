"""SnapshotManager: orchestration only.

The manager decides *when* (interval, busy policy, persistent interval),
*which incarnation* writes, and *what to restore* (the decision loop). Where
snapshots live is a backend's business (:mod:`._backends`, chosen once here);
who takes part in a restore is the job's (:mod:`._peers`); building leaves
from pieces is the assembler's (:mod:`._assemble`).
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
    _switch,
    errors,
)
from ._arena import ArenaCache
from ._assemble import Assembler
from ._layout import LeafSpec, check_compatible, check_targets, flatten, tree_digest
from ._manifest import check_extra, copy_extra
from ._persistent import OrbaxTier
from .metrics import RestoreResult, SaveMetrics, Source
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
    self._faulting_at_start = 0.0  # _arena.faulting_seconds() when a restore began

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
    self._lineage_step = None  # a restore starts a new lineage (_report sets its step)
    notes = self._settle_inflight()
    self._faulting_at_start = _arena.faulting_seconds()
    t0 = time.perf_counter()
    timings: dict[str, float] = {}
    target_specs, targets, treedef = flatten(abstract_state)
    check_targets(target_specs, targets)
    local = self.backend.manifests()
    t = time.perf_counter()
    persistent_steps = [s for s in (self.persistent.committed_steps() if self.persistent
                                    else []) if step is None or s == step]
    timings["scan_persistent"] = time.perf_counter() - t
    values = (max([self._newest_step] + [m.step for m in local]), self.incarnation,
              -(persistent_steps[-1] if persistent_steps else -1))
    exchange = ""
    if isinstance(self._peers, _peers.Distributed):
      sparse = self._restore_sparse(self._peers, local, target_specs, targets, treedef, step,
                                    persistent_steps, values, notes, timings, t0)
      if isinstance(sparse, RestoreResult):
        return sparse
      exchange = f"full: {sparse}"
      notes.append(f"every host's manifests are exchanged: {sparse}")
      logger.info(notes[-1])
    t = time.perf_counter()
    # Every store's manifests; with them, in the same exchange, one
    # incarnation for everyone from here (a replacement that joined a
    # running job may not know the one the others reached), the newest step
    # any process saw, and one view of the persistent tier (the oldest
    # newest-commit: commits only grow), so every process picks the same
    # source.
    manifests, (newest, self.incarnation, neg_latest) = self._peers.gather_manifests(
        local, values)
    persistent_steps = [s for s in persistent_steps if s <= -neg_latest]
    timings["scan_exchange"] = time.perf_counter() - t
    timings["scan"] = time.perf_counter() - t0
    # A restore of many leaves makes tens of thousands of objects, and the
    # arrays it returns outlive young collections, so full collections would
    # run during it (``benchmarks.capture`` counts them). Paused as a save
    # is (``pause_gc``).
    with _switch.collections_paused(self.options.pause_gc):
      found, manifests, why = self._restore_snapshot(
          manifests, step, target_specs, targets, treedef, persistent_steps, newest, notes,
          timings, t0, exchange)
    if found is not None:
      return found
    notes.extend(why[:1])  # why the freshest snapshot step was not usable
    result = self._restore_persistent(step, persistent_steps, target_specs, targets,
                                      treedef, newest, notes, timings, t0, exchange)
    self._branch_from(result.step, manifests)
    return result

  def _restore_snapshot(self, manifests: Any, step: int | None, target_specs: list[LeafSpec],
                        targets: list[Any], treedef: Any, persistent_steps: list[int],
                        newest: int, notes: list[str], timings: dict[str, float], t0: float,
                        exchange: str) -> tuple[RestoreResult | None, Any, list[str]]:
    """The freshest snapshot step the stores hold whole, read and placed:
    each bad copy found is noted and another copy or an older step tried.
    Returns (the result or None, the manifests left, why the freshest step
    was not usable); None where none is, or the persistent tier is newer."""
    bad: set[_planner.CopyKey] = set()
    while True:
      t = time.perf_counter()
      reasons: list[str] = []
      plan = _planner.choose(manifests, step=step, bad=bad, prefer_store=self.host,
                             reasons=reasons)
      timings["plan"] = timings.get("plan", 0.0) + time.perf_counter() - t
      if plan is None or (persistent_steps and persistent_steps[-1] > plan.step):
        return None, manifests, reasons
      check_compatible(plan.specs, target_specs, step=plan.step)
      t = time.perf_counter()
      assembler = Assembler(plan, self.backend, arenas=self._arenas)
      got = self._peers.assemble(assembler, target_specs, targets)
      for key, why in got.bad.items():  # one note per bad copy found
        if key not in assembler.bad or assembler.bad[key].lost_store is None:
          notes.append(f"step {plan.step}: {why}; using another copy or an older step")
          logger.warning(notes[-1])
      bad.update(got.bad)
      manifests = self._forget_unreadable(assembler, manifests, notes)
      if got.leaves is None:
        continue
      timings["read"] = time.perf_counter() - t
      timings.update(got.timings)
      timings["total"] = time.perf_counter() - t0
      read = {"snapshot": assembler.bytes_read}
      if self._peers.multi_host:
        read["exchanged"] = got.bytes_exchanged
      if assembler.bytes_rebuilt:
        read["rebuilt"] = assembler.bytes_rebuilt
      result = self._report(RestoreResult(
          step=plan.step, state=jax.tree_util.tree_unflatten(treedef, got.leaves),
          extra=copy_extra(plan.extra), source=Source.SNAPSHOT, rewind_steps=newest - plan.step,
          newest_step=newest, bytes_read=read, timings=timings, notes=tuple(notes),
          exchange=exchange))
      self._branch_from(result.step, manifests)
      return result, manifests, reasons

  def _restore_sparse(self, peers: _peers.Distributed, local: Sequence[Any],
                      target_specs: list[LeafSpec],
                      targets: list[Any], treedef: Any, step: int | None,
                      persistent_steps: list[int], values: tuple[int, int, int],
                      notes: list[str], timings: dict[str, float], t0: float
                      ) -> RestoreResult | str:
    """A multi-host restore from each host's own metadata
    (:meth:`._peers.Distributed.restore`); or why every host's manifests
    must be exchanged instead."""
    with _switch.collections_paused(self.options.pause_gc):
      got = peers.restore(self.backend, self._arenas, local, target_specs, targets,
                          step=step, values=values, persistent_steps=persistent_steps)
    self.incarnation = got.incarnation
    timings.update(got.timings)
    timings["scan"] = timings["scan_persistent"] + timings["scan_exchange"]
    notes.extend(got.notes)
    if got.fallback is not None:
      return got.fallback
    persistent_steps = [s for s in persistent_steps if s <= got.persistent_latest]
    if got.plan is not None and got.leaves is not None:
      plan = got.plan
      timings["read"] = sum(timings.get(k, 0.0) for k in ("read_verify", "read_agree",
                                                          "read_place"))
      timings["total"] = time.perf_counter() - t0
      read = dict(got.read, exchanged=got.read["received"] + got.read["sent"])
      result = self._report(RestoreResult(
          step=plan.step, state=jax.tree_util.tree_unflatten(treedef, got.leaves),
          extra=copy_extra(plan.extra), source=Source.SNAPSHOT,
          rewind_steps=got.newest - plan.step, newest_step=got.newest, bytes_read=read,
          timings=timings, notes=tuple(notes), exchange="sparse"))
    else:
      notes.extend(got.reasons[:1])  # why the freshest snapshot step was not usable
      result = self._restore_persistent(step, persistent_steps, target_specs, targets,
                                        treedef, got.newest, notes, timings, t0, "sparse")
    new = peers.branch(local, result.step, self.incarnation)
    if new != self.incarnation:
      logger.info("restored step %d: saves continue as incarnation %d (a new branch)",
                  result.step, new)
      self.incarnation = new
    return result

  def _forget_unreadable(self, assembler: Assembler, manifests: list[Any],
                         notes: list[str]) -> list[Any]:
    """Single controller: a store whose memory raised DATA_LOSS on read
    (its slice's memory is gone, as Pathways says it) is a lost domain:
    what it held is forgotten and the next plan uses the others only. The
    domain stays active if it was: whether it is up is the elastic
    manager's to say, and a later snapshot writes to it again. The
    manifests left to plan from."""
    lost = sorted(assembler.lost_stores)
    if not lost or self._peers.multi_host:
      return manifests
    why = next(str(e) for e in assembler.bad.values() if e.lost_store == lost[0])
    notes.append(f"step {assembler.plan.step}: the stores of domains {lost} raised on read "
                 f"({why}): treated as lost; planning from the others")
    logger.warning(notes[-1])
    live = getattr(self.backend, "live", None)
    active = live() if live is not None else None
    self.forget_domains(lost, "its store raised on read")
    if active is not None:
      self.backend.set_active_domains(active)
    return self.backend.manifests()

  def _branch_from(self, step: int, manifests: Sequence[Any]) -> None:
    """Restoring ``step`` when this incarnation already saved later steps
    starts a new branch: later saves take a new incarnation, which fences
    the abandoned steps (:func:`._planner.fence`). Every host decides the
    same (same gathered manifests)."""
    if any(m.incarnation == self.incarnation and m.step > step for m in manifests):
      self.incarnation = max(m.incarnation for m in manifests) + 1
      logger.info("restored step %d: saves continue as incarnation %d (a new branch)",
                  step, self.incarnation)

  def _settle_inflight(self) -> list[str]:
    """Waits for the snapshot in flight; a failed one is noted, not raised."""
    try:
      self.wait_until_finished()
    except errors.DrainFailedError as e:  # e.g. its slice died mid-copy
      logger.warning("the snapshot in flight was not completed and is not used: %s", e)
      return [f"the snapshot in flight was not completed and is not used: {e}"]
    return []

  def _restore_persistent(self, step: int | None, persistent_steps: list[int],
                          target_specs: list[LeafSpec], targets: list[Any], treedef: Any,
                          newest: int, notes: list[str], timings: dict[str, float],
                          t0: float, exchange: str = "") -> RestoreResult:
    if not persistent_steps or self.persistent is None:
      where = self.persistent.directory if self.persistent else "no persistent tier"
      what = f"step {step}" if step is not None else "any step"
      seen = f" What the restore found: {'; '.join(notes[-3:])}." if notes else ""
      raise (errors.StepNotFoundError if step is not None else errors.NothingToRestoreError)(
          f"no complete snapshot of {what} in {self.backend.describe()} and no committed "
          f"checkpoint in {where}.{seen} Nothing was deleted; start a new run, or "
          "point store_dir/run_id/persistent at the run to resume.")
    pstep = persistent_steps[-1]
    notes.append(f"no complete snapshot at or after step {pstep}; "
                 "restoring from the persistent tier")
    logger.info(notes[-1])
    t = time.perf_counter()
    check_compatible(self.persistent.saved_specs(pstep), target_specs, step=pstep)
    before = self.persistent.bytes_read
    leaves, extra = self.persistent.restore(pstep, target_specs, targets)
    timings["read"] = time.perf_counter() - t
    timings["total"] = time.perf_counter() - t0
    return self._report(RestoreResult(
        step=pstep, state=jax.tree_util.tree_unflatten(treedef, leaves), extra=extra,
        source=Source.PERSISTENT, rewind_steps=max(newest, pstep) - pstep,
        newest_step=max(newest, pstep),
        bytes_read={"persistent": self.persistent.bytes_read - before},
        timings=timings, notes=tuple(notes), exchange=exchange))

  def _report(self, result: RestoreResult) -> RestoreResult:
    result.timings["first_touch"] = _arena.faulting_seconds() - self._faulting_at_start
    self._lineage_step = result.step
    return result

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
