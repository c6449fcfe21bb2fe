"""The per-host, per-step manifest: versioned msgpack, parsed defensively.

A manifest names every piece a store holds for one step (leaf, global index,
where it sits in the store, its checksum and how that was computed, the host or
failure domain that owns it), the tree
digest, and the fencing fields (run id, incarnation). It is written last and
atomically: a step without a valid manifest does not exist. The file carries a
crc32c of its body, checked before any field is trusted, and every field is
validated (:func:`validate`): a manifest that fails is corruption.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import crc32c
import msgpack

from . import errors
from ._checksum import ChecksumKind
from ._index import Index, disjoint, nbytes as index_nbytes
from ._tree import (
    LeafKind,
    LeafSpec,
    check_scalar,
    check_spec,
    spec_from_row,
    spec_row,
    tree_digest,
)
from .options import MAX_INT

PARITY_LEAF = -1  # the leaf of a parity block's piece record (see ._parity)
FORMAT = "snapstore/manifest"
VERSION = 3  # 3: an envelope with the body's crc32c; per-piece checksum kinds
MAX_MANIFEST_BYTES = 64 << 20
#: what ``extra`` and a state's strings may take in a manifest together (the
#: rest of :data:`MAX_MANIFEST_BYTES` is for the leaf and piece tables)
MAX_INLINE_BYTES = 32 << 20


class PieceRecord(NamedTuple):
  """One stored piece (a named tuple: a plan makes one for every piece of
  every manifest, thousands, and a frozen dataclass costs several times as
  much to make).

  Attributes:
    leaf: position of its leaf in ``Manifest.leaves``.
    index: the global region of the leaf it covers.
    offset: where it sits in its store: a byte offset in the slot file (host
      files), a position in the snapshot's array list (pinned host).
    nbytes: its size.
    checksum: the checksum values, computed as ``kind`` says.
    owner: the host (failure domain, on a single controller) whose devices
      held this shard at save time.
    kind: how ``checksum`` was computed.
  """

  leaf: int
  index: Index  # type: ignore[assignment]  # the field's name shadows tuple.index
  offset: int
  nbytes: int
  checksum: tuple[int, ...]
  owner: int
  kind: ChecksumKind = ChecksumKind.CRC32C


_KINDS = {k.value: k for k in ChecksumKind}


def piece_row(leaf: int, index: Index, offset: int, nbytes: int, checksum: Sequence[int],
              owner: int, kind: ChecksumKind) -> tuple[Any, ...]:
  """One piece as :class:`PieceTable` keeps it: a tuple of plain values
  (tuples of ints, the kind as its ``value``)."""
  return (leaf, tuple(map(tuple, index)), offset, nbytes, tuple(checksum), owner, kind.value)


def split_parity(rows: Iterable[tuple[Any, ...]],
                 parity_of: Mapping[tuple[int, int], tuple[Any, ...]]
                 ) -> tuple[PieceTable, tuple[ParityRecord, ...]]:
  """A drain's :func:`piece_row` rows -> (the table of the data pieces, the
  parity records); ``parity_of[(stripe, block)]``: (members, layout, length)."""
  data, parity = [], []
  for row in rows:
    if row[0] == PARITY_LEAF:
      parity.append(ParityRecord(PieceTable.record(row), *parity_of[row[1][0]]))
    else:
      data.append(row)
  return PieceTable.from_rows(data), tuple(parity)


class PieceTable(Sequence[PieceRecord]):
  """A manifest's pieces, kept as rows of plain tuples ``(leaf, index,
  offset, nbytes, checksum, owner, kind value)``; each :class:`PieceRecord`
  is made when read.

  Why: the stores keep their manifests, and a state of 500 leaves on 8
  devices has 4,000 pieces a snapshot. As objects they outlive two young
  collections and count towards Python's full collection, which then ran
  every few snapshots (``gc.callbacks`` during ``save`` show it). Tuples of
  plain values are untracked by
  the collector once it has seen them, so rows cost it nothing. msgpack
  writes the rows as they are (:func:`encode`).
  """

  __slots__ = ("rows",)

  def __init__(self, records: Iterable[PieceRecord] = ()):
    self.rows: tuple[tuple[Any, ...], ...] = tuple(
        piece_row(r.leaf, r.index, r.offset, r.nbytes, r.checksum, r.owner, r.kind)
        for r in records)

  @classmethod
  def from_rows(cls, rows: Iterable[tuple[Any, ...]]) -> PieceTable:
    """A table of :func:`piece_row` rows, built without records."""
    table = cls()
    table.rows = tuple(rows)
    return table

  @staticmethod
  def record(row: tuple[Any, ...]) -> PieceRecord:
    """The :class:`PieceRecord` of one :func:`piece_row` row."""
    leaf, index, offset, nbytes, checksum, owner, kind = row
    return PieceRecord(leaf, index, offset, nbytes, checksum, owner, _KINDS[kind])

  def __len__(self) -> int:
    return len(self.rows)

  def __getitem__(self, i):
    if isinstance(i, slice):
      return tuple(self.record(r) for r in self.rows[i])
    return self.record(self.rows[i])

  def __iter__(self) -> Iterator[PieceRecord]:
    return map(self.record, self.rows)

  def __eq__(self, other: object) -> bool:
    if isinstance(other, PieceTable):
      return self.rows == other.rows
    if isinstance(other, (tuple, list)):
      return tuple(self) == tuple(other)
    return NotImplemented

  def __hash__(self) -> int:
    return hash(self.rows)

  def __repr__(self) -> str:
    return f"PieceTable({list(self)!r})"


@dataclasses.dataclass(frozen=True, slots=True)
class ParityRecord:
  """One parity block (:mod:`._parity`) this store keeps.

  Attributes:
    piece: where it sits and its checksum, as a piece record whose ``leaf``
      is ``PARITY_LEAF`` and whose ``index`` is ``((stripe, block),)``.
    members: the store (host) of each member of its stripe, in member order.
    layout: per member, the pieces (leaf, global index) of its buffer, in order.
    length: bytes of each member's buffer (``k * piece.nbytes``).
  """

  piece: PieceRecord
  members: tuple[int, ...]
  layout: tuple[tuple[tuple[int, Index], ...], ...]
  length: int

  @property
  def stripe(self) -> int:
    return self.piece.index[0][0]

  @property
  def block(self) -> int:
    return self.piece.index[0][1]


@dataclasses.dataclass(frozen=True)
class Manifest:
  run_id: str
  incarnation: int
  step: int
  store: int         # the store's id: process index, or failure domain (slice)
  num_hosts: int
  tree_digest: str
  slot: int          # which of the store's reused slots holds the pieces
  chunk_bytes: int
  leaves: tuple[LeafSpec, ...]
  pieces: PieceTable  # given as any sequence of PieceRecord; kept as a PieceTable
  scalars: Mapping[int, Any]
  extra: Any = None
  created: float = 0.0
  parity: tuple[ParityRecord, ...] = ()
  # the job's retention watermark agreed at this step's capture (-1: none;
  # :mod:`._watermark`): the store keeps that step until a newer one is agreed
  watermark: int = -1

  def __post_init__(self) -> None:
    if not isinstance(self.pieces, PieceTable):  # kept as rows (see PieceTable)
      object.__setattr__(self, "pieces", PieceTable(self.pieces))

  @property
  def data_bytes(self) -> int:
    return (sum(row[3] for row in self.pieces.rows)
            + sum(r.piece.nbytes for r in self.parity))


def encode(m: Manifest) -> bytes:
  """The manifest file: an envelope carrying the body and its crc32c."""
  doc = {
      "run_id": m.run_id, "incarnation": m.incarnation, "step": m.step,
      "host": m.store, "num_hosts": m.num_hosts, "tree_digest": m.tree_digest,
      "slot": m.slot, "chunk_bytes": m.chunk_bytes, "created": m.created,
      "watermark": m.watermark,
      "leaves": [spec_row(s) for s in m.leaves],
      "pieces": m.pieces.rows,  # msgpack writes tuples as arrays, as _piece_row's lists
      "scalars": [[k, v] for k, v in sorted(m.scalars.items())],
      "extra": m.extra,
  }
  if m.parity:
    doc["parity"] = [[_piece_row(r.piece), list(r.members),
                      [[[lf, [list(x) for x in idx]] for lf, idx in mem] for mem in r.layout],
                      r.length] for r in m.parity]
  body = msgpack.packb(doc, use_bin_type=True)
  out = msgpack.packb({"format": FORMAT, "version": VERSION,
                       "crc32c": crc32c.crc32c(body), "body": body}, use_bin_type=True)
  if len(out) > MAX_MANIFEST_BYTES:  # (what no reader would accept is not written)
    raise errors.UnsupportedExtraError(
        f"step {m.step}: a manifest of {len(out)} bytes, over the limit of "
        f"{MAX_MANIFEST_BYTES} (extra, strings, or leaves and pieces); nothing committed")
  return out


def _piece_row(p: PieceRecord) -> list[Any]:
  return [p.leaf, [list(r) for r in p.index], p.offset, p.nbytes, list(p.checksum),
          p.owner, p.kind.value]


def _piece_from_row(row: Any, *, min_leaf: int = 0) -> PieceRecord:
  leaf, index, offset, nbytes, crcs, owner, kind = row
  return PieceRecord(_int(leaf, min_leaf), _index_from(index), _int(offset), _int(nbytes),
                     tuple(_int(c, 0, 2**32 - 1) for c in crcs), _int(owner),
                     ChecksumKind(kind))


def _index_from(index: Any) -> Index:
  return tuple((_int(a), _int(b)) for a, b in index)


def check_extra(extra: Any) -> int:
  """``extra``'s bytes in a manifest; raises UnsupportedExtraError if it
  does not survive a msgpack round trip."""
  try:
    packed = msgpack.packb(extra, use_bin_type=True)
    back = msgpack.unpackb(packed, raw=False, strict_map_key=False)
  except (TypeError, ValueError, OverflowError) as e:
    raise errors.UnsupportedExtraError(
        f"extra must be msgpack-serializable (dicts, lists, str, bytes, numbers): {e}"
    ) from None
  if not _same(back, extra):
    raise errors.UnsupportedExtraError("extra does not survive a msgpack round trip "
                                       "unchanged (tuples become lists); pass lists and dicts")
  return len(packed)


def check_inline(extra_bytes: int, leaves: Sequence[Any]) -> None:
  """Raises UnsupportedExtraError if ``extra`` and the state's strings are
  more than a manifest carries inline (:data:`MAX_INLINE_BYTES`): a
  manifest over :data:`MAX_MANIFEST_BYTES` would be refused by every reader."""
  chars = sum(len(v) for v in leaves if type(v) is str)
  if extra_bytes + 4 * chars <= MAX_INLINE_BYTES:  # (UTF-8: at most 4 bytes a character)
    return
  strings = sum(len(v.encode("utf-8")) for v in leaves if type(v) is str)
  if extra_bytes + strings > MAX_INLINE_BYTES:
    raise errors.UnsupportedExtraError(
        f"extra ({extra_bytes} bytes) and the state's strings ({strings} bytes) are more than "
        f"the {MAX_INLINE_BYTES} bytes a snapshot's manifest carries; keep large data in "
        "numpy arrays of the state")


def copy_extra(extra: Any) -> Any:
  """A private copy of ``extra`` (checked by :func:`check_extra`), as a
  manifest's decode gives it."""
  return msgpack.unpackb(msgpack.packb(extra, use_bin_type=True), raw=False,
                         strict_map_key=False)


