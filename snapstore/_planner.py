"""Inventories -> the freshest recoverable step, with every copy of each piece.

One deterministic function of the manifests that the surviving hosts actually
hold (never of a "latest" pointer written earlier): every host that runs it on
the same inventory reaches the same decision.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import msgpack
import numpy as np

from . import errors
from ._index import Index, align, full, nbytes as index_nbytes, tiles, volume
from ._manifest import PARITY_LEAF, Manifest, ParityRecord, PieceRecord
from ._parity import PARITY_PATH, StripeMembers
from ._tree import LeafKind, LeafSpec, spec_row

logger = logging.getLogger(__name__)

# (store, step, leaf, index): one stored copy that failed verification.
CopyKey = tuple[int, int, int, Index]

#: The store of a piece that no store holds but a parity rebuild will produce.
REBUILT = -1


class Copy(NamedTuple):
  """One stored copy of one piece: which store (a process's host store, or
  one failure domain's store on a single controller), which slot, where."""

  store: int
  slot: int
  record: PieceRecord
  slot_bytes: int

  def key(self, step: int) -> CopyKey:
    return (self.store, step, self.record.leaf, self.record.index)


@dataclasses.dataclass(frozen=True)
class Rebuild:
  """One stripe's lost member, rebuilt from the parity blocks ``blocks``
  (member -> its copy) and the other members' pieces (:mod:`._parity`)."""

  stripe: int
  lost: int
  layout: StripeMembers
  blocks: Mapping[int, Copy]


@dataclasses.dataclass(frozen=True)
class StepPlan:
  step: int
  incarnation: int
  specs: tuple[LeafSpec, ...]
  tree_digest: str
  chunk_bytes: int
  copies: Mapping[tuple[int, Index], tuple[Copy, ...]]  # preference order
  scalars: Mapping[int, Any]
  extra: Any
  stores: tuple[int, ...]
  rebuilds: tuple[Rebuild, ...] = ()

  def path_and_dtype(self, record: PieceRecord) -> tuple[str, np.dtype]:
    """What a stored copy's checksum is keyed by, and its dtype."""
    if record.leaf == PARITY_LEAF:
      return PARITY_PATH, np.dtype(np.uint8)
    spec = self.specs[record.leaf]
    return spec.path, spec.np_dtype

  def leaf_copies(self, leaf: int) -> dict[Index, tuple[Copy, ...]]:
    return self._by_leaf.get(leaf, {})

  @functools.cached_property
  def _by_leaf(self) -> dict[int, dict[Index, tuple[Copy, ...]]]:
    out: dict[int, dict[Index, tuple[Copy, ...]]] = {}
    for (lf, idx), c in self.copies.items():
      out.setdefault(lf, {})[idx] = c
    return out


def fence(manifests: Iterable[Manifest]) -> list[Manifest]:
  """Drops manifests that a newer incarnation superseded.

  A manifest of incarnation i at step t is stale if any manifest of a newer
  incarnation exists at a step <= t: the newer incarnation restored from an
  earlier step and recomputed from there.
  """
  ms = list(manifests)
  newest_start: dict[int, int] = {}
  for m in ms:
    newest_start[m.incarnation] = min(newest_start.get(m.incarnation, m.step), m.step)
  out = []
  for m in ms:
    later = [s for inc, s in newest_start.items() if inc > m.incarnation and s <= m.step]
    if later:
      logger.info("host %d step %d: incarnation %d superseded by a newer one",
                  m.store, m.step, m.incarnation)
      continue
    out.append(m)
  return out


def shared_content(m: Manifest) -> bytes:
  """What every store's manifest of one step must agree on, as bytes
  (``==`` on values would call NaN unequal to itself, and True equal to
  1.0): the leaves, scalars, ``extra``, chunk size, tree digest and saved
  job size. The one rule for both restores: :func:`plan_step` compares it
  over the gathered manifests; the sparse restore agrees on its digest and
  sends it as the header a host without the step receives
  (:mod:`snapstore._multihost.agree`, :mod:`snapstore._multihost.sparse`)."""
  return msgpack.packb([[spec_row(s) for s in m.leaves], sorted(m.scalars.items()), m.extra,
                        m.chunk_bytes, m.tree_digest, m.num_hosts], use_bin_type=True)


def plan_step(step: int, manifests: Sequence[Manifest], *,
              bad: Collection[CopyKey] = (), prefer_store: int = 0,
              reasons: list[str] | None = None) -> StepPlan | None:
  """A plan for ``step`` if every piece of every leaf has a usable copy
  (else None, with why appended to ``reasons``)."""
  ms = [m for m in manifests if m.step == step]
  if not ms:
    return None
  inc = max(m.incarnation for m in ms)
  ms = [m for m in ms if m.incarnation == inc]
  digests = collections.Counter(m.tree_digest for m in ms)
  if len(digests) > 1:
    logger.warning("step %d: hosts disagree on the tree digest (%s); skipping",
                   step, dict(digests))
    if reasons is not None:
      reasons.append(f"step {step}: hosts disagree on the tree structure")
    return None
  ref = ms[0]
  if len({shared_content(m) for m in ms}) > 1:
    why = f"step {step}: hosts disagree on the leaves, scalars or extra"
    logger.warning(why)
    if reasons is not None:
      reasons.append(why)
    return None
  copies: dict[tuple[int, Index], list[Copy]] = collections.defaultdict(list)
  parity: dict[int, dict[int, list[tuple[Copy, ParityRecord]]]] = collections.defaultdict(dict)
  for m in sorted(ms, key=lambda m: (m.store != prefer_store, m.store)):
    # from the rows (offset, nbytes): no record made twice per piece
    slot_bytes = max([r[2] + r[3] for r in m.pieces.rows] +
                     [r.piece.offset + r.piece.nbytes for r in m.parity], default=0)
    for p in m.pieces:  # (thousands of pieces: a record and a copy each, named tuples)
      c = Copy(m.store, m.slot, p, slot_bytes)
      if not bad or c.key(step) not in bad:
        copies[(p.leaf, p.index)].append(c)
    for r in m.parity:
      c = Copy(m.store, m.slot, r.piece, slot_bytes)
      if c.key(step) not in bad:
        parity[r.stripe].setdefault(r.block, []).append((c, r))
  rebuilds = _rebuilds(step, ref.leaves, parity, copies, reasons)
  by_leaf: dict[int, list[Index]] = collections.defaultdict(list)
  for lf, idx in copies:
    by_leaf[lf].append(idx)
  for leaf, spec in enumerate(ref.leaves):
    if spec.kind is LeafKind.SCALAR:
      continue
    indices = by_leaf.get(leaf, [])
    if not tiles(indices, spec.shape):
      have = sum(volume(idx) for idx in indices)
      why = (f"step {step}: leaf {spec.path!r} has no complete set of surviving copies "
             f"(pieces cover {have} of {volume(full(spec.shape))} elements, "
             "or overlap)")
      logger.info(why)
      if reasons is not None:
        reasons.append(why)
      return None
  return StepPlan(step=step, incarnation=inc, specs=ref.leaves,
                  tree_digest=ref.tree_digest, chunk_bytes=ref.chunk_bytes,
                  copies={k: tuple(v) for k, v in copies.items()},
                  scalars=dict(ref.scalars), extra=ref.extra,
                  stores=tuple(sorted({m.store for m in ms})), rebuilds=tuple(rebuilds))


def _rebuilds(step: int, leaves: Sequence[LeafSpec],
              parity: Mapping[int, Mapping[int, list[tuple[Copy, ParityRecord]]]],
              copies: dict[tuple[int, Index], list[Copy]],
              reasons: list[str] | None) -> list[Rebuild]:
  """The stripes with one member's pieces gone and every other member's
  pieces and parity block usable; their lost pieces get a :data:`REBUILT`
  copy in ``copies``. Why a stripe cannot be rebuilt goes to ``reasons``
  (before the leaf that then fails: it explains the step's rejection better)."""
  out = []
  for stripe in sorted(parity):
    held = parity[stripe]
    ref = next(iter(held.values()))[0][1]
    if any(len(v) > 1 or (v[0][1].members, v[0][1].layout, v[0][1].length)
           != (ref.members, ref.layout, ref.length) for v in held.values()):
      # (two stores claiming one block: every host must decide alike)
      why = f"step {step}: the parity blocks of stripe {stripe} disagree on its layout"
    else:
      n = len(ref.members)
      real = lambda key: any(c.store != REBUILT for c in copies.get(key, ()))  # noqa: E731
      lost = [m for m in range(n) if not all(real(key) for key in ref.layout[m])]
      if not lost:
        continue
      x = lost[0]
      blocks = {j: v[0][0] for j, v in held.items()}
      gone = [j for j in range(n) if j != x and j not in blocks]
      group = f"group of hosts {list(ref.members)} (stripe {stripe})"
      if len(lost) > 1:
        why = (f"step {step}: the {group} lost hosts {[ref.members[m] for m in lost]}; "
               "parity rebuilds one lost host of a group")
      elif gone:
        why = (f"step {step}: the {group} lost host {ref.members[x]} and the parity "
               f"blocks of hosts {[ref.members[j] for j in gone]} are unusable")
      else:
        out.append(Rebuild(stripe, x, StripeMembers(ref.members, ref.layout, ref.length),
                           {j: blocks[j] for j in range(n) if j != x}))
        for leaf, idx in ref.layout[x]:
          if not real((leaf, idx)) and not copies.get((leaf, idx)):
            rec = PieceRecord(leaf, idx, 0, index_nbytes(idx, leaves[leaf].np_dtype.itemsize),
                              (), ref.members[x])
            copies[(leaf, idx)].append(Copy(REBUILT, -1, rec, 0))
        continue
    logger.info(why)
    if reasons is not None:
      reasons.append(why)
  return out


def choose(manifests: Iterable[Manifest], *, step: int | None = None,
           bad: Collection[CopyKey] = (), prefer_store: int = 0,
           reasons: list[str] | None = None) -> StepPlan | None:
  """The freshest recoverable step (or exactly ``step``); None if none is.
  Why fresher steps were rejected is appended to ``reasons``."""
  ms = fence(manifests)
  steps = sorted({m.step for m in ms}, reverse=True)
  if step is not None:
    steps = [s for s in steps if s == step]
  for s in steps:
    plan = plan_step(s, ms, bad=bad, prefer_store=prefer_store, reasons=reasons)
    if plan is not None:
      return plan
  return None


def own_bytes(manifests: Sequence[Manifest]) -> int:
  """The bytes a restore of the newest step in ``manifests`` (one process's
  stores) copies out of them: each piece those stores own, once, page
  aligned (what :meth:`._assemble.Assembler.prefetch` takes when the
  target is laid out as saved)."""
  valid = fence(manifests)
  if not valid:
    return 0
  newest = max(m.step for m in valid)
  own: dict[tuple[int, Index], int] = {}
  for m in valid:
    if m.step == newest:
      # (the rows: no record object made per piece)
      own.update(((r[0], r[1]), align(r[3])) for r in m.pieces.rows if r[5] == m.store)
  return sum(own.values())


# ---------------------------------------------------------------- retention
def watermark_of(manifests: Sequence[Manifest]) -> int | None:
  """The job's retention watermark as this store knows it: what its newest
  manifest names (:mod:`._watermark`), if this store holds that step;
  else None."""
  valid = fence(manifests)
  if not valid:
    return None
  newest = max(valid, key=lambda m: (m.step, m.incarnation))
  w = newest.watermark
  return w if w >= 0 and any(m.step == w for m in valid) else None


def retention(manifests: Sequence[Manifest], keep: int,
              carries: Callable[[int], bool] | None = None) -> list[tuple[Manifest, str]]:
  """The manifests of one store to delete, and why: those a newer
  incarnation superseded, then all but ``keep`` valid ones (the newest, and
  the newest of the rest, those whose step ``carries`` replicas, or parity,
  first) and the job's watermark (:func:`watermark_of`: the newest step
  every store held when this store last saved, kept until a newer one is
  agreed, past ``keep`` if need be). With replicas on every other snapshot,
  the newest that carries them can be incomplete for the job (a peer died
  during its transfer) although this store's copy committed; the carrier
  before it is then the newest step whose every piece survives. A pure
  function of the manifests; the store applies it."""
  valid = sorted(fence(manifests), key=lambda m: m.step)
  out = [(m, "superseded by a newer incarnation") for m in manifests if m not in valid]
  if len(valid) > keep:
    mark = watermark_of(valid)
    rest = sorted(valid[:-1], key=lambda m: (carries is not None and carries(m.step), m.step),
                  reverse=True)
    kept = ({id(valid[-1])} | {id(m) for m in rest[:keep - 1]}
            | {id(m) for m in valid if m.step == mark})
    out += [(m, f"retention keeps {keep} and the job's watermark (step {mark})")
            for m in valid if id(m) not in kept]
  return out


def slot_count(snapshot_bytes: int, *, keep: int, budget_bytes: int | None,
               where: str) -> int:
  """How many snapshots of ``snapshot_bytes`` one store may hold at once:
  ``min(keep + 1, budget // size)``; one is written while the newest
  complete ones stay readable. The job's watermark (:mod:`._watermark`)
  takes no slot of its own: it is one of the newest while saves succeed,
  and while a newer step is not complete on every store it is kept in
  place of the oldest newer one (:func:`evictable`). Raises
  BudgetExceededError if the budget cannot hold two."""
  want = keep + 1
  if budget_bytes is None:
    return want
  fit = budget_bytes // max(snapshot_bytes, 1)
  if fit < 2:
    raise errors.BudgetExceededError(
        f"a snapshot of this state takes {snapshot_bytes} bytes in {where}; the "
        f"budget of {budget_bytes} bytes must hold two (the newest complete one and "
        f"the one being written): raise budget_bytes to at least "
        f"{2 * snapshot_bytes} or shrink the state.")
  return min(want, fit)


def evictable(valid: Sequence[Manifest], watermark: int | None) -> list[Manifest]:
  """The valid manifests of one store that a new snapshot may evict, oldest
  first: all but the job's ``watermark`` step (None: all but the newest)."""
  by_step = sorted(valid, key=lambda m: m.step)
  if watermark is None or not any(m.step == watermark for m in by_step):
    return by_step[:-1]
  return [m for m in by_step if m.step != watermark]


def free_slot(manifests: Sequence[Manifest], num_slots: int,
              watermark: int | None = None) -> tuple[int, Manifest | None]:
  """A slot that no valid manifest of one store uses, or else the slot of the
  oldest valid manifest :func:`evictable` allows, with that manifest (the
  caller evicts it first)."""
  valid = fence(manifests)
  used = {m.slot for m in valid}
  for i in range(num_slots):
    if i not in used:
      return i, None
  oldest = evictable(valid, watermark)[0]
  return oldest.slot, oldest
