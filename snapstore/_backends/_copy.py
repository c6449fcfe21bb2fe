"""The copy both backends drain: a capture's pieces into a host buffer, checked.

A :class:`Capture` is what a backend's capture leaves for the drain thread:
per piece its owner and its source (a host view pinned against donation, a
device array landing in host memory, or its place in a received row of
replica pieces). :func:`drain` copies every piece into a buffer at its
offset with its crc32c per chunk (:func:`snapstore._checksum.copy_crc`: one
pass where the C extension is built), then drops the sources so the next
step may donate again; :func:`drain_domains` drains several failure
domains' captures at once, writing a twin piece from the cache;
:func:`drain_and_commit` does that for stores of slot buffers and commits
each store's manifest (:func:`commit`, which every backend's drain ends
with). :func:`verified_piece` is the other way: a stored host copy back
into memory of the caller's own, checked as it is made.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent import futures
from typing import Any

import jax
import numpy as np

from .. import _parity
from .._checksum import (
  CACHE_BYTES,
  ChecksumKind,
  chunk_seeds,
  copy_crc,
  copy_crc_gather,
  copy_verified,
  first_seed,
  piece_key,
)
from .._index import Index, align, shape_of
from .._manifest import Manifest, PieceRecord, piece_row, split_parity
from .._tree import LeafSpec, Piece, filled
from ..options import SnapshotOptions
from .base import Header, retain
from .staging import Parts, Report


@dataclasses.dataclass(frozen=True)
class Packed:
  """A piece's bytes at ``start`` in ``row``, a device's uint8 buffer of
  received replica pieces (:func:`.._placement.ring_permute`)."""

  row: jax.Array
  start: int


# A piece's bytes: a host view (pinned against donation), a jax.Array read
# by ``np.asarray`` in the drain (a host copy landing), its place in a
# received row, or its staged parts (:mod:`.staging`).
Source = np.ndarray | jax.Array | Packed | Parts


@dataclasses.dataclass
class Capture:
  """A capture's pieces for the drain: ``pieces[j]``, kept for store
  ``owners[j]``, read from ``sources[j]``. Three aligned lists, not a record
  per piece: a save of thousands of leaves appends them on the training
  thread, and every reader zips them with ``strict=True``."""

  specs: list[LeafSpec]
  pieces: list[Piece]
  owners: list[int]
  sources: list[Source]
  scalars: dict[int, Any]
  # (stripe, block) of each parity piece -> (members, layout, length)
  parity: dict[tuple[int, int], tuple[tuple[int, ...], tuple[Any, ...], int]] = \
      dataclasses.field(default_factory=dict)
  staged: Report = dataclasses.field(default_factory=Report)  # what staging did

  @property
  def nbytes(self) -> int:
    return sum(align(p.nbytes) for p in self.pieces)

  def release(self) -> None:
    self.sources = []


def _bytes_of(x: np.ndarray | jax.Array) -> np.ndarray:
  """The bytes of a source: a host view as it is (the usual case: one
  ``reshape`` and one ``view``), else its host copy, made contiguous."""
  if type(x) is not np.ndarray or not x.flags.c_contiguous:
    x = np.ascontiguousarray(np.asarray(x))
  return x.reshape(-1).view(np.uint8)


def _bytes_from(source: Source, piece: Piece, rows: dict[int, np.ndarray]) -> np.ndarray:
  """The bytes of a source that is not a view: its place in a received row
  (``rows``: id(row) -> its bytes, each row read once: the drain waits for
  the move), a one-part staged piece, or a host copy (:func:`_bytes_of`)."""
  if isinstance(source, Packed):
    row = rows.get(id(source.row))
    if row is None:
      row = rows[id(source.row)] = np.asarray(source.row)
    return row[source.start:source.start + piece.nbytes]
  if isinstance(source, Parts):
    return source.take(0)
  return _bytes_of(source)


@functools.lru_cache(maxsize=1 << 16)  # the same pieces every snapshot
def _chunks_of(path: str, index: Index, nbytes: int, chunk_bytes: int
                ) -> tuple[tuple[int, int, int], ...]:
  """(start, end, crc32c seed) of each ``chunk_bytes`` chunk of a piece."""
  starts = range(0, max(nbytes, 1), chunk_bytes)
  seeds = chunk_seeds(piece_key(path, index), len(starts))
  return tuple((a, min(a + chunk_bytes, nbytes), seed)
               for a, seed in zip(starts, seeds, strict=True))


def slot_offsets(pieces: Sequence[Piece]) -> list[int]:
  offsets, off = [], 0
  for p in pieces:
    offsets.append(off)
    off += align(p.nbytes)
  return offsets


#: Small pieces (one chunk, at most this many bytes) are copied and checked
#: in tasks of about this many bytes (their Python, not their bytes, is the
#: cost: fewer tasks hand off less between threads).
SMALL_TASK_BYTES = 4 << 20


def drain(cap: Capture, dst: np.ndarray, offsets: Sequence[int], *,
          pool: futures.Executor, chunk_bytes: int,
          twins: Sequence[Sequence[tuple[np.ndarray, int]]] | None = None
          ) -> list[tuple[int, ...]]:
  """Copies every piece into ``dst`` at ``offsets``; returns each piece's
  crc32c per chunk (``ChecksumKind.CRC32C``, seeded by :func:`piece_key`),
  computed while it is hot in cache. ``twins[j]``: more (buffer, offset)
  places for piece ``j``'s bytes, written from the cache as they pass."""

  # (source bytes, at, start, end, seed, twin places)
  Chunk = tuple[np.ndarray, int, int, int, int, Sequence[tuple[np.ndarray, int]]]
  # a small piece without twins (most pieces of a many-leaves state):
  # (source bytes, at, seed)
  Small = tuple[np.ndarray, int, int]

  def copy_chunks(batch: list[Chunk]) -> list[int]:
    return [copy_crc(dst[at + a: at + b], src if b - a == src.nbytes else src[a:b], seed,
                     [buf[t + a: t + b] for buf, t in more] if more else ())
            for src, at, a, b, seed, more in batch]

  def copy_small(batch: list[Small]) -> list[int]:
    return copy_crc_gather(dst, batch)  # (one call: no Python a piece in the copy)

  chunks: list[Chunk] = []
  per_piece: list[tuple[int, int]] = []  # (which piece, its chunks) of each big piece
  staged: list[_StagedChunk] = []
  per_staged: list[tuple[int, int]] = []  # (which piece, its chunks) of each staged one
  smalls: list[Small] = []
  small_at: list[int] = []  # which piece each small one is
  rows: dict[int, np.ndarray] = {}  # id(row) -> its bytes (the drain waits for the move)
  specs = cap.specs
  limit = min(CACHE_BYTES, chunk_bytes)
  for j, (source, piece, at) in enumerate(zip(cap.sources, cap.pieces, offsets, strict=True)):
    more = twins[j] if twins is not None else ()
    if type(source) is np.ndarray and source.flags.c_contiguous:  # a view (CPU)
      src = source.reshape(-1).view(np.uint8)
    elif isinstance(source, Parts) and len(source.arrays) > 1:
      cuts = _staged_chunks(source, specs[piece.leaf].path, piece, chunk_bytes)
      staged.extend([(source, at, seed, more, ks) for ks, seed in cuts])
      per_staged.append((j, len(cuts)))
      continue
    else:
      src = _bytes_from(source, piece, rows)
    n = piece.nbytes
    if src.nbytes != n:
      raise ValueError(f"piece of leaf {piece.leaf} has {src.nbytes} bytes, expected {n}")
    path = _parity.PARITY_PATH if piece.leaf == _parity.PARITY_LEAF else specs[piece.leaf].path
    if n <= limit and not more:
      smalls.append((src, at, first_seed(path, piece.index)))
      small_at.append(j)
      continue
    plan = _chunks_of(path, piece.index, n, chunk_bytes)
    chunks.extend([(src, at, a, b, seed, more) for a, b, seed in plan])
    per_piece.append((j, len(plan)))
  # Pieces travel together: one task per ~chunk_bytes, not one per piece
  # (twins are written too).
  running = [pool.submit(copy_chunks, b) for b in
             filled(chunks, [(c[3] - c[2]) * (1 + len(c[5])) for c in chunks], chunk_bytes)]
  landing = _submit_staged(pool, dst, staged, chunk_bytes)
  # Small pieces: half their tasks on the pool, half on this thread (two
  # threads overlap one's copies, which release the GIL above 16 KiB, with
  # the other's Python).
  tasks: list[list[Small]] = filled(smalls, [sm[0].nbytes for sm in smalls],
                                     SMALL_TASK_BYTES)
  there = [pool.submit(copy_small, t) for t in tasks[1::2]]
  here = [copy_small(t) for t in tasks[0::2]]
  small_crcs: list[int] = []
  for i in range(len(tasks)):
    small_crcs.extend(here[i // 2] if i % 2 == 0 else there[i // 2].result())
  crcs: list[tuple[int, ...]] = [()] * len(cap.pieces)
  for j, crc in zip(small_at, small_crcs, strict=True):
    crcs[j] = (crc,)
  _spread(crcs, per_piece, running)
  _spread(crcs, per_staged, landing)
  cap.release()
  return crcs


def _spread(crcs: list[tuple[int, ...]], per_piece: Sequence[tuple[int, int]],
            tasks: Sequence[futures.Future[list[int]]]) -> None:
  """Sets ``crcs[j]`` of each ``(j, chunks)`` of ``per_piece`` from the
  tasks' results, the pieces' chunks in order."""
  flat = [crc for f in tasks for crc in f.result()]
  at = 0
  for j, n in per_piece:
    crcs[j] = tuple(flat[at:at + n])
    at += n


# a chunk of a staged piece: (its parts, at, crc32c seed, twin places, which parts)
_StagedChunk = tuple[Parts, int, int, Sequence[tuple[np.ndarray, int]], range]


def _submit_staged(pool: futures.Executor, dst: np.ndarray, staged: Sequence[_StagedChunk],
                   chunk_bytes: int) -> list[futures.Future[list[int]]]:
  """Copies the staged pieces' chunks into ``dst`` on the pool, one task per
  ~``chunk_bytes``; each task's crc32c per chunk. Each part is read once, as
  it lands, then dropped (its device and host memory go then)."""

  def copy_staged(batch: list[_StagedChunk]) -> list[int]:
    out = []
    for parts, at, seed, more, ks in batch:
      crc = seed
      for k in ks:
        a, b = parts.bounds[k], parts.bounds[k + 1]
        crc = copy_crc(dst[at + a: at + b], parts.take(k), crc,
                       [buf[t + a: t + b] for buf, t in more])
      out.append(crc)
    return out
  sizes = [(c[0].bounds[c[4][-1] + 1] - c[0].bounds[c[4][0]]) * (1 + len(c[3])) for c in staged]
  return [pool.submit(copy_staged, b) for b in filled(list(staged), sizes, chunk_bytes)]


def _staged_chunks(parts: Parts, path: str, piece: Piece, chunk_bytes: int
                   ) -> list[tuple[range, int]]:
  """(its parts, crc32c seed) of each ``chunk_bytes`` chunk of a staged
  piece: the parts must tile the piece and end on every chunk's bounds."""
  n = piece.nbytes
  if parts.bounds[0] != 0 or parts.bounds[-1] != n:
    raise ValueError(f"staged parts of leaf {path!r} span {parts.bounds[0]}:"
                     f"{parts.bounds[-1]}, expected 0:{n}")
  at = {b: k for k, b in enumerate(parts.bounds)}
  out = []
  for a, b, seed in _chunks_of(path, piece.index, n, chunk_bytes):
    ka, kb = at.get(a), at.get(b)
    if ka is None or kb is None or kb <= ka:
      raise ValueError(f"staged parts of leaf {path!r} straddle its chunk {a}:{b}")
    out.append((range(ka, kb), seed))
  return out


def drain_domains(caps: Mapping[int, Capture], bufs: Mapping[int, np.ndarray],
                  offsets: Mapping[int, Sequence[int]], *, pool: futures.Executor,
                  chunk_bytes: int) -> dict[int, list[tuple[int, ...]]]:
  """:func:`drain` of several domains' captures (single controller), each
  into its own buffer. A piece an earlier domain keeps too (a data-parallel
  twin) is written from the cache as that domain's copy passes: the same
  checked bytes, one read of memory and one crc32c for both (its own
  source is not read)."""
  if len(caps) == 1:  # one store (multi-controller): nothing to share
    (d, cap), = caps.items()
    return {d: drain(cap, bufs[d], offsets[d], pool=pool, chunk_bytes=chunk_bytes)}
  first: dict[tuple[int, Index], tuple[int, int]] = {}  # piece -> (domain, j)
  twins: dict[tuple[int, int], list[tuple[np.ndarray, int]]] = {}
  twin_of: dict[tuple[int, int], tuple[int, int]] = {}
  for d, cap in caps.items():
    for j, p in enumerate(cap.pieces):
      seen = first.setdefault((p.leaf, p.index), (d, j))
      if seen != (d, j):
        twins.setdefault(seen, []).append((bufs[d], offsets[d][j]))
        twin_of[(d, j)] = seen
  crcs: dict[tuple[int, int], tuple[int, ...]] = {}
  for d, cap in caps.items():
    own = [j for j in range(len(cap.pieces)) if (d, j) not in twin_of]
    part = Capture(cap.specs, [cap.pieces[j] for j in own], [cap.owners[j] for j in own],
                   [cap.sources[j] for j in own], {})
    got = drain(part, bufs[d], [offsets[d][j] for j in own], pool=pool,
                chunk_bytes=chunk_bytes, twins=[twins.get((d, j), ()) for j in own])
    crcs.update(((d, j), c) for j, c in zip(own, got, strict=True))
  for cap in caps.values():
    cap.release()
  return {d: [crcs[twin_of.get((d, j), (d, j))] for j in range(len(cap.pieces))]
          for d, cap in caps.items()}


def commit(store: Any, header: Header, rows: Iterable[tuple[Any, ...]],
           parity_of: Mapping[tuple[int, int], tuple[Any, ...]], *, slot: int,
           scalars: Mapping[int, Any], options: SnapshotOptions) -> None:
  """Commits one store's snapshot in ``slot``: its manifest from the pieces'
  :func:`.._manifest.piece_row` rows (rows, not records: nothing per piece
  outlives the drain as an object the garbage collector tracks; see
  PieceTable), then retention (:attr:`Header.retain`)."""
  pieces, parity = split_parity(rows, parity_of)
  store.commit(Manifest(pieces=pieces, created=time.time(), store=store.host, slot=slot,
                        scalars=dict(scalars), parity=parity, **header.fields()))
  retain(store, options.keep, options.carries_replicas, superseded_only=not header.retain)


def drain_and_commit(jobs: Sequence[tuple[Any, Capture, int]], header: Header, *,
                     pool: futures.Executor, options: SnapshotOptions) -> int:
  """Drains each ``(store, capture, slot)`` into ``store.slot_buffer(slot)``,
  every store's pieces in one pass (:func:`drain_domains`: a data-parallel
  twin is copied once from its source), and commits each store's manifest.
  Returns the bytes stored."""
  offsets = {store.host: slot_offsets(cap.pieces) for store, cap, _ in jobs}
  crcs_of = drain_domains({store.host: cap for store, cap, _ in jobs},
                          {store.host: store.slot_buffer(slot) for store, _, slot in jobs},
                          offsets, pool=pool, chunk_bytes=options.chunk_bytes)
  for store, cap, slot in jobs:
    rows = (piece_row(p.leaf, p.index, off, p.nbytes, c, owner, ChecksumKind.CRC32C)
            for p, off, c, owner in zip(cap.pieces, offsets[store.host], crcs_of[store.host],
                                        cap.owners, strict=True))
    commit(store, header, rows, cap.parity, slot=slot, scalars=cap.scalars, options=options)
  return sum(cap.nbytes for _, cap, _ in jobs)


def verified_piece(raw: np.ndarray, rec: PieceRecord, path: str, dtype: np.dtype, *,
                   chunk_bytes: int, pool: futures.Executor | None,
                   out: np.ndarray | None = None) -> np.ndarray | None:
  """A private copy of a stored host copy ``raw``, each chunk checked against
  its crc32c as it is made, typed and shaped like its piece; None if one does
  not match (or ``rec`` has no crc32c). ``out``: memory of the caller's own
  to copy into, on the calling thread (``pool`` is used only without it).

  Private, because a store's memory may be rewritten or shrunk by a later
  save (or another process), and ``device_put`` may alias a page-aligned
  host buffer instead of copying it."""
  if rec.kind is not ChecksumKind.CRC32C:
    return None
  got = copy_verified(raw, rec.checksum, chunk_bytes=chunk_bytes, key=piece_key(path, rec.index),
                      pool=pool if out is None else None, out=out)
  if got is None:
    return None
  return got.view(dtype) if rec.leaf < 0 else got.view(dtype).reshape(shape_of(rec.index))