def kept_copy(m: Manifest) -> Manifest:
  """``m`` as a store keeps it: its own ``extra`` and ``scalars``, not the
  caller's objects (as a decode would give them)."""
  return dataclasses.replace(m, extra=copy_extra(m.extra), scalars=dict(m.scalars))


def _same(a: Any, b: Any) -> bool:
  """Equal in type and value, NaN equal to NaN (what a round trip must keep)."""
  if type(a) is not type(b):
    return False
  if isinstance(a, dict):
    return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
  if isinstance(a, list):
    return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
  if isinstance(a, float):
    return a == b or (a != a and b != b)
  return a == b


def _unpack(data: bytes) -> Any:
  return msgpack.unpackb(data, raw=False, strict_map_key=False)


def decode(data: bytes, *, what: str = "manifest") -> Manifest:
  """Parses a manifest, checks its crc32c before trusting any field, then
  validates every field; raises CorruptSnapshotError saying why."""
  if len(data) > MAX_MANIFEST_BYTES:
    raise errors.CorruptSnapshotError(f"{what}: {len(data)} bytes exceeds the limit")
  try:  # the envelope: four small fields and the body (a crafted header claiming
    # millions of entries is refused before it costs memory)
    env = msgpack.unpackb(data, raw=False, max_array_len=0, max_map_len=8, max_str_len=64,
                        max_bin_len=MAX_MANIFEST_BYTES, max_ext_len=0)
  except Exception as e:  # msgpack raises several unrelated types on bad input.
    raise errors.CorruptSnapshotError(f"{what}: not valid msgpack ({e})") from e
  if not isinstance(env, dict) or env.get("format") != FORMAT:
    raise errors.CorruptSnapshotError(f"{what}: not a {FORMAT} file")
  if env.get("version") != VERSION:
    raise errors.CorruptSnapshotError(
        f"{what}: version {env.get('version')!r} is not supported (want {VERSION})")
  body = env.get("body")
  if not isinstance(body, bytes) or env.get("crc32c") != crc32c.crc32c(body):
    raise errors.CorruptSnapshotError(f"{what}: its checksum does not match its content")
  try:
    doc = _unpack(body)
  except Exception as e:  # as above
    raise errors.CorruptSnapshotError(f"{what}: body is not valid msgpack ({e})") from e
  try:
    m = _from_doc(doc)
    validate(m)
  except (KeyError, TypeError, ValueError, OverflowError) as e:
    raise errors.CorruptSnapshotError(f"{what}: malformed ({e})") from e
  return m


