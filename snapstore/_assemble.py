"""Stored pieces -> target shards -> jax.Arrays on the caller's sharding.

One assembler for every backend. Each target shard is cut from whichever
stored pieces overlap it, so the target sharding may differ from the one that
saved. The backend supplies how one stored copy is fetched and verified
(:meth:`PieceSource.fetch`); the policy on a bad copy is the same everywhere:
the next copy of the piece, and when none is left :class:`BadCopy` reaches
the manager, which plans again (an older step, then the persistent tier).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from concurrent import futures
from typing import Any, Protocol, cast

import jax
import jax.numpy as jnp
import numpy as np

from ._arena import ArenaCache, host_arena
from ._build import build_leaf, place_host, wanted_shards
from ._checksum import SMALL_BYTES, aligned_empty
from ._index import Index, align, overlaps, shape_of, volume
from ._planner import Copy, CopyKey, StepPlan
from ._tree import LeafKind, LeafSpec, filled, target_sharding, wants_numpy

Stored = np.ndarray | jax.Array

#: The least bytes of one prefetch task. A task is otherwise a share of the
#: restore: two per worker thread. Fewer, bigger tasks hand off less between
#: threads; two a thread keep a split that runs late from leaving the other
#: thread idle for long.
PREFETCH_TASK_BYTES = 4 << 20

#: The least bytes of one group of :meth:`Assembler.read_and_place` (an
#: eighth of the restore otherwise): a put of fewer costs more in calls
#: than the overlap saves.
GROUP_BYTES = 32 << 20

#: The most bytes one run of small pieces spans (:meth:`PieceSource.fetch_run`):
#: one copy into the arena, then each piece's crc32c while it is in cache.
RUN_BYTES = 1 << 20

# What one prefetch fetches: a piece (its key), or a run of small pieces
# back to back in one slot (key, copy read).
Item = tuple[int, Index] | list[tuple[tuple[int, Index], Copy]]


def what_copy(key: CopyKey, path: str) -> str:
  """A copy's content for messages: its leaf, or its parity block."""
  if key[2] < 0:
    stripe, block = key[3][0]
    return f"parity block {block} of stripe {stripe}"
  return f"leaf {path!r}"


class BadCopy(Exception):
  """A stored copy failed verification or could not be read (internal: the
  assembler tries the next copy; the manager re-plans when none is left)."""

  def __init__(self, key: CopyKey, leaf: str, *, why: str = "checksum mismatch",
               holder: str | None = None, lost_store: int | None = None):
    super().__init__(f"{why} in {what_copy(key, leaf)} held by {holder or f'host {key[0]}'}")
    self.key = key
    self.leaf = leaf
    #: the store whose memory raised DATA_LOSS on read (its domain's memory
    #: is gone, as Pathways says it): the manager forgets what it held and
    #: plans again without it. None: only this copy is bad.
    self.lost_store = lost_store

  def bare(self) -> BadCopy:
    """This failure as a new exception with no traceback: what the assembler
    keeps and raises again. A raised exception holds the frames it unwound
    (the assembler, the leaves placed so far): kept in the assembler, that is
    a cycle only the collector frees, and on an accelerator those leaves hold
    device memory through the restore's next attempt."""
    e = BadCopy.__new__(BadCopy)
    Exception.__init__(e, *self.args)
    e.key, e.leaf, e.lost_store = self.key, self.leaf, self.lost_store
    return e


class PieceSource(Protocol):
  """What the assembler needs of a backend."""

  #: where host copies may be fetched in parallel ahead of use (None: each
  #: piece is fetched when a leaf needs it, e.g. on its device).
  prefetch_pool: futures.Executor | None
  #: its worker threads
  prefetch_workers: int
  #: whether :meth:`fetch_run` fetches a slot's consecutive small copies at once
  runs: bool

  def holds(self, store: int) -> bool:
    """True if this process can read the copies of store ``store``."""

  def fetch(self, plan: StepPlan, copy: Copy, device: jax.Device | None, *,
            out: np.ndarray | None = None) -> Stored:
    """The verified bytes of ``copy``, typed and shaped like its piece: a
    numpy array, or a jax.Array (on ``device`` where given). Raises
    :class:`BadCopy` if it fails its checksum or cannot be read. ``out``
    (from :meth:`Assembler.prefetch`, which runs fetches on a pool): flat
    uint8 memory of the piece's size, private to the caller, for a host
    copy; the copy then runs on the calling thread."""

  def fetch_run(self, plan: StepPlan, copies: Sequence[Copy], out: np.ndarray
                ) -> list[Stored | None]:
    """:meth:`fetch` of several small copies at once, where ``runs`` is
    true: ``copies`` lie back to back in one slot (each at the aligned end
    of the one before, every one a single checksum chunk) and ``out`` is
    private flat uint8 memory of their span. Each item: the copy's verified
    bytes (a view of ``out`` at its place in the span), or None where it
    failed (:meth:`fetch` of it alone then says why)."""

  def check(self, plan: StepPlan, copy: Copy) -> None:
    """Raises :class:`BadCopy` unless ``copy`` matches its checksum (read in
    place: for copies this process holds but may not use)."""

  def place_leaf(self, assembler: Assembler, leaf: int, sharding: jax.sharding.Sharding,
                 wanted: Sequence[tuple[jax.Device, Index]]) -> jax.Array | None:
    """A fast path that builds a whole leaf at once, or None (the general
    path cuts it shard by shard). Marks the copies it rejects in
    ``assembler.bad``."""



