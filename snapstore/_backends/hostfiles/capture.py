"""Capture: take a state's shards out of reach of the next train step, then
drain them into a host-store slot with checksums.

``capture`` runs on the caller's thread and returns as soon as every shard is
safe from the next step:

* on CPU, a shard's ``np.asarray`` is a zero-copy view of the live buffer. While
  a view is alive, XLA will not donate that buffer (it copies instead), so the
  view is a stable source for the background copy: one memcpy in all.
* on accelerators, each leaf is dispatched to ``pinned_host`` memory with an
  async ``device_put``; the drain reads the host copy.

``drain`` copies each piece into the slot on a thread pool with its crc32c
(:func:`.._checksum.copy_crc`: one pass where :mod:`.._stream` is built),
then drops the sources so the next step may donate again.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from concurrent import futures
from typing import Any, cast

import jax
import numpy as np

from ... import _faults, _group, _parity
from ..._checksum import CACHE_BYTES, chunk_seeds, copy_crc, copy_crc_gather, first_seed, piece_key
from ..._index import Index, align, nbytes as index_nbytes, normalize
from ..._layout import (
  LeafKind,
  LeafSpec,
  Piece,
  addressable_data,
  addressable_pieces,
  batches,
  filled,
  piece_of,
)
from ..._placement import (
  HolderLayout,
  holder_layout,
  owners,
  replica_shardings,
  ring_keepers,
  ring_permutable,
  ring_permute,
  shard_arrays,
)


@dataclasses.dataclass(frozen=True)
class Packed:
  """A piece's bytes at ``start`` in ``row``, a device's uint8 buffer of
  received replica pieces (:func:`.._placement.ring_permute`)."""

  row: jax.Array
  start: int


# A piece's bytes: a host view (pinned against donation), a jax.Array read
# by ``np.asarray`` in the drain (a host copy landing), or its place in a
# received row.
Source = np.ndarray | jax.Array | Packed


@dataclasses.dataclass
class Capture:
  specs: list[LeafSpec]
  pieces: list[Piece]
  owners: list[int]
  sources: list[Source]
  scalars: dict[int, Any]
  # (stripe, block) of each parity piece -> (members, layout, length)
  parity: dict[tuple[int, int], tuple[tuple[int, ...], tuple[Any, ...], int]] = \
      dataclasses.field(default_factory=dict)

  @property
  def nbytes(self) -> int:
    return sum(align(p.nbytes) for p in self.pieces)

  def release(self) -> None:
    self.sources = []


@dataclasses.dataclass
class Transfer:
  """One leaf's move to one ring shift: the replica sharding says which
  device receives which shard."""

  leaf: int
  arr: jax.Array
  replica_sharding: jax.sharding.NamedSharding
  owner_of: dict[Any, int]
  mine: set[Any]

  def received(self, rows: jax.sharding.Sharding) -> tuple[tuple[int, Index, int], ...]:
    """(receiving device id, global index, bytes) of each shard of ``arr``
    that a device of this host receives, ``rows`` holding one received
    buffer per device."""
    return _received_plan(self.arr.sharding, self.replica_sharding, tuple(self.arr.shape),
                          rows, np.dtype(self.arr.dtype).itemsize)


@functools.lru_cache(maxsize=4096)
def _received_plan(src: jax.sharding.NamedSharding, dst: jax.sharding.NamedSharding,
                   shape: tuple[int, ...], out: jax.sharding.Sharding, itemsize: int
                   ) -> tuple[tuple[int, Index, int], ...]:
  """(receiving device id, global index, bytes) of each shard ``out`` holds
  here: the same for every save of a leaf, so computed once."""
  inverse = dict(zip(dst.mesh.devices.flat, src.mesh.devices.flat, strict=True))
  idx_map = src.devices_indices_map(shape)
  plan = []
  devices: set[jax.Device] = out.addressable_devices
  for device in devices:
    index = normalize(idx_map[inverse[device]], shape)
    plan.append((device.id, index, index_nbytes(index, itemsize)))
  return tuple(sorted(plan))


def _bytes_of(x: np.ndarray | jax.Array) -> np.ndarray:
  """The bytes of a source: a host view as it is (the usual case: one
  ``reshape`` and one ``view``), else its host copy, made contiguous."""
  if type(x) is not np.ndarray or not x.flags.c_contiguous:
    x = np.ascontiguousarray(np.asarray(x))
  return x.reshape(-1).view(np.uint8)


@functools.lru_cache(maxsize=1 << 16)  # the same pieces every snapshot
def _chunk_plan(path: str, index: Index, nbytes: int, chunk_bytes: int
                ) -> tuple[tuple[int, int, int], ...]:
  """(start, end, crc32c seed) of each ``chunk_bytes`` chunk of a piece."""
  starts = range(0, max(nbytes, 1), chunk_bytes)
  seeds = chunk_seeds(piece_key(path, index), len(starts))
  return tuple((a, min(a + chunk_bytes, nbytes), seed)
               for a, seed in zip(starts, seeds, strict=True))


def capture(specs: Sequence[LeafSpec], leaves: Sequence[Any], *,
            host: int, domains: dict[int, int] | None = None,
            replicas: int = 0, step: int = -1,
            replica_batch_bytes: int = 64 << 20,
            stripes: _parity.Stripes | None = None) -> Capture:
  """Takes a stable reference to every addressable piece of ``leaves``.

  With ``domains`` and ``replicas`` (multi-host), also receives, by a JAX
  resharding onto a ring-permuted mesh, the replica pieces this host keeps
  for hosts of other domains; with ``stripes`` instead, the parity blocks of
  its stripes (:mod:`.._parity`; a leaf the parity collective cannot carry,
  not evenly sharded over every device, still travels as a full replica).
  Collective then: every host calls it with the same state.
  """
  cap = Capture(list(specs), [], [], [], {})
  middle = len(specs) // 2
  transfers: list[Transfer] = []
  protect: list[tuple[int, jax.Array]] = []
  arrays = staged(specs, leaves)
  for i, (spec, leaf) in enumerate(zip(specs, leaves, strict=True)):
    if i == middle:
      _faults.point("capture", step)
    if spec.kind is LeafKind.SCALAR:
      cap.scalars[i] = leaf
      continue
    if spec.kind is LeafKind.NUMPY:
      _add_numpy(cap, i, leaf, host)
      continue
    raw, arr, on_cpu = arrays[i]
    pieces, data = addressable_data(i, arr)
    cap.pieces.extend(pieces)
    cap.owners.extend([host] * len(pieces))
    # On CPU a view of each shard, which blocks until the step computed it
    # (and pins its buffer: see the module doc); else the pinned_host copy.
    cap.sources.extend(list(map(np.asarray, data)) if on_cpu else data)
    if domains is None or replicas == 0:
      continue
    mine = {p.index for p in pieces}
    shardings = replica_shardings(arr.sharding, tuple(arr.shape), domains, replicas)
    if shardings and stripes is not None and _parity.evenly_sharded(stripes, raw):
      protect.append((i, raw))  # in device memory (``arr`` may be its pinned_host copy)
    elif shardings:
      owner_of = owners(arr.sharding, tuple(arr.shape))
      transfers.extend(Transfer(i, arr, rs, owner_of, mine) for rs in shardings)
  _replicate(cap, transfers, step=step, batch_bytes=replica_batch_bytes)
  if protect and stripes is not None:  # (protect is filled only with stripes)
    _add_parity(cap, stripes, protect, host=host, step=step)
  return cap


def _add_parity(cap: Capture, st: _parity.Stripes, protect: Sequence[tuple[int, jax.Array]],
                *, host: int, step: int) -> None:
  """Computes the parity of ``protect`` over ``st`` (one collective) and
  adds the blocks this host keeps, one per local device."""
  layouts, length = _parity.layout(st, [i for i, _ in protect], [a for _, a in protect])
  out = _parity.encode(st, [a for _, a in protect], length, order=_group.devices())
  _faults.point("replica", step)
  for shard in out.addressable_shards:
    s, j = st.where[shard.device]
    key = (st.stripe_id(s), j)
    members = tuple(int(st.grid[s, m].process_index) for m in range(st.n))
    layout: tuple[tuple[tuple[int, Index], ...], ...] = tuple(
        layouts[s * st.n + m] for m in range(st.n))
    cap.pieces.append(Piece(_parity.PARITY_LEAF, (key,), length // st.k))
    cap.owners.append(host)
    cap.sources.append(shard.data)  # a fresh buffer: the drain waits for it
    cap.parity[key] = (members, layout, length)


def _replicate(cap: Capture, transfers: Sequence[Transfer], *, step: int,
               batch_bytes: int) -> None:
  """Receives this host's replica pieces: batches of leaves move in one
  jitted collective permute each (``_placement.ring_permute``); a leaf the
  permute cannot carry (not over all devices, uneven shards) moves alone by
  ``jax.device_put`` onto its ring-permuted sharding."""
  fast = [t for t in transfers if ring_permutable(t.arr)]
  for t in transfers:
    if not ring_permutable(t.arr):
      rep = jax.device_put(t.arr, t.replica_sharding)
      _faults.point("replica", step)
      for piece, data in addressable_pieces(t.leaf, rep):
        _add_replica(cap, t, piece, data)
  sizes = [t.arr.nbytes // len(t.arr.sharding.device_set) for t in fast]
  for batch in batches(sizes, batch_bytes):
    group = [fast[j] for j in batch]
    moved = ring_permute([t.arr for t in group], [t.replica_sharding for t in group])
    _faults.point("replica", step)
    for buf, which, offsets in moved:  # the drain reads each row once, as bytes
      rows = {s.device.id: s.data for s in buf.addressable_shards}
      for j, start in zip(which, offsets, strict=True):
        t = group[j]
        for device_id, index, nbytes in t.received(buf.sharding):
          if index not in t.mine:
            t.mine.add(index)
            cap.pieces.append(Piece(t.leaf, index, nbytes))
            cap.owners.append(t.owner_of[index])
            cap.sources.append(Packed(rows[device_id], start))


def _plain(spec: LeafSpec, leaf: Any) -> jax.Array:
  """The leaf as a plain array (key data for keys), where the state holds it."""
  return jax.random.key_data(leaf) if spec.kind is LeafKind.KEY else leaf


@functools.lru_cache(maxsize=4096)
def _on_cpu(sharding: jax.sharding.Sharding) -> bool:
  devices: set[jax.Device] = sharding.device_set
  return all(d.platform == "cpu" for d in devices)


def staged(specs: Sequence[LeafSpec], leaves: Sequence[Any]
           ) -> dict[int, tuple[jax.Array, jax.Array, bool]]:
  """leaf position -> (the array leaf as a plain array, the array its pieces
  are read from, whether it is on CPU), for every array leaf. On
  accelerators that is a ``pinned_host`` copy, dispatched asynchronously,
  all leaves in one ``device_put`` (JAX batches the transfers of a list in
  C++: one call a leaf costs Python per leaf on the training thread, every
  snapshot). On CPU, the leaf itself (its shards' views are the source)."""
  out: dict[int, tuple[jax.Array, jax.Array, bool]] = {}
  moves: list[int] = []
  for i, (spec, leaf) in enumerate(zip(specs, leaves, strict=True)):
    if spec.kind in (LeafKind.SCALAR, LeafKind.NUMPY):
      continue
    raw = _plain(spec, leaf)
    here = _on_cpu(raw.sharding)
    out[i] = (raw, raw, here)
    if not here:
      moves.append(i)
  if moves:
    raws = [out[i][0] for i in moves]
    pinned = jax.device_put(raws, [r.sharding.with_memory_kind("pinned_host") for r in raws])
    for i, arr in zip(moves, pinned, strict=True):
      out[i] = (out[i][0], arr, False)
  return out


def _add_numpy(cap: Capture, leaf_idx: int, leaf: Any, owner: int) -> None:
  # numpy leaves are mutable by the caller: copy now (they are small).
  data = np.array(leaf, copy=True)
  cap.pieces.append(Piece(leaf_idx, tuple((0, n) for n in data.shape), data.nbytes))
  cap.owners.append(owner)
  cap.sources.append(data)


def _add_replica(cap: Capture, t: Transfer, piece: Piece, data: jax.Array) -> None:
  if piece.index not in t.mine:
    t.mine.add(piece.index)
    # A received replica is a fresh buffer that no step donates: the drain
    # thread waits for the transfer, not the training loop.
    cap.pieces.append(piece)
    cap.owners.append(t.owner_of[piece.index])
    cap.sources.append(data)


def layout_offsets(pieces: Sequence[Piece]) -> list[int]:
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
  smalls: list[Small] = []
  small_at: list[int] = []  # which piece each small one is
  rows: dict[int, np.ndarray] = {}  # id(row) -> its bytes (the drain waits for the move)
  specs = cap.specs
  limit = min(CACHE_BYTES, chunk_bytes)
  for j, (source, piece, at) in enumerate(zip(cap.sources, cap.pieces, offsets, strict=True)):
    more = twins[j] if twins is not None else ()
    if type(source) is np.ndarray and source.flags.c_contiguous:  # a view (CPU)
      src = source.reshape(-1).view(np.uint8)
    elif isinstance(source, Packed):
      row = rows.get(id(source.row))
      if row is None:
        row = rows[id(source.row)] = np.asarray(source.row)
      src = row[source.start:source.start + piece.nbytes]
    else:
      src = _bytes_of(source)
    n = piece.nbytes
    if src.nbytes != n:
      raise ValueError(f"piece of leaf {piece.leaf} has {src.nbytes} bytes, expected {n}")
    path = _parity.PARITY_PATH if piece.leaf == _parity.PARITY_LEAF else specs[piece.leaf].path
    if n <= limit and not more:
      smalls.append((src, at, first_seed(path, piece.index)))
      small_at.append(j)
      continue
    plan = _chunk_plan(path, piece.index, n, chunk_bytes)
    chunks.extend([(src, at, a, b, seed, more) for a, b, seed in plan])
    per_piece.append((j, len(plan)))
  # Pieces travel together: one task per ~chunk_bytes, not one per piece
  # (twins are written too).
  running = [pool.submit(copy_chunks, b) for b in
             filled(chunks, [(c[3] - c[2]) * (1 + len(c[5])) for c in chunks], chunk_bytes)]
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
  flat = [crc for f in running for crc in f.result()]
  crcs: list[tuple[int, ...]] = [()] * len(cap.pieces)
  for j, crc in zip(small_at, small_crcs, strict=True):
    crcs[j] = (crc,)
  at = 0
  for j, n in per_piece:
    crcs[j] = tuple(flat[at:at + n])
    at += n
  cap.release()
  return crcs


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


def capture_by_domain(specs: Sequence[LeafSpec], leaves: Sequence[Any], *,
                      domain_of: dict[jax.Device, int], replicas: int,
                      step: int = -1) -> dict[int, Capture]:
  """Single controller (Pathways): one Capture per failure domain (slice).

  Every piece goes to each domain whose devices hold it; a piece held by
  fewer than ``1 + replicas`` domains is also kept by the next domains in
  ring order (its bytes written to their stores), so losing its own domain
  leaves a copy. Numpy leaves and scalars go to every domain.
  """
  order = sorted(set(domain_of.values()))
  caps = {d: Capture(list(specs), [], [], [], {}) for d in order}  # only active domains
  arrays = staged(specs, leaves)
  for i, (spec, leaf) in enumerate(zip(specs, leaves, strict=True)):
    if i == len(specs) // 2:
      _faults.point("capture", step)
    if spec.kind is LeafKind.SCALAR:
      for cap in caps.values():
        cap.scalars[i] = leaf
      continue
    if spec.kind is LeafKind.NUMPY:
      for d, cap in caps.items():
        _add_numpy(cap, i, leaf, d)
      continue
    _, arr, on_cpu = arrays[i]
    views_at, rows = _domain_rows(i, holder_layout(spec.path, arr, domain_of), tuple(order),
                                  replicas, arr.dtype.itemsize)
    shards = shard_arrays(arr)
    # On CPU, one view per index, which pins its buffer (see the module
    # doc): drain_domains reads a piece's first copy and writes the others
    # (data-parallel twins, the same bytes) from the cache.
    views = [np.asarray(shards[at]) for at in views_at] if on_cpu else []
    for d, pieces, owners_, which, sources in rows:
      caps[d].pieces.extend(pieces)
      caps[d].owners.extend(owners_)
      caps[d].sources.extend([views[k] for k in which] if on_cpu
                             else [shards[at] for at in sources])
  return caps


@functools.lru_cache(maxsize=1 << 16)  # one entry a leaf: a state has thousands
def _domain_rows(leaf: int, layout: HolderLayout, order: tuple[int, ...], replicas: int,
                 itemsize: int
                 ) -> tuple[tuple[int, ...],
                            tuple[tuple[int, tuple[Piece, ...], tuple[int, ...], tuple[int, ...],
                                        tuple[int, ...]], ...]]:
  """A leaf's copies per domain, from its layout alone (the same every save;
  a state has thousands of copies): the shard position of each index's view
  (its first keeper's source), and per keeping domain (domain, pieces,
  owners, which view, the shard position each copy is read from: the
  domain's own, else the owner's)."""
  views: list[int] = []
  per: dict[int, list[tuple[Piece, int, int, int]]] = {d: [] for d in order}
  for index, held in layout:
    at_of = dict(held)
    owner = min(at_of)
    piece = piece_of(leaf, index, index_nbytes(index, itemsize))
    keepers = ring_keepers(at_of, order, replicas)
    view = len(views)
    views.append(at_of.get(keepers[0], at_of[owner]))
    for d in keepers:
      per[d].append((piece, owner, view, at_of.get(d, at_of[owner])))
  # (each rows' columns, transposed: domain, pieces, owners, views, positions)
  columns = tuple((d, *map(tuple, zip(*rows, strict=True))) for d, rows in per.items() if rows)
  return tuple(views), cast(tuple[tuple[int, tuple[Piece, ...], tuple[int, ...],
                                        tuple[int, ...], tuple[int, ...]], ...], columns)