def _int(x: Any, lo: int = 0, hi: int = MAX_INT) -> int:
  if type(x) is not int or not lo <= x <= hi:
    raise ValueError(f"expected an int in [{lo}, {hi}], got {x!r}")
  return x


def _str(x: Any) -> str:
  if not isinstance(x, str):
    raise TypeError(f"expected str, got {type(x).__name__}")
  return x


def _from_doc(doc: Any) -> Manifest:
  if not isinstance(doc, dict):
    raise TypeError("top level is not a map")
  leaves = tuple(spec_from_row(row) for row in doc["leaves"])
  pieces = [_piece_from_row(row) for row in doc["pieces"]]
  parity = []
  for piece, members, layout, length in doc.get("parity", ()):
    parity.append(ParityRecord(
        _piece_from_row(piece, min_leaf=PARITY_LEAF), tuple(_int(h) for h in members),
        tuple(tuple((_int(lf), _index_from(idx)) for lf, idx in mem) for mem in layout),
        _int(length)))
  scalars: dict[int, Any] = {}
  for k, v in doc["scalars"]:
    if _int(k) in scalars:
      raise ValueError(f"scalar entry {k} appears twice")
    scalars[k] = v
  created = doc.get("created", 0.0)
  if type(created) not in (int, float):
    raise TypeError("created is not a number")
  watermark = doc.get("watermark", -1)  # (absent before 0.x: none)
  if watermark != -1:
    watermark = _int(watermark)
  return Manifest(
      run_id=_str(doc["run_id"]), incarnation=_int(doc["incarnation"]),
      step=_int(doc["step"]), store=_int(doc["host"]),
      num_hosts=_int(doc["num_hosts"], 1), tree_digest=_str(doc["tree_digest"]),
      slot=_int(doc["slot"]), chunk_bytes=_int(doc["chunk_bytes"], 1),
      leaves=leaves, pieces=PieceTable(pieces), scalars=scalars,
      extra=doc.get("extra"), created=float(created), parity=tuple(parity),
      watermark=watermark)