class Assembler:
  """Builds restored leaves from one step's plan; caches verified pieces."""

  def __init__(self, plan: StepPlan, source: PieceSource, *,
               arenas: ArenaCache | None = None):
    self.plan = plan
    self.source = source
    self.arenas = arenas  # where prefetched pieces go (None: fresh memory)
    self._verified: dict[tuple[int, Index], Stored] = {}
    self.bytes_read = 0
    self.bytes_rebuilt = 0  # pieces rebuilt from parity
    self.bad: dict[CopyKey, BadCopy] = {}  # copies found bad (the manager notes them)
    self.lost_stores: set[int] = set()  # stores that raised on read (BadCopy.lost_store)

  def _first_good(self, key: tuple[int, Index], device: jax.Device | None,
                  out: np.ndarray | None = None
                  ) -> tuple[Stored | None, list[BadCopy], int]:
    """(the first copy of ``key`` held here that verifies, or None; the bad
    copies met on the way; its bytes). Changes nothing: threads may run it."""
    found: list[BadCopy] = []
    lost = set(self.lost_stores)
    for copy in self.plan.copies[key]:
      if (not self.source.holds(copy.store) or copy.store in lost
          or (self.bad and copy.key(self.plan.step) in self.bad)):
        continue
      try:
        got = self.source.fetch(self.plan, copy, device, out=out)
        return got, found, copy.record.nbytes
      except BadCopy as e:
        found.append(e)
        if e.lost_store is not None:  # none of its copies is read again
          lost.add(e.lost_store)
    return None, found, 0

  def _keep(self, key: tuple[int, Index], got: Stored | None, found: list[BadCopy],
            nbytes: int) -> None:
    for e in found:
      self.mark_bad(e)
    if got is not None:
      self._verified[key] = got
      self.bytes_read += nbytes

  def prefetch(self, pool: futures.Executor, workers: int = 2,
               keys: Iterable[tuple[int, Index]] | None = None) -> None:
    """Fetches and verifies every piece of the plan held here (of ``keys``,
    where given), in parallel on ``pool`` of ``workers`` threads (host
    copies then cost one pass over memory on every core, not on the
    caller's thread alone). A piece with no good copy is left to
    :meth:`piece`, which raises."""
    held = {s for s in self.plan.stores if self.source.holds(s)}
    items = self._items(self.plan.copies if keys is None else keys, held)
    if not items:  # (nothing held here: no arena taken, the kept one stays)
      return
    (tasks,) = self._tasks([items], workers)
    fetch = self._fetch_task
    # Tasks of small pieces one at a time run here, while the pool copies
    # the big ones and the runs (see ``_checksum.SMALL_BYTES``).
    def small(task: list[tuple[Item, np.ndarray]]) -> bool:
      return (all(not isinstance(item, list) for item, _ in task)
              and sum(out.nbytes for _, out in task) < SMALL_BYTES * len(task))
    pending = pool.map(fetch, [t for t in tasks if not small(t)])
    done = [fetch(t) for t in tasks if small(t)]
    for got in [*done, *pending]:
      for key, one in got:
        self._keep(key, *one)

  def _tasks(self, groups: Sequence[Sequence[tuple[Item, int]]], workers: int
             ) -> list[list[list[tuple[Item, np.ndarray]]]]:
    """Each group's items as fetch tasks, each item with its place in one
    arena for every piece (the restored arrays adopt parts of it), reused
    from the last restore when nothing uses it any more (._arena); fresh,
    it is first touched by the copy that fills it, on every core (one
    buffer a piece would pay an allocation and fresh pages for each). A
    task is a share of its group: two a worker, at least
    PREFETCH_TASK_BYTES."""
    need = sum(align(n) for items in groups for _, n in items)
    arena = (np.empty(0, np.uint8) if not need else  # (nothing here: the kept arena stays)
             self.arenas.take(need) if self.arenas is not None else host_arena(need))
    at = 0
    out = []
    for items in groups:
      placed = []
      for item, n in items:
        placed.append((item, arena[at:at + n]))
        at += align(n)
      size = sum(n for _, n in items)
      out.append(filled(placed, [n for _, n in items],
                        max(PREFETCH_TASK_BYTES, -(-size // (2 * max(workers, 1))))))
    return out

  def _fetch_task(self, task: Sequence[tuple[Item, np.ndarray]]
                  ) -> list[tuple[tuple[int, Index], tuple[Stored | None, list[BadCopy], int]]]:
    return [got for item, out in task for got in self._fetch_item(item, out)]

  def read_and_place(self, pool: futures.Executor, workers: int,
                     target_specs: Sequence[LeafSpec], targets: Sequence[Any],
                     timings: dict[str, float], *, place: Sequence[bool] | None = None,
                     extra: Iterable[tuple[int, Index]] = ()) -> list[Any]:
    """:meth:`prefetch`, then :meth:`tree`, overlapped: the targets' leaves
    in groups of about an eighth of their bytes, in order; while one
    group's leaves are put on their devices, the pool reads and verifies
    the next group's pieces (a host-to-device copy and the verifying copy
    each take the whole restore's time otherwise, one after the other).
    One arena for every piece, as :meth:`prefetch` takes. ``place[i]``
    False: target ``i``'s pieces are read, its leaf left None (built
    later, e.g. from pieces other hosts send); with ``place``, a leaf
    whose build raises is left None too, not raised. ``extra``: more pieces to read, last.
    ``timings`` gets ``read_verify`` (waiting for pieces) and
    ``read_place``."""
    by_path = {s.path: i for i, s in enumerate(self.plan.specs)}
    held = {s for s in self.plan.stores if self.source.holds(s)}
    keys = [self._reads(by_path[t.path], t, tgt) for t, tgt in zip(target_specs, targets,
                                                                    strict=True)]
    listed = {k for ks in keys for k in ks}
    keys.append([k for k in dict.fromkeys(extra) if k not in listed and k in self.plan.copies])
    per = [sum(self.plan.copies[k][0].record.nbytes for k in ks if k not in self._verified)
           for ks in keys]
    groups: list[list[int]] = [[]]  # targets (-1: extra), about an eighth of the bytes each
    sizes, most = [0], max(sum(per) // 8, GROUP_BYTES)
    for i, n in enumerate(per):
      if sizes[-1] and sizes[-1] + n > most:
        groups.append([])
        sizes.append(0)
      groups[-1].append(i if i < len(targets) else -1)
      sizes[-1] += n
    # (a group's pieces as one list: its small ones are read in runs across leaves)
    tasks = self._tasks([self._items([k for i in group for k in keys[i]], held)
                         for group in groups], workers)
    fetch = self._fetch_task
    out: list[Any] = [None] * len(targets)
    pending = [pool.submit(fetch, task) for task in tasks[0]]
    later: list[futures.Future[Any]] = []
    try:
      for g, group in enumerate(groups):
        t = time.perf_counter()
        later = ([pool.submit(fetch, task) for task in tasks[g + 1]]
                 if g + 1 < len(groups) else [])
        for f in pending:
          for key, one in f.result():
            self._keep(key, *one)
        pending, later = later, []
        timings["read_verify"] = timings.get("read_verify", 0.0) + time.perf_counter() - t
        t = time.perf_counter()
        for i in group:
          if i < 0 or (place is not None and not place[i]):
            continue
          try:
            out[i] = self.leaf(by_path[target_specs[i].path], target_specs[i], targets[i])
          except Exception:
            if place is None:
              raise
            # (left None: the caller builds it again where a failure is agreed on;
            # several hosts must all reach their collectives first)
        timings["read_place"] = timings.get("read_place", 0.0) + time.perf_counter() - t
    finally:
      futures.wait(pending + later)  # (a piece that raised: no task runs on after it)
    return out

  def _reads(self, leaf: int, target_spec: LeafSpec, target: Any) -> list[tuple[int, Index]]:
    """The pieces a restore of ``leaf`` onto ``target`` reads here: those of
    its shards here (:meth:`local_pieces`), or every piece for a host target."""
    spec = self.plan.specs[leaf]
    if spec.kind is LeafKind.SCALAR:
      return []
    copies = self.plan.copies
    return [k for k in (self.local_pieces(leaf, target_spec, target)
                        or [(leaf, idx) for idx in self.plan.leaf_copies(leaf)]) if k in copies]

  def _items(self, keys: Iterable[tuple[int, Index]], held: set[int]
             ) -> list[tuple[Item, int]]:
    """(what one fetch gets, its bytes) for the pieces of ``keys`` not yet
    verified with a copy held here: a piece alone (its key), big ones
    first, or a run of small pieces back to back in one slot (where
    ``source.runs``), which reads each piece's first usable copy."""
    plan_copies, step, bad, verified = self.plan.copies, self.plan.step, self.bad, self._verified
    small = min(SMALL_BYTES, self.plan.chunk_bytes + 1) if self.source.runs else 0
    items: list[tuple[Item, int]] = []
    by_slot: dict[tuple[int, int], list[tuple[int, tuple[int, Index], Copy]]] = {}
    for k in keys:  # (per piece: a loop and a few lookups; thousands of pieces)
      if k in verified:
        continue
      copies = plan_copies[k]
      for c in copies:
        if c.store in held and not (bad and c.key(step) in bad):
          break
      else:
        if any(c.store in held for c in copies):  # only bad ones: fetch says so
          items.append((k, copies[0].record.nbytes))
        continue
      n = c.record.nbytes
      if n < small:
        by_slot.setdefault((c.store, c.slot), []).append((c.record.offset, k, c))
      else:
        items.append((k, n))
    items.sort(key=lambda it: it[1], reverse=True)
    for pieces in by_slot.values():
      pieces.sort(key=lambda p: p[0])
      run: list[tuple[tuple[int, Index], Copy]] = []
      start = end = 0
      for off, k, c in pieces:
        if run and (off != align(end) or off + c.record.nbytes - start > RUN_BYTES):
          items.append((run, end - start))
          run = []
        if not run:
          start = off
        run.append((k, c))
        end = off + c.record.nbytes
      if run:
        items.append((run, end - start))
    return items

  def _fetch_item(self, item: Item, out: np.ndarray
                  ) -> list[tuple[tuple[int, Index], tuple[Stored | None, list[BadCopy], int]]]:
    """(key, :meth:`_first_good` of it) of each piece of ``item``, into ``out``."""
    if not isinstance(item, list):
      return [(item, self._first_good(item, None, out))]
    copies = [c for _, c in item]
    got = self.source.fetch_run(self.plan, copies, out)
    start = copies[0].record.offset
    return [(k, (g, [], c.record.nbytes) if g is not None else
             self._first_good(k, None, out[c.record.offset - start:
                                           c.record.offset - start + c.record.nbytes]))
            for (k, c), g in zip(item, got, strict=True)]

  def verified(self, leaf: int, index: Index) -> bool:
    """True once a copy of piece (leaf, index) was verified and kept."""
    return (leaf, index) in self._verified

  def piece(self, leaf: int, index: Index, device: jax.Device | None = None) -> Stored:
    """The verified piece (leaf, index): on ``device`` for a jax.Array copy,
    else as stored. Tries the copies this process holds in plan order."""
    key = (leaf, index)
    got = self._verified.get(key)
    if got is None:
      got, found, nbytes = self._first_good(key, device)
      self._keep(key, got, found, nbytes)
      if got is None:
        copies = [c for c in self.plan.copies[key] if self.source.holds(c.store)]
        bads = [self.bad[k] for c in copies if (k := c.key(self.plan.step)) in self.bad]
        if not bads:
          raise ValueError(f"no copy of piece {index} of leaf {leaf} is held here")
        raise bads[-1].bare()
    if device is None or not isinstance(got, jax.Array) or device in got.devices():
      return got
    return jax.device_put(got, device)

  def check(self, leaf: int, index: Index) -> None:
    """Verifies every copy of piece (leaf, index) this process holds, in
    place, without keeping it; the bad ones go to ``self.bad``."""
    for copy in self.plan.copies[(leaf, index)]:
      self.check_copy(copy)

  def check_copy(self, copy: Copy) -> None:
    """Verifies one copy in place if this process holds it (a bad one goes
    to ``self.bad``)."""
    key = copy.key(self.plan.step)
    if self.source.holds(copy.store) and key not in self.bad:
      try:
        self.source.check(self.plan, copy)
      except BadCopy as e:
        self.mark_bad(e)

  def mark_bad(self, e: BadCopy) -> None:
    """Records a bad copy (and its store, if the store itself is lost)."""
    self.bad[e.key] = e.bare()
    if e.lost_store is not None:
      self.lost_stores.add(e.lost_store)

  def block(self, copy: Copy) -> np.ndarray:
    """A parity block's verified bytes (flat uint8); raises :class:`BadCopy`."""
    try:
      got = self.source.fetch(self.plan, copy, None)
    except BadCopy as e:
      self.mark_bad(e)
      raise
    self.bytes_read += copy.record.nbytes
    return np.asarray(got).reshape(-1).view(np.uint8)

  def adopt(self, leaf: int, index: Index, data: np.ndarray, *, rebuilt: bool = False) -> None:
    """A piece this process got from elsewhere (``data``: its flat bytes,
    private): moved from the host that holds it, or rebuilt from parity."""
    spec = self.plan.specs[leaf]
    if (leaf, index) not in self._verified:
      self._verified[(leaf, index)] = data.view(spec.np_dtype).reshape(shape_of(index))
      if rebuilt:
        self.bytes_rebuilt += data.nbytes

  def region(self, leaf: int, index: Index, device: jax.Device | None) -> tuple[Stored, bool]:
    """The global region ``index`` of ``leaf``, cut from the pieces that
    overlap it: a numpy array where the pieces are on the host, else a
    jax.Array on ``device``."""
    pieces = self.plan.leaf_copies(leaf)
    if index in pieces:
      return self.piece(leaf, index, device), False
    spec = self.plan.specs[leaf]
    parts = [(dst, self.piece(leaf, pidx, device), src)
             for pidx, dst, src in overlaps(pieces, index)]
    if device is None or not any(isinstance(p, jax.Array) for _, p, _ in parts):
      out = aligned_empty(spec.np_dtype.itemsize * volume(index)).view(
          spec.np_dtype).reshape(shape_of(index))
      for dst, part, src in parts:
        out[dst] = np.asarray(part)[src]
      return out, True
    dev = jnp.zeros(shape_of(index), spec.np_dtype, device=device)
    for dst, part, src in parts:  # cut and placed on ``device``
      dev = dev.at[dst].set(jax.device_put(part[src], device))
    return dev, True

  def local_pieces(self, leaf: int, target_spec: LeafSpec, target: Any
                   ) -> list[tuple[int, Index]]:
    """The pieces of ``leaf`` that :meth:`leaf` reads for this process's
    shards of ``target`` (none for a scalar or a numpy target)."""
    spec = self.plan.specs[leaf]
    if spec.kind is LeafKind.SCALAR or wants_numpy(spec, target_spec, target):
      return []
    pieces = self.plan.leaf_copies(leaf)
    out: dict[tuple[int, Index], None] = {}
    for _, idx in wanted_shards(target_sharding(target), tuple(spec.shape)):
      if idx in pieces:
        out[(leaf, idx)] = None
      else:
        out.update(((leaf, p), None) for p, _, _ in overlaps(pieces, idx))
    return list(out)

  def leaf(self, leaf: int, target_spec: LeafSpec, target: Any) -> Any:
    spec = self.plan.specs[leaf]
    if spec.kind is LeafKind.SCALAR:
      return self.plan.scalars.get(leaf)
    placed = self._placed(leaf, spec, target_spec, target)
    if placed is not None:
      return placed
    return build_leaf(spec, target_spec, target, lambda idx, dev: self.region(leaf, idx, dev),
                      fast=lambda sharding, wanted: self.source.place_leaf(
                          self, leaf, sharding, wanted))

  def _placed(self, leaf: int, spec: LeafSpec, target_spec: LeafSpec, target: Any
              ) -> jax.Array | None:
    """The leaf in one batched put where every shard it wants is a verified
    host piece (the usual case after :meth:`prefetch`: no region is cut),
    else None (:func:`build_leaf` then)."""
    if wants_numpy(spec, target_spec, target):
      return None
    sharding = target_sharding(target)
    if sharding.memory_kind not in (None, "device"):
      return None
    wanted = wanted_shards(sharding, tuple(spec.shape))
    got = self._verified
    bufs = [got.get((leaf, idx)) for _, idx in wanted]
    if not all(type(b) is np.ndarray for b in bufs):
      return None
    host = cast(list[np.ndarray], bufs)  # (checked above)
    arr = place_host(spec, sharding, wanted, host)  # (they are private: adopted)
    return jax.random.wrap_key_data(arr, impl=spec.key_impl) if spec.kind is LeafKind.KEY else arr

  def tree(self, target_specs: Sequence[LeafSpec], targets: Sequence[Any]) -> list[Any]:
    by_path = {s.path: i for i, s in enumerate(self.plan.specs)}
    return [self.leaf(by_path[t.path], t, tgt)
            for t, tgt in zip(target_specs, targets, strict=True)]
