"""The per-host, per-step manifest: versioned msgpack, parsed defensively.

A manifest names every piece a store holds for one step (leaf, global index,
where it sits in the store, its checksum and how that was computed, the host or
failure domain that owns it), the tree
digest, and the fencing fields (run id, incarnation). It is written last and
atomically: a step without a valid manifest does not exist.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from typing import Any

import msgpack

from . import errors
from ._checksum import ChecksumKind
from ._index import Index
from ._layout import LeafKind, LeafSpec, SCALAR_TYPES, spec_from_row, spec_row

FORMAT = "snapstore/manifest"
VERSION = 2
MAX_MANIFEST_BYTES = 64 << 20


@dataclasses.dataclass(frozen=True)
class PieceRecord:
  """One stored piece.

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
  index: Index
  offset: int
  nbytes: int
  checksum: tuple[int, ...]
  owner: int
  kind: ChecksumKind = ChecksumKind.CRC32C


@dataclasses.dataclass(frozen=True)
class Manifest:
  run_id: str
  incarnation: int
  step: int
  host: int          # the store's id: process index, or failure domain (slice)
  num_hosts: int
  tree_digest: str
  slot: int          # which of the store's reused slots holds the pieces
  chunk_bytes: int
  leaves: tuple[LeafSpec, ...]
  pieces: tuple[PieceRecord, ...]
  scalars: Mapping[int, Any]
  extra: Any = None
  created: float = 0.0

  @property
  def data_bytes(self) -> int:
    return sum(p.nbytes for p in self.pieces)


def encode(m: Manifest) -> bytes:
  doc = {
      "format": FORMAT, "version": VERSION,
      "run_id": m.run_id, "incarnation": m.incarnation, "step": m.step,
      "host": m.host, "num_hosts": m.num_hosts, "tree_digest": m.tree_digest,
      "slot": m.slot, "chunk_bytes": m.chunk_bytes, "created": m.created,
      "leaves": [spec_row(s) for s in m.leaves],
      "pieces": [[p.leaf, [list(r) for r in p.index], p.offset, p.nbytes,
                  list(p.checksum), p.owner, p.kind.value] for p in m.pieces],
      "scalars": [[k, v] for k, v in sorted(m.scalars.items())],
      "extra": m.extra,
  }
  return msgpack.packb(doc, use_bin_type=True)


def check_extra(extra: Any) -> None:
  """Raises TypeError if ``extra`` does not survive a msgpack round trip."""
  try:
    back = msgpack.unpackb(msgpack.packb(extra, use_bin_type=True), raw=False,
                           strict_map_key=False)
  except (TypeError, ValueError, OverflowError) as e:
    raise TypeError(
        f"extra must be msgpack-serializable (dicts, lists, str, bytes, numbers): {e}"
    ) from e
  if _normalize(back) != _normalize(extra):
    raise TypeError("extra does not survive a msgpack round trip unchanged "
                    "(tuples become lists); pass lists and dicts")


def _normalize(x: Any) -> Any:
  if isinstance(x, dict):
    return {k: _normalize(v) for k, v in x.items()}
  if isinstance(x, list):
    return [_normalize(v) for v in x]
  return x


def decode(data: bytes, *, what: str = "manifest") -> Manifest:
  """Parses and validates a manifest; raises CorruptSnapshotError."""
  if len(data) > MAX_MANIFEST_BYTES:
    raise errors.CorruptSnapshotError(f"{what}: {len(data)} bytes exceeds the limit")
  try:
    doc = msgpack.unpackb(data, raw=False, strict_map_key=False)
  except Exception as e:  # msgpack raises several unrelated types on bad input.
    raise errors.CorruptSnapshotError(f"{what}: not valid msgpack ({e})") from e
  try:
    return _from_doc(doc)
  except (KeyError, TypeError, ValueError) as e:
    raise errors.CorruptSnapshotError(f"{what}: malformed ({e!r})") from e


def _int(x: Any, lo: int = 0) -> int:
  if type(x) is not int or x < lo:
    raise ValueError(f"expected int >= {lo}, got {x!r}")
  return x


def _str(x: Any) -> str:
  if not isinstance(x, str):
    raise TypeError(f"expected str, got {type(x).__name__}")
  return x


def _from_doc(doc: Any) -> Manifest:
  if not isinstance(doc, dict):
    raise TypeError("top level is not a map")
  if doc.get("format") != FORMAT:
    raise ValueError(f"format is {doc.get('format')!r}, not {FORMAT!r}")
  if doc.get("version") != VERSION:
    raise ValueError(f"version {doc.get('version')!r} is not supported (want {VERSION})")
  leaves = [spec_from_row(row) for row in doc["leaves"]]
  pieces = []
  for row in doc["pieces"]:
    leaf, index, offset, nbytes, crcs, owner, kind = row
    leaf = _int(leaf)
    if leaf >= len(leaves):
      raise ValueError(f"piece names leaf {leaf} of {len(leaves)}")
    idx = tuple((_int(a), _int(b)) for a, b in index)
    if len(idx) != len(leaves[leaf].shape) or any(
        not a <= b <= d for (a, b), d in zip(idx, leaves[leaf].shape)):
      raise ValueError(f"piece index {idx} outside leaf shape {leaves[leaf].shape}")
    pieces.append(PieceRecord(leaf, idx, _int(offset), _int(nbytes),
                              tuple(_int(c) for c in crcs), _int(owner), ChecksumKind(kind)))
  scalars = {}
  for k, v in doc["scalars"]:
    k = _int(k)
    if k >= len(leaves) or leaves[k].kind is not LeafKind.SCALAR:
      raise ValueError(f"scalar entry {k} is not a scalar leaf")
    if v is not None and not isinstance(v, SCALAR_TYPES):
      raise TypeError(f"scalar leaf {k} has type {type(v).__name__}")
    scalars[k] = v
  created = doc.get("created", 0.0)
  if not isinstance(created, (int, float)):
    raise TypeError("created is not a number")
  return Manifest(
      run_id=_str(doc["run_id"]), incarnation=_int(doc["incarnation"]),
      step=_int(doc["step"]), host=_int(doc["host"]),
      num_hosts=_int(doc["num_hosts"], 1), tree_digest=_str(doc["tree_digest"]),
      slot=_int(doc["slot"]), chunk_bytes=_int(doc["chunk_bytes"], 1),
      leaves=tuple(leaves), pieces=tuple(pieces), scalars=scalars,
      extra=doc.get("extra"), created=float(created))


def write_atomic(path: os.PathLike[str] | str, data: bytes, *,
                 before_rename: Callable[[], None] | None = None) -> None:
  """Writes ``data`` to ``path`` via a 0600 temp file and a rename."""
  tmp = f"{os.fspath(path)}.tmp.{os.getpid()}"
  fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
  try:
    view = memoryview(data)
    while view:
      view = view[os.write(fd, view):]
  finally:
    os.close(fd)
  if before_rename is not None:
    before_rename()
  os.replace(tmp, path)