def validate(m: Manifest) -> None:
  """Checks what a manifest claims, beyond its types: leaves from the closed
  sets and matching the tree digest, every scalar leaf's value present once,
  pieces inside their leaf, sized right, with checksums of the right shape,
  and no two pieces of a leaf overlapping. Raises ValueError/TypeError."""
  if not -1 <= m.watermark <= m.step:
    raise ValueError(f"watermark {m.watermark} is not -1 or a step up to {m.step}")
  paths = [s.path for s in m.leaves]
  if len(set(paths)) != len(paths):
    raise ValueError("two leaves share a path")
  for s in m.leaves:
    check_spec(s)
  if tree_digest(m.leaves) != m.tree_digest:
    raise ValueError("the tree digest does not match the leaves")
  scalar_leaves = {i for i, s in enumerate(m.leaves) if s.kind is LeafKind.SCALAR}
  if set(m.scalars) != scalar_leaves:
    raise ValueError(f"scalar entries {sorted(m.scalars)} are not the scalar leaves "
                     f"{sorted(scalar_leaves)}")
  for k, v in m.scalars.items():
    check_scalar(m.leaves[k].path, v)
  by_leaf: dict[int, list[Index]] = {}
  for p in m.pieces:
    if p.leaf >= len(m.leaves) or m.leaves[p.leaf].kind is LeafKind.SCALAR:
      raise ValueError(f"a piece names leaf {p.leaf}, which holds no array")
    spec = m.leaves[p.leaf]
    if not _inside(p.index, spec.shape):
      raise ValueError(f"piece index {p.index} outside leaf shape {spec.shape}")
    if p.nbytes != index_nbytes(p.index, spec.np_dtype.itemsize):
      raise ValueError(f"piece {p.index} of {spec.path!r} claims {p.nbytes} bytes")
    want = _checksum_count(p, m.chunk_bytes)
    if len(p.checksum) != want:
      raise ValueError(f"piece {p.index} of {spec.path!r} has {len(p.checksum)} "
                       f"checksum values, {p.kind.value} needs {want}")
    by_leaf.setdefault(p.leaf, []).append(p.index)
  for leaf, indices in by_leaf.items():
    if len(set(indices)) != len(indices) or not disjoint(indices):
      raise ValueError(f"pieces of leaf {m.leaves[leaf].path!r} overlap")
  for r in m.parity:
    _validate_parity(m, r)
  blocks = [r.piece.index for r in m.parity]
  if len(set(blocks)) != len(blocks):
    raise ValueError("two parity blocks share a (stripe, block)")


