"""SnapshotManager: orchestration only; the logic lives in the modules it calls."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent import futures
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

import numpy as np

from . import _capture, _exchange, _faults, _pinnedstore, _planner, errors
from ._assemble import Assembler, BadCopy, build_leaf, full_region
from ._hoststore import HostStore, align, host_dir
from ._layout import (LeafKind, batches, check_compatible, flatten, tree_digest,
                      wants_numpy)
from ._manifest import Manifest, PieceRecord, check_extra, write_atomic
from ._persistent import OrbaxTier, target_sharding
from ._placement import host_domains
from .metrics import RestoreResult, SaveMetrics, Source
from .options import BusyPolicy, SnapshotOptions, StoreKind

logger = logging.getLogger(__name__)

REPORT_DIR_ENV = "SNAPSTORE_REPORT_DIR"
INCARNATION_ENV = "SNAPSTORE_INCARNATION"


class SnapshotManager:
  """Keeps per-step snapshots of a train state in host RAM, beside Orbax.

  Args:
    options: a :class:`SnapshotOptions`.
    persistent: the persistent tier: an ``orbax.checkpoint.CheckpointManager``,
      an :class:`OrbaxTier`, a path (local or ``gs://``), or None.

  Threading: call ``save``/``restore``/``wait_until_finished`` from one thread
  (the training loop). ``save`` returns once the state's buffers are safe from
  the next step; the copy into the store, the checksums and the manifest
  commit run on background threads. Errors of a background drain are raised
  by the next ``save`` or ``wait_until_finished``.
  """

  def __init__(self, options: SnapshotOptions | None = None, *,
               persistent: OrbaxTier | ocp.CheckpointManager | str | os.PathLike[str]
               | None = None,
               slices: Mapping[int, Sequence[jax.Device]] | None = None):
    self.options = options or SnapshotOptions()
    self.host = jax.process_index()
    self.num_hosts = jax.process_count()
    # Single controller (Pathways): one store per failure domain (slice), all
    # held by this process; multi-controller: one store, this host's.
    self._domain_of: dict[jax.Device, int] | None = None
    if slices is not None:
      if self.num_hosts > 1:
        raise ValueError("slices= is for a single controller (one process); with "
                         "jax.distributed each process keeps its own host store")
      self._domain_of = {d: k for k, devs in slices.items() for d in devs}
    self.store_kind = _store_kind(self.options.store, slices)
    self._slices = {k: list(v) for k, v in slices.items()} if slices is not None else None
    self._down: set[int] = set()  # slices lost and not reported back (single controller)
    self._integrity = self.options.pinned_checksum
    if self._integrity == "auto" and slices is not None:
      self._integrity = _pinnedstore.integrity_for([d for v in slices.values() for d in v])
    ids = sorted(slices) if slices is not None else [self.host]
    self.stores: dict[int, HostStore | _pinnedstore.PinnedHostStore]
    if self.store_kind is StoreKind.PINNED_HOST:
      self.stores = {i: _pinnedstore.PinnedHostStore(
          i, keep=self.options.keep, budget_bytes=self.options.budget_bytes) for i in ids}
    else:
      self.stores = {i: HostStore(
          host_dir(self.options.store_dir, self.options.run_id, i),
          run_id=self.options.run_id, host=i, keep=self.options.keep,
          budget_bytes=self.options.budget_bytes) for i in ids}
    if persistent is None or isinstance(persistent, OrbaxTier):
      self.persistent = persistent
    else:
      self.persistent = OrbaxTier(persistent)
    progress = [st.read_progress() for st in self.stores.values()]
    prev_step, prev_inc = max(p[0] for p in progress), max(p[1] for p in progress)
    self.incarnation = self.options.incarnation
    if self.incarnation is None and os.environ.get(INCARNATION_ENV, "").isdigit():
      self.incarnation = int(os.environ[INCARNATION_ENV])
    if self.incarnation is None:
      seen = [m.incarnation for m in self._all_manifests()] + [prev_inc]
      self.incarnation = max(seen) + 1
      if self.num_hosts > 1:  # a replaced host starts empty: agree on the max.
        self.incarnation = int(_exchange.gather_ints([self.incarnation]).max())
    self._newest_step = prev_step
    self.metrics = SaveMetrics()
    self._copy_pool = futures.ThreadPoolExecutor(
        self.options.copy_threads, thread_name_prefix="snapstore-copy")
    self._drainer = futures.ThreadPoolExecutor(1, thread_name_prefix="snapstore-drain")
    self._inflight: futures.Future[None] | None = None
    self._lock = threading.Lock()
    self._closed = False
    self._domains = (host_domains(jax.devices(), self.options.hosts_per_domain)
                     if self.num_hosts > 1 else None)

  # ------------------------------------------------------------------ save
  def save(self, step: int, state: Any, *, extra: Any = None,
           force: bool = False) -> bool:
    """Snapshots ``state`` at ``step`` if the interval says so (or ``force``).

    Returns True if a snapshot was started, False if this step is not a
    snapshot step or was skipped under ``BusyPolicy.SKIP`` (counted in
    ``metrics.skipped_busy``). Saves to the persistent tier on its interval.
    Blocks only until the state's buffers are safe from the next step (and,
    under ``BusyPolicy.WAIT``, until the previous snapshot is complete).
    """
    self._check_open()
    if type(step) is not int or step < 0:
      raise ValueError(f"step must be a non-negative int, got {step!r}")
    self._newest_step = max(self._newest_step, step)
    for store in self.stores.values():
      store.write_progress(self._newest_step, self.incarnation)
    snap = force or self.options.should_snapshot(step)
    persist = self.persistent is not None and self.options.should_persist(step)
    if not (snap or persist):
      return False
    check_extra(extra)
    specs, leaves, _ = flatten(state)
    if persist:
      self.persistent.save(step, specs, leaves, extra)
      self.metrics.persistent_saves += 1
    if not snap:
      return False
    if self._inflight is not None and not self._inflight.done():
      if self.options.busy_policy is BusyPolicy.SKIP:
        self.metrics.skipped_busy += 1
        logger.info("step %d: previous snapshot still draining; skipped (policy SKIP)", step)
        return False
      t = time.perf_counter()
      self._inflight.result()
      self.metrics.waited_busy += 1
      self.metrics.wait_seconds += time.perf_counter() - t
    self._raise_drain_error()
    t0 = time.perf_counter()
    base = dict(run_id=self.options.run_id, incarnation=self.incarnation, step=step,
                num_hosts=max(self.num_hosts, len(self.stores)),
                tree_digest=tree_digest(specs), chunk_bytes=self.options.chunk_bytes,
                leaves=tuple(specs), extra=extra)
    if self.store_kind is StoreKind.PINNED_HOST:
      def make_room(nbytes: Mapping[int, int]) -> None:
        for sid, n in nbytes.items():
          self.stores[sid].plan_slots(n)
          self.stores[sid].make_room(step)
      live = {k: v for k, v in self._slices.items() if k not in self._down}
      pcap = _pinnedstore.capture(specs, leaves, slices=live,
                                  replicas=self.options.replicas, step=step,
                                  integrity=self._integrity,
                                  before_dispatch=make_room)
      self._inflight = self._drainer.submit(self._drain_pinned, pcap, base)
    else:
      self._start_host_files(step, specs, leaves, base)
    self.metrics.snapshots_started += 1
    self.metrics.capture_seconds = time.perf_counter() - t0
    self.metrics.capture_seconds_total += self.metrics.capture_seconds
    return True

  def _start_host_files(self, step: int, specs: list[Any], leaves: list[Any],
                        base: dict[str, Any]) -> None:
    if self._domain_of is not None:
      caps = _capture.capture_by_domain(specs, leaves, domain_of=self._domain_of,
                                        replicas=self.options.replicas, step=step)
    else:
      caps = {self.host: _capture.capture(specs, leaves, host=self.host,
                                          domains=self._domains,
                                          replicas=self.options.replicas, step=step)}
    jobs = []
    for sid, cap in caps.items():
      store = self.stores[sid]
      store.plan_slots(cap.nbytes)
      slot = store.free_slot(_planner.fence(store.manifests()))
      for m in store.manifests():
        if m.slot == slot:
          store.delete(m.step, f"slot {slot} reused for step {step}")
      jobs.append((store, cap, slot, dict(base, host=sid, slot=slot,
                                          scalars=dict(cap.scalars))))
    self._inflight = self._drainer.submit(self._drain, jobs)

  def _drain(self, jobs: list[tuple[HostStore, _capture.Capture, int, dict[str, Any]]]
             ) -> None:
    t0 = time.perf_counter()
    nbytes = 0
    for store, cap, slot, base in jobs:
      offsets = _capture.layout_offsets(cap.pieces)
      nbytes += cap.nbytes
      crcs = _capture.drain(cap, store.slot_buffer(slot), offsets,
                            pool=self._copy_pool, chunk_bytes=self.options.chunk_bytes)
      pieces = tuple(PieceRecord(p.leaf, p.index, off, p.nbytes, c, owner)
                     for p, off, c, owner in zip(cap.pieces, offsets, crcs, cap.owners))
      store.commit(Manifest(pieces=pieces, created=time.time(), **base))
      self._retain(store)
    self.metrics.snapshots_committed += 1
    self.metrics.bytes_snapshotted += nbytes
    self.metrics.drain_seconds = time.perf_counter() - t0
    self.metrics.drain_seconds_total += self.metrics.drain_seconds

  def _drain_pinned(self, cap: _pinnedstore.PinnedCapture, base: dict[str, Any]) -> None:
    t0 = time.perf_counter()
    cap.wait()
    nbytes = 0
    for sid in cap.pieces:
      store = self.stores[sid]
      pieces = tuple(PieceRecord(p.leaf, p.index, pos, p.nbytes, ck, owner)
                     for pos, ((p, owner), ck) in enumerate(
                         zip(cap.pieces[sid], cap.checksums(sid, self._copy_pool))))
      nbytes += cap.nbytes(sid)
      store.commit(Manifest(pieces=pieces, created=time.time(), host=sid, slot=base["step"],
                            scalars=dict(cap.scalars), **base), cap.arrays[sid])
      self._retain(store)
    self.metrics.snapshots_committed += 1
    self.metrics.bytes_snapshotted += nbytes
    self.metrics.drain_seconds = time.perf_counter() - t0
    self.metrics.drain_seconds_total += self.metrics.drain_seconds

  def _retain(self, store: HostStore | _pinnedstore.PinnedHostStore) -> None:
    ms = store.manifests()
    valid = _planner.fence(ms)
    for m in ms:
      if m not in valid:
        store.delete(m.step, "superseded by a newer incarnation")
    keep = min(self.options.keep, max(store.num_slots - 1, 1))
    for m in valid[:-keep]:
      store.delete(m.step, f"retention keeps {keep}")

  @property
  def store(self) -> HostStore | _pinnedstore.PinnedHostStore:
    """This host's store (the first domain's, on a single controller)."""
    return self.stores.get(self.host) or next(iter(self.stores.values()))

  def _all_manifests(self) -> list[Manifest]:
    return [m for st in self.stores.values() for m in st.manifests()]

  def forget_domains(self, domains: Sequence[int], reason: str) -> None:
    """Single controller: the host memory of ``domains`` (slices) is gone
    (their workers were lost); drop what their stores held."""
    for d in domains:
      if d in self.stores:
        logger.warning("slice %d: its host-RAM snapshots are lost (%s)", d, reason)
        self.stores[d].wipe()
      self._down.add(d)

  def set_active_domains(self, domains: Sequence[int]) -> None:
    """Single controller: the slices that are up now. Snapshots (and their
    cross-slice copies) go to these only, until the next call."""
    self._down = set(self.stores) - set(domains)

  def _raise_drain_error(self) -> None:
    f = self._inflight
    if f is not None and f.done() and f.exception() is not None:
      self._inflight = None
      raise errors.SnapshotInProgressError(
          f"the background snapshot failed: {f.exception()!r}") from f.exception()

  def wait_until_finished(self) -> None:
    """Blocks until the in-flight snapshot (and persistent save) is committed."""
    if self._inflight is not None:
      futures.wait([self._inflight])
    if self.persistent is not None:
      self.persistent.wait_until_finished()
    self._raise_drain_error()

  # ------------------------------------------------------------- queries
  def snapshot_steps(self) -> list[int]:
    """Steps with a complete snapshot manifest in this host's store."""
    return sorted({m.step for m in _planner.fence(self._all_manifests())})

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
    snapshot; else the newest committed persistent step. Blocks.
    """
    self._check_open()
    notes: list[str] = []
    try:
      self.wait_until_finished()
    except errors.SnapshotInProgressError as e:  # e.g. its slice died mid-copy
      notes.append(f"the snapshot in flight was not completed and is not used: {e}")
      logger.warning(notes[-1])
    t0 = time.perf_counter()
    timings: dict[str, float] = {}
    target_specs, targets, treedef = flatten(abstract_state)
    manifests = self._all_manifests()
    newest = max([self._newest_step] + [m.step for m in manifests])
    if self.num_hosts > 1:  # collective: every host exchanges its inventory.
      manifests = _exchange.gather_manifests(manifests)
      newest = int(_exchange.gather_ints([newest]).max())
    timings["scan"] = time.perf_counter() - t0
    persistent_steps = self.persistent.committed_steps() if self.persistent else []
    persistent_steps_ok = [s for s in persistent_steps if step is None or s == step]
    bad: set[_planner.CopyKey] = set()
    self._bytes_exchanged = 0
    while True:
      t = time.perf_counter()
      reasons: list[str] = []
      plan = _planner.choose(manifests, step=step, bad=bad, prefer_host=self.host,
                             reasons=reasons)
      timings["plan"] = timings.get("plan", 0.0) + time.perf_counter() - t
      if plan is None or (persistent_steps_ok and persistent_steps_ok[-1] > plan.step):
        break
      check_compatible(plan.specs, target_specs, step=plan.step)
      t = time.perf_counter()
      if self.num_hosts > 1:
        assembler = Assembler(plan, self._reader, pool=self._copy_pool,
                              pick=self._local_first)
        new_bad = self._verify_local(plan, assembler)
        if new_bad:
          for key in new_bad:
            note = (f"step {plan.step}: checksum mismatch in leaf "
                    f"{plan.specs[key[2]].path!r} held by host {key[0]}; "
                    "using another copy or an older step")
            logger.warning(note)
            notes.append(note)
          bad.update(new_bad)
          continue
        leaves = self._assemble_multihost(plan, assembler, target_specs, targets)
      else:
        assembler = (_pinnedstore.PinnedAssembler(plan, self.stores, pool=self._copy_pool)
                     if self.store_kind is StoreKind.PINNED_HOST
                     else Assembler(plan, self._reader, pool=self._copy_pool))
        _faults.point("restore", plan.step)
        try:
          leaves = assembler.tree(target_specs, targets)
        except BadCopy as e:
          assembler.bad.setdefault(e.key, e)
          leaves = None
        for key, e in assembler.bad.items():  # one note per bad copy found
          notes.append(f"step {plan.step}: {e}; using another copy or an older step")
          logger.warning(notes[-1])
        bad.update(assembler.bad)
        if leaves is None:
          continue
      timings["read"] = time.perf_counter() - t
      timings["total"] = time.perf_counter() - t0
      read = {"snapshot": assembler.bytes_read}
      if self.num_hosts > 1:
        read["exchanged"] = self._bytes_exchanged
      return self._report(RestoreResult(
          step=plan.step, state=jax.tree_util.tree_unflatten(treedef, leaves),
          extra=plan.extra, source=Source.SNAPSHOT, rewind_steps=newest - plan.step,
          newest_step=newest, bytes_read=read, timings=timings, notes=tuple(notes)))
    if not persistent_steps_ok:
      where = self.persistent.directory if self.persistent else "no persistent tier"
      what = f"step {step}" if step is not None else "any step"
      held = (f"the {self.store_kind.value} stores of slices {sorted(self.stores)}"
              if self.store_kind is StoreKind.PINNED_HOST else self.store.root.parent)
      raise (errors.StepNotFoundError if step is not None else errors.NothingToRestoreError)(
          f"no complete snapshot of {what} in {held} and no committed "
          f"checkpoint in {where}. Nothing was deleted; start from scratch, or "
          "point store_dir/run_id/persistent at the run to resume.")
    pstep = persistent_steps_ok[-1]
    notes.extend(reasons[:1])  # why the freshest snapshot step was not usable
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
        timings=timings, notes=tuple(notes)))

  def _report(self, result: RestoreResult) -> RestoreResult:
    """Under ``snapstore launch`` (``SNAPSTORE_REPORT_DIR`` set), host 0
    writes the restore summary for the supervisor's incarnation report."""
    where = os.environ.get(REPORT_DIR_ENV)
    if where and self.host == 0:
      doc = dict(result.summary(), incarnation=self.incarnation, time=time.time())
      write_atomic(Path(where) / f"restore-inc{self.incarnation}.json",
                   json.dumps(doc).encode())
    return result

  def _local_first(self, copies: Any) -> _planner.Copy:
    local = [c for c in copies if c.host == self.host]
    return local[0] if local else _exchange.chosen_source(copies)

  def _verify_local(self, plan: _planner.StepPlan, assembler: Assembler) -> list[Any]:
    """Verifies every copy this host holds for ``plan``; collective: returns
    the bad copies found on any host."""
    local_bad = []
    for (leaf, idx), copies in plan.copies.items():
      if any(c.host == self.host for c in copies):
        try:
          assembler.piece(leaf, idx)
        except BadCopy as e:
          local_bad.append(e.key)
    return _exchange.gather_bad(local_bad)

  def _assemble_multihost(self, plan: _planner.StepPlan, assembler: Assembler,
                          target_specs: Any, targets: Any) -> list[Any]:
    """Each leaf: cut locally where every host holds what its devices need,
    else move the pieces with batched JAX reductions (every host calls this)."""
    by_path = {s.path: i for i, s in enumerate(plan.specs)}
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("all",))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    out: list[Any] = [None] * len(target_specs)
    moved: list[int] = []  # positions in target_specs whose pieces must travel
    for pos, (tspec, target) in enumerate(zip(target_specs, targets)):
      li = by_path[tspec.path]
      spec = plan.specs[li]
      if spec.kind is LeafKind.SCALAR:
        out[pos] = plan.scalars.get(li)
        continue
      sharding = (replicated if wants_numpy(spec, tspec, target)
                  else target_sharding(target))
      if _exchange.locally_coverable(plan, li, sharding, spec.shape):
        out[pos] = assembler.leaf(li, tspec, target)
      else:
        moved.append(pos)
      if pos == len(target_specs) // 2:
        _faults.point("restore", plan.step)
    sizes = [align(plan.specs[by_path[target_specs[p].path]].nbytes) for p in moved]
    groups = batches(sizes, _exchange.BATCH_BYTES)
    width = max((sum(sizes[i] for i in g) for g in groups), default=0)
    for group in groups:  # the same groups, in the same order, on every host.
      buf = np.zeros(width, np.uint8)
      offsets, off = [], 0
      for i in group:
        li = by_path[target_specs[moved[i]].path]
        spec = plan.specs[li]
        offsets.append(off)
        leaf = buf[off: off + spec.nbytes].view(spec.np_dtype).reshape(spec.shape)
        for idx, copies in plan.leaf_copies(li).items():
          if _exchange.chosen_source(copies).host == self.host:
            leaf[tuple(slice(a, b) for a, b in idx)] = assembler.piece(li, idx)
        off += sizes[i]
      total = _exchange.sum_bytes(buf)
      self._bytes_exchanged += total.nbytes
      for i, at in zip(group, offsets):
        pos = moved[i]
        spec = plan.specs[by_path[target_specs[pos].path]]
        full = total[at: at + spec.nbytes].view(spec.np_dtype).reshape(spec.shape)
        out[pos] = build_leaf(spec, target_specs[pos], targets[pos], full_region(full))
    return out

  def _reader(self, copy: _planner.Copy) -> Any:
    store = self.stores.get(copy.host)
    if store is None:
      raise NotImplementedError("remote copies are read by the multi-host path")
    buf = store.read_buffer(copy.slot, copy.slot_bytes)
    return buf[copy.record.offset: copy.record.offset + copy.record.nbytes]

  # ------------------------------------------------------------ lifecycle
  def _check_open(self) -> None:
    if self._closed:
      raise RuntimeError("this SnapshotManager is closed")

  def close(self) -> None:
    """Waits for in-flight work, then releases threads and mappings."""
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
      for store in self.stores.values():
        store.close()

  def __enter__(self) -> SnapshotManager:
    return self

  def __exit__(self, *exc: object) -> None:
    self.close()


def _store_kind(kind: StoreKind, slices: Mapping[int, Sequence[jax.Device]] | None
                ) -> StoreKind:
  """Resolves ``StoreKind.AUTO``; rejects a pinned-host store without slices."""
  if kind is StoreKind.PINNED_HOST and slices is None:
    raise ValueError(
        "the pinned_host store is for a single controller: pass slices= (failure "
        "domain -> devices). With jax.distributed, host files outlive the process "
        "that wrote them; pinned host memory does not.")
  if kind is StoreKind.AUTO:
    devices = [d for devs in (slices or {}).values() for d in devs]
    pinned = slices is not None and _pinnedstore.supports_pinned_host(devices)
    return StoreKind.PINNED_HOST if pinned else StoreKind.HOST_FILES
  return kind
