"""A multi-host restore whose metadata is what each host needs, not the job's.

For one candidate step (:mod:`._agree`), in three collectives whose size is
set by the pieces that must move, never by the host count times an
inventory:

1. **needs**: each host lists the target regions of its own devices that its
   own store cannot give it (none, in the usual restore; every region, for
   a replacement that lost its store), and whether it lacks the step's
   header (leaves, scalars, ``extra``);
2. **holders**: for each need, every host that holds an exact, not-bad copy
   puts its distance after the needer in process order into one element-wise
   minimum; the nearest holder sends it. A host that holds only an
   overlapping copy (the target cut differently from the save) marks that
   instead;
3. **rows**: each chosen holder publishes the size and checksums of what it
   sends (from its own manifest), and the lowest holder of the step its
   header where some host lacks it.

Every host derives the same verdict from the same bytes: the step is
restorable here (:class:`Planned`), or no copy of some needed piece
survives (:class:`Lost`: an older step, or the persistent tier), or the
pieces cannot be matched by region (a changed target layout) or must be
rebuilt from parity (:class:`Fallback`: the full inventory exchange of
:mod:`._exchange`, reported as such). A piece then moves point to point
(:meth:`._collective.Collective.permute`) and its receiver checks it
against the sender's checksums before use.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterable, Sequence
from typing import Any, NamedTuple

import msgpack
import numpy as np

from ._agree import Candidate, digest_of, shared_content
from ._assemble import Assembler, BadCopy, _wanted
from ._checksum import ChecksumKind, crc_matches, piece_key
from ._collective import NONE, Collective, gather_blobs
from ._index import Index, full
from ._layout import LeafKind, LeafSpec, spec_from_row, target_sharding
from ._manifest import Manifest, PieceRecord, PieceTable
from ._planner import Copy, CopyKey, StepPlan

#: The most bytes one point-to-point transfer carries (more: several rounds).
BATCH_BYTES = 64 << 20


class Need(NamedTuple):
  """Host ``needer`` lacks region ``region`` of target leaf ``pos`` (its
  position in the flattened abstract state). (A named tuple: a replacement
  has thousands.)"""

  needer: int
  pos: int
  region: Index


@dataclasses.dataclass(frozen=True)
class Header:
  """What the hosts of one step agree on, as a host without it receives it."""

  leaves: tuple[LeafSpec, ...]
  scalars: dict[int, Any]
  extra: Any
  chunk_bytes: int
  tree_digest: str
  num_hosts: int

  @staticmethod
  def of(m: Manifest) -> Header:
    return Header(tuple(m.leaves), dict(m.scalars), m.extra, m.chunk_bytes, m.tree_digest,
                  m.num_hosts)


@dataclasses.dataclass(frozen=True)
class Incoming:
  """One piece this host receives: from ``holder``, its record (the
  holder's size and checksums; the region is its index)."""

  need: int
  holder: int
  record: PieceRecord


@dataclasses.dataclass(frozen=True)
class Planned:
  """The step restores with these moves; the same on every host."""

  candidate: Candidate
  header: Header
  needs: tuple[Need, ...]
  holder: tuple[int, ...]           # per need
  nbytes: tuple[int, ...]           # per need
  incoming: tuple[Incoming, ...]    # this host's
  outgoing: tuple[int, ...]         # the needs this host sends

  @property
  def moves(self) -> int:
    return len(self.needs)


@dataclasses.dataclass(frozen=True)
class Lost:
  why: str


@dataclasses.dataclass(frozen=True)
class Fallback:
  why: str


# ------------------------------------------------------------------ needs
def target_regions(spec: LeafSpec, target: Any) -> list[Index]:
  """The distinct regions of a target leaf this process's devices hold (the
  whole leaf for a host array; none for a scalar)."""
  if spec.kind is LeafKind.SCALAR:
    return []
  if spec.kind is LeafKind.NUMPY or getattr(target, "sharding", None) is None:
    return [full(spec.shape)]
  return list(dict.fromkeys(idx for _, idx in _wanted(target_sharding(target),
                                                      tuple(spec.shape))))


class Held:
  """One host's copies at one step: its manifest's rows by (leaf, region),
  and each leaf's regions as arrays of bounds (for overlap tests)."""

  def __init__(self, host: int, manifest: Manifest | None, bad: Collection[CopyKey]):
    self.host = host
    self.manifest = manifest
    self.exact: dict[tuple[int, Index], tuple[Any, ...]] = {}
    self.by_path: dict[str, int] = {}
    self._regions: dict[int, list[Index]] = {}
    self._bounds: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    if manifest is None:
      return
    step = manifest.step
    self.by_path = {s.path: i for i, s in enumerate(manifest.leaves)}
    for row in manifest.pieces.rows:  # (rows: no record object made per piece)
      key = (row[0], row[1])
      if (bad and (host, step, *key) in bad) or key in self.exact:
        continue
      self.exact[key] = row
      self._regions.setdefault(row[0], []).append(row[1])

  def leaf_of(self, spec: LeafSpec) -> int | None:
    return self.by_path.get(spec.path)

  def record(self, leaf: int, region: Index) -> PieceRecord:
    return PieceTable.record(self.exact[(leaf, region)])

  def overlaps(self, leaf: int, region: Index) -> bool:
    """True if some copy of ``leaf`` here overlaps ``region``."""
    bounds = self._bounds.get(leaf)
    if bounds is None:
      regions = self._regions.get(leaf)
      if not regions:
        return False
      arr = np.array(regions, np.int64)  # (pieces, dims, 2)
      bounds = self._bounds[leaf] = (arr[..., 0], arr[..., 1])
    lo, hi = bounds
    if not lo.shape[1]:  # 0-d leaves: every piece is the whole leaf
      return True
    r = np.array(region, np.int64)
    return bool(((lo < r[:, 1]) & (r[:, 0] < hi)).all(axis=1).any())


def local_needs(held: Held, target_specs: Sequence[LeafSpec], targets: Sequence[Any]
                ) -> list[tuple[int, Index]]:
  """(target position, region) of each region this host's devices hold that
  its own store has no exact copy of."""
  out = []
  for pos, (spec, target) in enumerate(zip(target_specs, targets, strict=True)):
    leaf = held.leaf_of(spec)
    for region in target_regions(spec, target):
      if leaf is None or (leaf, region) not in held.exact:
        out.append((pos, region))
  return out


def encode_needs(lacks_header: bool, needs: Sequence[tuple[int, Index]]) -> bytes:
  if not needs and not lacks_header:
    return b""
  return msgpack.packb([int(lacks_header), [[pos, [c for r in region for c in r]]
                                            for pos, region in needs]])


def decode_needs(blobs: Sequence[bytes]) -> tuple[list[Need], list[int]]:
  """Every host's needs in process order, and the hosts that lack the header."""
  needs: list[Need] = []
  lacking = []
  for host, blob in enumerate(blobs):
    if not blob:
      continue
    lacks, rows = msgpack.unpackb(blob)
    if lacks:
      lacking.append(host)
    for pos, flat in rows:
      region = tuple((int(flat[i]), int(flat[i + 1])) for i in range(0, len(flat), 2))
      needs.append(Need(host, int(pos), region))
  return needs, lacking


# ---------------------------------------------------------------- holders
def holder_values(held: Held, needs: Sequence[Need], target_specs: Sequence[LeafSpec],
                  num_hosts: int) -> np.ndarray:
  """This host's part of the holders' minimum: for need ``i``, at ``i`` its
  distance after the needer if it holds an exact copy, at ``len(needs) + i``
  if it holds an overlapping one; :data:`NONE` elsewhere."""
  out = np.full(2 * len(needs), NONE, np.int32)
  if held.manifest is None:
    return out
  for i, need in enumerate(needs):
    leaf = held.leaf_of(target_specs[need.pos])
    if leaf is None:
      continue
    rank = (held.host - need.needer) % num_hosts
    if (leaf, need.region) in held.exact:
      out[i] = rank
    elif held.overlaps(leaf, need.region):
      out[len(needs) + i] = rank
  return out


def verdict(needs: Sequence[Need], mins: np.ndarray, cand: Candidate, num_hosts: int,
            target_specs: Sequence[LeafSpec]) -> tuple[int, ...] | Lost | Fallback:
  """Each need's holder, or why the step cannot restore this way."""
  n = len(needs)
  holders = []
  layout = parity = None
  for i, need in enumerate(needs):
    exact, near = int(mins[i]), int(mins[n + i])
    if exact != NONE:
      holders.append((need.needer + exact) % num_hosts)
      continue
    what = f"host {need.needer}'s piece {list(need.region)} of leaf {target_specs[need.pos].path!r}"
    if near != NONE:
      layout = layout or what
    elif cand.parity:
      parity = parity or what
    else:
      return Lost(f"step {cand.step}: no surviving copy of {what}")
  if layout is not None:
    return Fallback(f"the target layout differs from the saved one ({layout} is no saved "
                    "piece)")
  if parity is not None:
    return Fallback(f"{parity} is rebuilt from parity")
  return tuple(holders)


# ------------------------------------------------------------------- rows
def encode_rows(held: Held, needs: Sequence[Need], holders: Sequence[int],
                target_specs: Sequence[LeafSpec], header: bytes | None) -> bytes:
  """The records of the needs this host sends, and the header if asked."""
  rows = []
  for i, (need, h) in enumerate(zip(needs, holders, strict=True)):
    if h != held.host:
      continue
    rec = held.record(held.by_path[target_specs[need.pos].path], need.region)
    rows.append([i, rec.nbytes, list(rec.checksum), rec.owner, rec.kind.value])
  if not rows and header is None:
    return b""
  return msgpack.packb([rows, header], use_bin_type=True)


def decode_rows(blobs: Sequence[bytes]) -> tuple[dict[int, list[Any]], bytes | None]:
  rows: dict[int, list[Any]] = {}
  header = None
  for blob in blobs:
    if not blob:
      continue
    got, head = msgpack.unpackb(blob)
    for row in got:
      rows[int(row[0])] = row
    if head is not None:
      header = head
  return rows, header


def header_from(blob: bytes, digest: int) -> Header:
  """The header a host received, checked against the agreed digest."""
  from ._manifest import _int, _str  # (defensive parsing, as manifests are parsed)
  if digest_of(blob) != digest:
    raise ValueError("the step's header does not match the digest its hosts agreed on")
  leaves, scalars, extra, chunk_bytes, tree_digest, num_hosts = msgpack.unpackb(
      blob, strict_map_key=False)
  return Header(tuple(spec_from_row(r) for r in leaves), {_int(k): v for k, v in scalars},
                extra, _int(chunk_bytes, 1), _str(tree_digest), _int(num_hosts, 1))


# -------------------------------------------------------------- the plan
def plan(coll: Collective, manifest: Manifest | None, cand: Candidate,
         target_specs: Sequence[LeafSpec], targets: Sequence[Any], *,
         bad: Collection[CopyKey] = ()) -> Planned | Lost | Fallback:
  """Needs, holders and rows for ``cand`` (``manifest``: this host's of that
  step and incarnation, or None). Collective; the same verdict everywhere."""
  host, n = coll.host, coll.num_hosts
  held = Held(host, manifest, bad)
  mine = local_needs(held, target_specs, targets)
  needs, lacking = decode_needs(gather_blobs(coll, encode_needs(manifest is None, mine)))
  if not needs and not lacking and manifest is not None:
    return Planned(cand, Header.of(manifest), (), (), (), (), ())
  mins = coll.reduce_min(holder_values(held, needs, target_specs, n))
  got = verdict(needs, mins, cand, n, target_specs)
  if not isinstance(got, tuple):
    return got
  holders = got
  send_header = bool(lacking) and manifest is not None and host == cand.holders[0]
  head = shared_content(manifest) if send_header and manifest is not None else None
  rows, header_blob = decode_rows(gather_blobs(coll, encode_rows(
      held, needs, holders, target_specs, head)))
  header = Header.of(manifest) if manifest is not None else header_from(header_blob or b"",
                                                                        cand.digest)
  by_path = {s.path: i for i, s in enumerate(header.leaves)}
  kinds = {k.value: k for k in ChecksumKind}
  incoming = []
  for i, need in enumerate(needs):
    if need.needer == host:
      row = rows[i]
      leaf = by_path[target_specs[need.pos].path]
      rec = PieceRecord(leaf, need.region, 0, int(row[1]), tuple(int(c) for c in row[2]),
                        int(row[3]), kinds[row[4]])
      incoming.append(Incoming(i, holders[i], rec))
  return Planned(cand, header, tuple(needs), holders,
                 tuple(int(rows[i][1]) for i in range(len(needs))), tuple(incoming),
                 tuple(i for i, h in enumerate(holders) if h == host))


# ---------------------------------------------------------- the transfers
@dataclasses.dataclass(frozen=True)
class Batch:
  """Needs ``needs`` moving from ``src`` to ``dst`` in one buffer."""

  src: int
  dst: int
  needs: tuple[int, ...]
  nbytes: int


def rounds(planned: Planned, batch_bytes: int = BATCH_BYTES) -> list[list[Batch]]:
  """The transfers in rounds where each host sends at most one buffer and
  receives at most one (one permute a round); the same on every host."""
  pairs: dict[tuple[int, int], list[int]] = {}
  for i, need in enumerate(planned.needs):
    pairs.setdefault((planned.holder[i], need.needer), []).append(i)
  pending: list[Batch] = []
  for (src, dst), ids in sorted(pairs.items()):
    cur: list[int] = []
    size = 0
    for i in ids:
      nb = planned.nbytes[i]
      if cur and size + nb > batch_bytes:
        pending.append(Batch(src, dst, tuple(cur), size))
        cur, size = [], 0
      cur.append(i)
      size += nb
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
  """(bytes ``host`` sends, bytes it receives) of state in ``planned``."""
  sent = sum(planned.nbytes[i] for i in range(planned.moves) if planned.holder[i] == host)
  got = sum(planned.nbytes[i] for i, need in enumerate(planned.needs) if need.needer == host)
  return sent, got


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


def manifests_at(manifests: Iterable[Manifest], cand: Candidate) -> Manifest | None:
  """This host's manifest of the candidate's step and incarnation, if any."""
  for m in manifests:
    if m.step == cand.step and m.incarnation == cand.incarnation:
      return m
  return None


# ------------------------------------------------------------- execution
def local_plan(planned: Planned, manifest: Manifest | None, host: int,
               bad: Collection[CopyKey] = ()) -> StepPlan:
  """The step plan of this host alone: the copies its store holds (not
  bad), and the pieces it receives (held by their senders)."""
  cand, header = planned.candidate, planned.header
  copies: dict[tuple[int, Index], list[Copy]] = {}
  if manifest is not None:
    slot_bytes = max([r[2] + r[3] for r in manifest.pieces.rows] +
                     [r.piece.offset + r.piece.nbytes for r in manifest.parity], default=0)
    for p in manifest.pieces:
      c = Copy(host, manifest.slot, p, slot_bytes)
      if not bad or c.key(cand.step) not in bad:
        copies.setdefault((p.leaf, p.index), []).append(c)
  for got in planned.incoming:
    rec = got.record
    copies.setdefault((rec.leaf, rec.index), []).append(Copy(got.holder, -1, rec, 0))
  return StepPlan(step=cand.step, incarnation=cand.incarnation, specs=header.leaves,
                  tree_digest=header.tree_digest, chunk_bytes=header.chunk_bytes,
                  copies={k: tuple(v) for k, v in copies.items()}, scalars=header.scalars,
                  extra=header.extra, stores=(host,))


def outgoing_keys(planned: Planned, target_specs: Sequence[LeafSpec]
                  ) -> list[tuple[int, Index]]:
  """The (leaf, region) of each piece this host sends."""
  by_path = {s.path: i for i, s in enumerate(planned.header.leaves)}
  return [(by_path[target_specs[planned.needs[i].pos].path], planned.needs[i].region)
          for i in planned.outgoing]


def move(coll: Collective, planned: Planned, assembler: Assembler,
         target_specs: Sequence[LeafSpec]) -> int:
  """Runs the transfers: this host's outgoing pieces (verified as they were
  read, :meth:`Assembler.prefetch`) go to their needers; each piece
  received is checked against its sender's checksums, then adopted, or
  marked bad (``assembler.bad``). Returns the bytes received."""
  plan = assembler.plan
  host = coll.host
  by_path = {s.path: i for i, s in enumerate(planned.header.leaves)}
  incoming = {got.need: got for got in planned.incoming}
  received = 0
  for batch_round in rounds(planned):
    out = next((b for b in batch_round if b.src == host), None)
    into = next((b for b in batch_round if b.dst == host), None)
    payload = None
    if out is not None:
      payload = np.zeros(out.nbytes, np.uint8)
      at = 0
      for i in out.needs:
        nb = planned.nbytes[i]
        leaf = by_path[target_specs[planned.needs[i].pos].path]
        try:
          payload[at:at + nb] = _flat(assembler.piece(leaf, planned.needs[i].region))
        except BadCopy:  # (noted in assembler.bad; its receiver finds zeros)
          pass
        at += nb
    got = coll.permute([(b.src, b.dst) for b in batch_round], payload,
                       max(b.nbytes for b in batch_round))
    if into is None or got is None:
      continue
    at = 0
    for i in into.needs:
      nb = planned.nbytes[i]
      part = got[at:at + nb]
      at += nb
      rec = incoming[i].record
      path = plan.specs[rec.leaf].path
      key = (incoming[i].holder, plan.step, rec.leaf, rec.index)
      if rec.kind is ChecksumKind.CRC32C and crc_matches(
          part, rec.checksum, chunk_bytes=plan.chunk_bytes, key=piece_key(path, rec.index)):
        assembler.adopt(rec.leaf, rec.index, np.array(part))
        received += nb
      else:
        assembler.bad[key] = BadCopy(key, path)
  return received


def _flat(x: Any) -> np.ndarray:
  return np.ascontiguousarray(np.asarray(x)).reshape(-1).view(np.uint8)