def _inside(index: Index, shape: tuple[int, ...]) -> bool:
  return len(index) == len(shape) and all(
      a <= b <= d for (a, b), d in zip(index, shape, strict=True))


def _checksum_count(p: PieceRecord, chunk_bytes: int) -> int:
  """How many checksum values a stored copy of ``p.nbytes`` carries."""
  return 2 if p.kind is ChecksumKind.DEVICE_SUM else max(1, -(-p.nbytes // chunk_bytes))


def pad4(n: int) -> int:
  return -(-n // 4) * 4


def pad4_sum(sizes: Sequence[int]) -> int:
  """Bytes of pieces of ``sizes`` laid end to end, each padded to 4."""
  return sum(pad4(s) for s in sizes)


def member_length(used: int, k: int) -> int:
  """A parity stripe's member length ``L`` for members of ``used`` padded
  bytes: a multiple of ``4 k`` (``k`` sub-blocks of words), at least one."""
  step = 4 * k
  return max(-(-used // step) * step, step)


def _validate_parity(m: Manifest, r: ParityRecord) -> None:
  p = r.piece
  n = len(r.members)
  if p.leaf != PARITY_LEAF or len(p.index) != 1:
    raise ValueError(f"parity block {p.index} is not a parity piece")
  if not 2 <= n <= 1024 or len(set(r.members)) != n or len(r.layout) != n:
    raise ValueError(f"parity block {p.index}: {n} members, {len(r.layout)} layouts")
  if p.index[0][1] >= n or r.members[p.index[0][1]] != m.store:
    raise ValueError(f"parity block {p.index} is not its holder's")
  if r.length % (4 * (n - 1)) or p.nbytes != r.length // (n - 1):
    raise ValueError(f"parity block {p.index}: {p.nbytes} bytes of a {r.length}-byte stripe")
  if len(p.checksum) != _checksum_count(p, m.chunk_bytes):
    raise ValueError(f"parity block {p.index} has {len(p.checksum)} checksum values")
  totals = set()
  for mem in r.layout:
    sizes = []
    for leaf, idx in mem:
      if leaf >= len(m.leaves) or m.leaves[leaf].kind is LeafKind.SCALAR:
        raise ValueError(f"parity block {p.index} names leaf {leaf}, which holds no array")
      spec = m.leaves[leaf]
      if not _inside(idx, spec.shape):
        raise ValueError(f"parity block {p.index}: index {idx} outside {spec.shape}")
      sizes.append(index_nbytes(idx, spec.np_dtype.itemsize))
    totals.add(pad4_sum(sizes))
  if len(totals) != 1 or r.length != member_length(totals.pop(), n - 1):
    raise ValueError(f"parity block {p.index}: a {r.length}-byte stripe for members of "
                     "unequal or other sizes")


def write_atomic(path: os.PathLike[str] | str, data: bytes, *,
                 before_rename: Callable[[], None] | None = None) -> os.stat_result:
  """Writes ``data`` to ``path`` via a 0600 temp file and a rename; returns
  the file's stat as written (a rename keeps inode, size and mtime)."""
  tmp = f"{os.fspath(path)}.tmp.{os.getpid()}"
  try:
    os.unlink(tmp)  # left by an earlier process of this pid
  except FileNotFoundError:
    pass
  fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
  try:
    view = memoryview(data)
    while view:
      view = view[os.write(fd, view):]
    st = os.fstat(fd)
  finally:
    os.close(fd)
  if before_rename is not None:
    before_rename()
  os.replace(tmp, path)
  return st
