"""The point-to-point moves of a sparse restore (:mod:`snapstore._multihost.sparse`).

What moves: each needed piece, from its holder to its needer; and, for a
parity rebuild (:mod:`snapstore._multihost.rebuild`), each surviving member's share, to the
stripe's lost member. The moves between one pair of hosts travel as one
buffer (several, past :data:`BATCH_BYTES`), in rounds where each host sends
at most one buffer and receives at most one: one
:meth:`snapstore._multihost.collective.Collective.permute` a round, the same rounds on every
host. A received piece is checked against its sender's checksums before it
is used; a rebuilt one is the sum of shares each read and checked where it
is held. This module also builds a host's own plan (its copies and what it
receives) and agrees on the bad copies found.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterable, Sequence
from typing import Any, NamedTuple

import msgpack
import numpy as np

from .._assemble import Assembler, BadCopy
from .._checksum import ChecksumKind, crc_matches, piece_key
from .._index import Index
from .._manifest import Manifest, PieceRecord
from .._planner import REBUILT, Copy, CopyKey, StepPlan
from .._tree import LeafSpec
from . import rebuild
from .collective import Collective, gather_blobs
from .sparse import Planned

#: The most bytes one point-to-point transfer carries (more: several rounds).
BATCH_BYTES = 64 << 20

PIECE, SHARE = "piece", "share"


class Item(NamedTuple):
  """One thing that moves: a piece (``ref``: its need) or a parity share
  (``ref``: its stripe's place in ``Planned.stripes``)."""

  src: int
  dst: int
  nbytes: int
  kind: str
  ref: int


@dataclasses.dataclass(frozen=True)
class Batch:
  """Items moving from ``src`` to ``dst`` in one buffer."""

  src: int
  dst: int
  items: tuple[Item, ...]
  nbytes: int


def items(planned: Planned) -> list[Item]:
  """Every move of ``planned``, in one order on every host."""
  out = [Item(planned.holder[i], need.needer, planned.nbytes[i], PIECE, i)
         for i, need in enumerate(planned.needs) if planned.holder[i] != REBUILT]
  for at, st in enumerate(planned.stripes):
    out.extend(Item(m, needer, st.layout.length, SHARE, at) for needer in st.needers
               for j, m in enumerate(st.layout.members) if j != st.lost)
  return out


def rounds(planned: Planned, batch_bytes: int = BATCH_BYTES) -> list[list[Batch]]:
  """The moves in rounds where each host sends at most one buffer and
  receives at most one (one permute a round); the same on every host."""
  pairs: dict[tuple[int, int], list[Item]] = {}
  for it in items(planned):
    pairs.setdefault((it.src, it.dst), []).append(it)
  pending: list[Batch] = []
  for (src, dst), its in sorted(pairs.items()):
    cur: list[Item] = []
    size = 0
    for it in its:
      if cur and size + it.nbytes > batch_bytes:
        pending.append(Batch(src, dst, tuple(cur), size))
        cur, size = [], 0
      cur.append(it)
      size += it.nbytes
    if cur:
      pending.append(Batch(src, dst, tuple(cur), size))
  out = []
  while pending:
    used_src: set[int] = set()
    used_dst: set[int] = set()
    this, rest = [], []
    for b in pending:
      if b.src in used_src or b.dst in used_dst:
        rest.append(b)
      else:
        used_src.add(b.src)
        used_dst.add(b.dst)
        this.append(b)
    out.append(this)
    pending = rest
  return out


def bytes_moved(planned: Planned, host: int) -> tuple[int, int]:
  """(bytes ``host`` sends, bytes it receives) in ``planned``."""
  its = items(planned)
  return (sum(it.nbytes for it in its if it.src == host),
          sum(it.nbytes for it in its if it.dst == host))


# ----------------------------------------------------------- this host
def local_plan(planned: Planned, manifest: Manifest | None, host: int,
               bad: Collection[CopyKey] = ()) -> StepPlan:
  """The step plan of this host alone: the copies its store holds (not
  bad), the pieces it receives (held by their senders), and those rebuilt
  for it from parity."""
  cand, header = planned.candidate, planned.header
  copies: dict[tuple[int, Index], list[Copy]] = {}
  if manifest is not None:
    for p in manifest.pieces:
      c = Copy(host, manifest.slot, p, slot_bytes(manifest))
      if not bad or c.key(cand.step) not in bad:
        copies.setdefault((p.leaf, p.index), []).append(c)
  for got in planned.incoming:
    rec = got.record
    copies.setdefault((rec.leaf, rec.index), []).append(Copy(got.holder, -1, rec, 0))
  for st in planned.stripes:
    if host in st.needers:
      for leaf, idx, _, nb in st.layout.offsets(st.lost, _itemsize(planned)):
        rec = PieceRecord(leaf, idx, 0, nb, (), host)
        copies.setdefault((leaf, idx), []).append(Copy(REBUILT, -1, rec, 0))
  return StepPlan(step=cand.step, incarnation=cand.incarnation, specs=header.leaves,
                  tree_digest=header.tree_digest, chunk_bytes=header.chunk_bytes,
                  copies={k: tuple(v) for k, v in copies.items()}, scalars=header.scalars,
                  extra=header.extra, stores=(host,))


def slot_bytes(manifest: Manifest) -> int:
  """The bytes of a manifest's slot its records reach."""
  return max([r[2] + r[3] for r in manifest.pieces.rows] +
             [r.piece.offset + r.piece.nbytes for r in manifest.parity], default=0)


def _itemsize(planned: Planned) -> Any:
  leaves = planned.header.leaves
  return lambda leaf: int(leaves[leaf].np_dtype.itemsize)


def reads(planned: Planned, target_specs: Sequence[LeafSpec], host: int
          ) -> list[tuple[int, Index]]:
  """The (leaf, region) of each piece this host reads to send: the pieces
  it sends, and its own pieces in the stripes it helps rebuild."""
  by_path = {s.path: i for i, s in enumerate(planned.header.leaves)}
  out = [(by_path[target_specs[planned.needs[i].pos].path], planned.needs[i].region)
         for i in planned.outgoing]
  for st in planned.stripes:
    if host in st.layout.members and st.layout.members.index(host) != st.lost:
      out.extend(st.layout.pieces[st.layout.members.index(host)])
  return out


def _block(manifest: Manifest | None, st: rebuild.Stripe, host: int) -> Copy | None:
  if manifest is None:
    return None
  mine = st.layout.members.index(host)
  for r in manifest.parity:
    if r.stripe == st.stripe and r.block == mine:
      return Copy(host, manifest.slot, r.piece, slot_bytes(manifest))
  return None


def move(coll: Collective, planned: Planned, assembler: Assembler,
         target_specs: Sequence[LeafSpec], manifest: Manifest | None) -> int:
  """Runs the moves: this host's outgoing pieces and shares go to their
  needers (its pieces verified as they were read, :meth:`Assembler.prefetch`);
  each piece received is checked against its sender's checksums, then
  adopted, or marked bad (``assembler.bad``); the shares of a stripe it
  lost are summed and its pieces adopted. Returns the bytes received."""
  plan = assembler.plan
  host = coll.host
  by_path = {s.path: i for i, s in enumerate(planned.header.leaves)}
  incoming = {got.need: got for got in planned.incoming}
  itemsize = _itemsize(planned)
  sums: dict[int, np.ndarray] = {}
  received = 0

  def outgoing(it: Item) -> np.ndarray | None:
    try:
      if it.kind == PIECE:
        need = planned.needs[it.ref]
        return _flat(assembler.piece(by_path[target_specs[need.pos].path], need.region))
      st = planned.stripes[it.ref]
      copy = _block(manifest, st, host)
      if copy is None:
        return None
      return rebuild.share(st, host, itemsize,
                            lambda leaf, idx: _flat(assembler.piece(leaf, idx)),
                            lambda: assembler.block(copy))
    except BadCopy:  # (noted in assembler.bad: every host retries without it)
      return None

  for batch_round in rounds(planned):
    out = next((b for b in batch_round if b.src == host), None)
    into = next((b for b in batch_round if b.dst == host), None)
    payload = None
    if out is not None:
      payload = np.zeros(out.nbytes, np.uint8)
      at = 0
      for it in out.items:
        got = outgoing(it)
        if got is not None:
          payload[at:at + it.nbytes] = got
        at += it.nbytes
    buf = coll.permute([(b.src, b.dst) for b in batch_round], payload,
                       max(b.nbytes for b in batch_round))
    if into is None or buf is None:
      continue
    at = 0
    for it in into.items:
      part = buf[at:at + it.nbytes]
      at += it.nbytes
      received += it.nbytes
      if it.kind == SHARE:
        words = part.view(np.uint32)
        if it.ref in sums:
          sums[it.ref] += words
        else:
          sums[it.ref] = words.copy()
        continue
      rec = incoming[it.ref].record
      path = plan.specs[rec.leaf].path
      key = (incoming[it.ref].holder, plan.step, rec.leaf, rec.index)
      if rec.kind is ChecksumKind.CRC32C and crc_matches(
          part, rec.checksum, chunk_bytes=plan.chunk_bytes, key=piece_key(path, rec.index)):
        assembler.adopt(rec.leaf, rec.index, np.array(part))
      else:
        assembler.bad[key] = BadCopy(key, path)
  for ref, total in sums.items():
    for leaf, idx, raw in rebuild.pieces(planned.stripes[ref], total, itemsize):
      assembler.adopt(leaf, idx, np.array(raw), rebuilt=True)
  return received


def _flat(x: Any) -> np.ndarray:
  return np.ascontiguousarray(np.asarray(x)).reshape(-1).view(np.uint8)


# -------------------------------------------------------------- bad copies
def encode_bad(bad: Iterable[CopyKey]) -> bytes:
  rows = [[h, s, lf, [list(r) for r in idx]] for h, s, lf, idx in bad]
  return msgpack.packb(rows) if rows else b""


def gather_bad(coll: Collective, bad: Iterable[CopyKey]) -> list[CopyKey]:
  """Every host's bad copies (one small exchange; nothing sent where none is)."""
  out: list[CopyKey] = []
  for blob in gather_blobs(coll, encode_bad(bad)):
    for h, s, lf, idx in (msgpack.unpackb(blob) if blob else ()):
      out.append((int(h), int(s), int(lf), tuple((int(a), int(b)) for a, b in idx)))
  return sorted(set(out))
