"""Who takes part in a restore: this process alone, or every process of a
multi-controller job (``jax.distributed``).

The manager picks one at construction and never asks again. :class:`Solo`
reads every copy it needs from the stores it holds. :class:`Distributed`
exchanges the inventories, agrees on the bad copies, and moves the pieces a
host lacks with JAX (``snapstore._multihost.exchange``); every method of it is collective: all
processes call it in the same order.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from .. import _devices, _faults, _parity
from .._arena import ArenaCache
from .._assemble import Assembler, BadCopy, what_copy
from .._index import Index, align
from .._manifest import Manifest
from .._planner import REBUILT, Copy, CopyKey, StepPlan
from .._tree import LeafKind, LeafSpec, batches, check_compatible, target_sharding, wants_numpy
from . import agree, exchange, moves, sparse
from .collective import Collective, JaxCollective


def _rebuild(assembler: Assembler, piece: Callable[[int, Index], np.ndarray | None],
             block: Callable[[Copy], np.ndarray | None],
             total: Callable[[np.ndarray], np.ndarray]) -> int:
  """Rebuilds the plan's lost pieces from parity (:mod:`._parity`): every
  stripe's share from what this process holds (``piece``, ``block``: flat
  bytes or None), summed by ``total``; the pieces go to the assembler.
  Returns the bytes summed."""
  plan = assembler.plan
  if not plan.rebuilds:
    return 0
  def itemsize(leaf: int) -> int:
    return int(plan.specs[leaf].np_dtype.itemsize)
  def blocks_of(rb: Any) -> Callable[[int], np.ndarray | None]:
    return lambda j: block(rb.blocks[j])
  shares = [_parity.contribution(rb.layout, rb.lost, itemsize, piece, blocks_of(rb))
            for rb in plan.rebuilds]
  flat = total(np.concatenate(shares))
  at = 0
  for rb, share in zip(plan.rebuilds, shares, strict=True):
    buf = np.array(flat[at:at + share.size])  # private: the leaves adopt it
    at += share.size
    for leaf, idx, raw in _parity.split(rb.layout, rb.lost, buf, itemsize):
      if all(c.store == REBUILT for c in plan.copies.get((leaf, idx), ())):
        assembler.adopt(leaf, idx, raw, rebuilt=True)
  return flat.nbytes


def _flat(x: Any) -> np.ndarray:
  return np.ascontiguousarray(np.asarray(x)).reshape(-1).view(np.uint8)


@dataclasses.dataclass(frozen=True)
class Assembled:
  """One attempt at a step: the leaves (None if a copy it needed was bad),
  the bad copies found (why, per copy), the bytes moved between hosts, and
  seconds per part of ``read`` (``read_verify``: copies read and checked;
  ``read_agree``: the hosts agreeing on bad copies; ``read_place``: pieces
  moved or rebuilt and the leaves built)."""

  leaves: list[Any] | None
  bad: dict[CopyKey, str]
  bytes_exchanged: int = 0
  timings: dict[str, float] = dataclasses.field(default_factory=dict)


class Solo:
  """A single process (one host, or a single controller holding every
  failure domain's store)."""

  multi_host = False

  def gather_manifests(self, local: Sequence[Manifest], values: Sequence[int] = ()
                       ) -> tuple[list[Manifest], tuple[int, ...]]:
    return list(local), tuple(values)

  def agree_max(self, *values: int) -> tuple[int, ...]:
    return values

  def start_reduce_min(self, values: np.ndarray) -> Callable[[], np.ndarray]:
    """The element-wise minimum over the job's hosts (here, ``values``), to
    read by calling what it returns."""
    return lambda: values

  def assemble(self, assembler: Assembler, target_specs: Sequence[LeafSpec],
               targets: Sequence[Any]) -> Assembled:
    _faults.point("restore", assembler.plan.step)
    timings: dict[str, float] = {}
    t = time.perf_counter()
    try:
      # every store is here: the shares are the sum.
      _rebuild(assembler, lambda leaf, idx: _flat(assembler.piece(leaf, idx)),
               assembler.block, lambda words: words)
      source = assembler.source
      if source.prefetch_pool is not None and _puts_copy(targets):  # read while others are put
        timings["read_verify"] = time.perf_counter() - t  # (the rebuild; the waits add)
        leaves = assembler.read_and_place(source.prefetch_pool, source.prefetch_workers,
                                          target_specs, targets, timings)
      else:
        if source.prefetch_pool is not None:
          assembler.prefetch(source.prefetch_pool, source.prefetch_workers)
        timings["read_verify"] = time.perf_counter() - t
        t = time.perf_counter()
        leaves = assembler.tree(target_specs, targets)
        timings["read_place"] = time.perf_counter() - t
    except BadCopy as e:
      assembler.bad.setdefault(e.key, e.bare())
      leaves = None
    return Assembled(leaves, {k: str(e) for k, e in assembler.bad.items()}, timings=timings)


@dataclasses.dataclass
class Sparse:
  """What :meth:`Distributed.restore` found: the step restored (``plan``,
  ``leaves``), or nothing in RAM (``plan`` None), or that the full
  inventory exchange must decide (``fallback``: why); and, agreed by every
  host, the newest step any saw, the incarnation, and the persistent
  tier's newest commit every host sees."""

  newest: int
  incarnation: int
  persistent_latest: int
  plan: StepPlan | None = None
  leaves: list[Any] | None = None
  fallback: str | None = None
  adopt: bool = False  # a host holds stores to send home first (.hostfiles.adopt)
  notes: list[str] = dataclasses.field(default_factory=list)
  reasons: list[str] = dataclasses.field(default_factory=list)
  read: dict[str, int] = dataclasses.field(default_factory=dict)
  timings: dict[str, float] = dataclasses.field(default_factory=dict)


class Distributed:
  """Every process of a multi-controller job; ``host`` is this one."""

  multi_host = True

  def __init__(self, host: int, collective: Collective | None = None):
    self.host = host
    self.collective: Collective = collective or JaxCollective()

  def restore(self, source: Any, arenas: ArenaCache | None, local: Sequence[Manifest],
              target_specs: Sequence[LeafSpec], targets: Sequence[Any], *,
              step: int | None, values: tuple[int, int, int, int],
              persistent_steps: Sequence[int]) -> Sparse:
    """A restore whose metadata is each host's own (:mod:`snapstore._multihost.agree`,
    :mod:`snapstore._multihost.sparse`): the agreed maxima of ``values`` (newest step,
    incarnation, minus the persistent tier's newest commit, whether a host
    holds stores of other indices: then ``adopt`` and nothing more), then,
    candidate by candidate, needs, holders and point-to-point moves.
    Collective."""
    coll = self.collective
    t = time.perf_counter()
    newest, incarnation, neg_latest, adopting = agree.max64(coll, values)
    out = Sparse(newest, incarnation, -neg_latest)
    if adopting:  # a host holds stores of other indices: they go home first
      out.adopt = True
      return out
    latest = -neg_latest  # (agreed: each host's listing of the tier may differ)
    bad: set[CopyKey] = set()
    scan = time.perf_counter() - t
    for cand in agree.candidates(coll, local, step=step, reasons=out.reasons):
      out.timings["scan_exchange"] = scan + time.perf_counter() - t
      if cand.step < latest:
        break
      mine = sparse.manifests_at(local, cand)
      while True:
        t = time.perf_counter()
        got = sparse.plan(coll, mine, cand, target_specs, targets, bad=bad)
        out.timings["plan"] = out.timings.get("plan", 0.0) + time.perf_counter() - t
        if isinstance(got, sparse.Fallback):
          out.fallback = got.why
          return out
        if isinstance(got, sparse.Lost):
          out.reasons.append(got.why)
          break
        found = self._assemble_sparse(got, mine, source, arenas, target_specs, targets, bad, out)
        if not found:
          return out
        if set(found) <= bad:  # (nothing new to leave out: the step is lost here)
          out.reasons.append(f"step {cand.step}: its copies keep failing their checks")
          break
        for k in found:
          out.notes.append(f"step {cand.step}: checksum mismatch in "
                           f"{what_copy(k, got.header.leaves[k[2]].path)} held by host "
                           f"{k[0]}; using another copy or an older step")
        bad.update(found)  # the same step again, without the bad copies
      t = time.perf_counter()
    out.timings.setdefault("scan_exchange", scan + time.perf_counter() - t)
    return out

  def _assemble_sparse(self, got: sparse.Planned, mine: Manifest | None, source: Any,
                       arenas: ArenaCache | None, target_specs: Sequence[LeafSpec],
                       targets: Sequence[Any], bad: set[CopyKey], out: Sparse
                       ) -> list[CopyKey]:
    """Reads, moves and checks ``got``'s pieces and builds the leaves into
    ``out``; or returns the bad copies every host found (then nothing is
    built)."""
    coll = self.collective
    check_compatible(got.header.leaves, target_specs, step=got.candidate.step)
    t = time.perf_counter()
    plan = moves.local_plan(got, mine, self.host, bad)
    assembler = Assembler(plan, source, arenas=arenas)
    by_path = {s.path: i for i, s in enumerate(plan.specs)}
    sends = moves.reads(got, target_specs, self.host)
    early: list[Any] | None = None  # leaves put while later pieces are read
    overlap: dict[str, float] = {}
    if source.prefetch_pool is not None and _puts_copy(targets):
      early = assembler.read_and_place(
          source.prefetch_pool, source.prefetch_workers, target_specs, targets, overlap,
          place=_all_here(assembler, plan, target_specs, targets, self.host), extra=sends)
    else:
      reads = [k for spec, target in zip(target_specs, targets, strict=True)
               for k in (assembler.local_pieces(by_path[spec.path], spec, target)
                         or [(by_path[spec.path], idx)  # (host arrays: every piece)
                             for idx in plan.leaf_copies(by_path[spec.path])])
               if any(c.store == self.host for c in plan.copies.get(k, ()))]
      _read(assembler, reads + sends)
    placing = overlap.get("read_place", 0.0)
    out.timings["read_verify"] = time.perf_counter() - t - placing
    t = time.perf_counter()
    _faults.point("restore", got.candidate.step)
    received = moves.move(coll, got, assembler, target_specs, mine)
    found = moves.gather_bad(coll, assembler.bad)
    out.timings["read_agree"] = time.perf_counter() - t
    if found:
      return found
    t = time.perf_counter()
    try:
      leaves = (assembler.tree(target_specs, targets) if early is None else
                [x if x is not None else assembler.leaf(by_path[spec.path], spec, target)
                 for x, spec, target in zip(early, target_specs, targets, strict=True)])
    except BadCopy as e:  # (a copy read only now: agreed below, like the others)
      assembler.bad.setdefault(e.key, e.bare())
      leaves = None
    found = moves.gather_bad(coll, assembler.bad)
    out.timings["read_place"] = placing + time.perf_counter() - t
    if found:
      return found
    out.leaves = leaves
    sent, _ = moves.bytes_moved(got, self.host)
    out.plan = plan
    out.read = {"snapshot": assembler.bytes_read, "received": received, "sent": sent}
    if assembler.bytes_rebuilt:
      out.read["rebuilt"] = assembler.bytes_rebuilt
    return []

  def branch(self, local: Sequence[Manifest], restored: int, incarnation: int) -> int:
    """The incarnation saves continue as after restoring ``restored``
    (:func:`snapstore._multihost.agree.branch`). Collective."""
    return agree.branch(self.collective, local, restored, incarnation)

  def gather_manifests(self, local: Sequence[Manifest], values: Sequence[int] = ()
                       ) -> tuple[list[Manifest], tuple[int, ...]]:
    """Every process's manifests, and each of ``values``' maximum over the
    processes (one exchange)."""
    return exchange.gather_manifests(local, values)

  def agree_max(self, *values: int) -> tuple[int, ...]:
    """The maximum of each value over every process."""
    return agree.max64(self.collective, values)

  def start_reduce_min(self, values: np.ndarray) -> Callable[[], np.ndarray]:
    """The element-wise minimum of an int32 vector over every process,
    dispatched now (collective), read by calling what it returns."""
    return self.collective.start_reduce_min(values)

  def assemble(self, assembler: Assembler, target_specs: Sequence[LeafSpec],
               targets: Sequence[Any]) -> Assembled:
    """Verifies every copy this host will read, agrees with the others on
    the bad ones (a retry then plans without them), else builds the leaves.
    The copies it reads: the pieces its own shards are cut from, and those
    it is the agreed source of for another host (a lost host's shards) or
    for a parity rebuild; each is verified as it is copied out, once
    (:meth:`Assembler.prefetch`), before any of them moves. A copy no host
    reads (most replicas, while their owner lives) is not read at all: a
    retry reads it where it becomes the source."""
    plan = assembler.plan
    timings: dict[str, float] = {}
    t = time.perf_counter()
    split = self._split(assembler, target_specs, targets)
    reads = split.local + [k for k in split.needed
                           if exchange.chosen_source(plan.copies[k]).store == self.host]
    for rb in plan.rebuilds:
      reads.extend(k for j, pieces in enumerate(rb.layout.pieces) if j != rb.lost
                   for k in pieces
                   if exchange.chosen_source([c for c in plan.copies[k]
                                               if c.store != REBUILT]).store == self.host)
    _read(assembler, reads)
    for rb in plan.rebuilds:
      for c in rb.blocks.values():
        assembler.check_copy(c)
    timings["read_verify"] = time.perf_counter() - t
    t = time.perf_counter()
    bad = moves.gather_bad(self.collective, assembler.bad)
    timings["read_agree"] = time.perf_counter() - t
    if bad:
      return Assembled(None, {k: f"checksum mismatch in "
                                 f"{what_copy(k, plan.specs[k[2]].path)} held by host {k[0]}"
                              for k in bad}, timings=timings)
    t = time.perf_counter()
    rebuilt = _rebuild(assembler, self._my_piece(assembler),
                       lambda c: assembler.block(c) if c.store == self.host else None,
                       exchange.sum_words)
    leaves, moved = self._leaves(assembler, split, target_specs, targets)
    timings["read_place"] = time.perf_counter() - t
    return Assembled(leaves, {}, moved + rebuilt, timings=timings)

  def _my_piece(self, assembler: Assembler) -> Callable[[int, Index], np.ndarray | None]:
    """A rebuild's piece source: the pieces this host is the agreed source of."""
    copies = assembler.plan.copies

    def piece(leaf: int, idx: Index) -> np.ndarray | None:
      real = [c for c in copies[(leaf, idx)] if c.store != REBUILT]
      if exchange.chosen_source(real).store != self.host:
        return None
      return _flat(assembler.piece(leaf, idx))
    return piece

  @staticmethod
  def _split(assembler: Assembler, target_specs: Sequence[LeafSpec],
             targets: Sequence[Any]) -> _Split:
    """Which target leaves every host can cut from its own copies, and the
    pieces some host lacks (the same on every host: a function of the plan)."""
    plan = assembler.plan
    by_path = {s.path: i for i, s in enumerate(plan.specs)}
    mesh = jax.sharding.Mesh(np.array(_devices.devices()), ("all",))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    split = _Split([by_path[t.path] for t in target_specs])
    needed: dict[tuple[int, Index], None] = {}
    for pos, (tspec, target) in enumerate(zip(target_specs, targets, strict=True)):
      li = split.leaf[pos]
      spec = plan.specs[li]
      if spec.kind is LeafKind.SCALAR:
        split.here.append(pos)
        continue
      sharding = (replicated if wants_numpy(spec, tspec, target)
                  else target_sharding(target))
      missing = exchange.missing_pieces(plan, li, sharding, spec.shape)
      if missing:
        split.moved.append(pos)
        needed.update(((li, idx), None) for idx in missing)
      else:
        split.here.append(pos)
      split.local.extend(assembler.local_pieces(li, tspec, target))
    split.needed = list(needed)
    return split

  def _leaves(self, assembler: Assembler, split: _Split, target_specs: Sequence[LeafSpec],
              targets: Sequence[Any]) -> tuple[list[Any], int]:
    """Each leaf cut from the pieces its devices need: those a host lacks
    (a lost host's shards, held as replicas elsewhere) travel first, in
    batched JAX reductions of only those pieces, the same on every host."""
    plan = assembler.plan
    _faults.point("restore", plan.step)
    out: list[Any] = [None] * len(target_specs)
    for pos in split.here:  # (scalars among them)
      out[pos] = assembler.leaf(split.leaf[pos], target_specs[pos], targets[pos])
    keys = split.needed
    nbytes = [plan.copies[k][0].record.nbytes for k in keys]
    sizes = [align(n) for n in nbytes]
    groups = batches(sizes, exchange.BATCH_BYTES)
    width = max((sum(sizes[i] for i in g) for g in groups), default=0)
    exchanged = 0
    for group in groups:  # the same groups, in the same order, on every host.
      buf = np.zeros(width, np.uint8)
      offsets, off = [], 0
      for i in group:
        if exchange.contributes(plan.copies[keys[i]], self.host):
          buf[off: off + nbytes[i]] = _flat(assembler.piece(*keys[i]))
        offsets.append(off)
        off += sizes[i]
      total = exchange.sum_bytes(buf)
      exchanged += total.nbytes
      for i, at in zip(group, offsets, strict=True):
        assembler.adopt(*keys[i], np.array(total[at: at + nbytes[i]]))
    for pos in split.moved:
      out[pos] = assembler.leaf(split.leaf[pos], target_specs[pos], targets[pos])
    return out, exchanged


@dataclasses.dataclass
class _Split:
  """:meth:`Distributed._split`: each target leaf's position in the plan;
  the positions cut from every host's own copies, scalars too (``here``),
  and those with a piece to move (``moved``); the pieces this host's shards
  are cut from (``local``: those it holds are read here, the others
  arrive); the pieces some host lacks, in order."""

  leaf: list[int]
  here: list[int] = dataclasses.field(default_factory=list)
  moved: list[int] = dataclasses.field(default_factory=list)
  local: list[tuple[int, Index]] = dataclasses.field(default_factory=list)
  needed: list[tuple[int, Index]] = dataclasses.field(default_factory=list)


def _read(assembler: Assembler, keys: Sequence[tuple[int, Index]]) -> None:
  """Reads and verifies ``keys`` (each once) as they are copied out."""
  source = assembler.source
  if source.prefetch_pool is not None:
    assembler.prefetch(source.prefetch_pool, source.prefetch_workers, keys)
    return
  for leaf, idx in dict.fromkeys(keys):
    if not assembler.verified(leaf, idx):
      assembler.check(leaf, idx)


def _all_here(assembler: Assembler, plan: Any, target_specs: Sequence[LeafSpec],
              targets: Sequence[Any], host: int) -> list[bool]:
  """Per target, whether this host holds a copy of every piece its shards
  here read (so its leaf can be put before other hosts send theirs). Not a
  target in another memory kind (e.g. ``pinned_host``): moving it there
  from device memory may run a program over every process, which all must
  run in the same order, after the collectives."""
  by_path = {s.path: i for i, s in enumerate(plan.specs)}
  out = []
  for spec, target in zip(target_specs, targets, strict=True):
    keys = assembler.local_pieces(by_path[spec.path], spec, target)
    kind = (target_sharding(target).memory_kind
            if isinstance(target, jax.Array | jax.ShapeDtypeStruct) else None)
    out.append(bool(keys) and kind in (None, "device")
               and all(any(c.store == host for c in plan.copies.get(k, ())) for k in keys))
  return out


def _puts_copy(targets: Sequence[Any]) -> bool:
  """Whether putting host pieces on the targets' devices copies them (an
  accelerator), so that reading the next leaves meanwhile gains; a CPU
  device adopts them, and the prefetch's own split of small pieces
  between the pool and this thread is then faster."""
  for t in targets:
    if isinstance(t, jax.Array | jax.ShapeDtypeStruct):  # (host targets: numpy, scalars)
      devices: set[jax.Device] = target_sharding(t).device_set
      if any(d.platform != "cpu" for d in devices):
        return True
  return False


def for_job(host: int, num_hosts: int) -> Solo | Distributed:
  return Distributed(host) if num_hosts > 1 else Solo()
