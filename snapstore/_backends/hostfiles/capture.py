"""Capture for host files: take a state's shards out of reach of the next
train step (the drain that follows is :mod:`.._copy`'s).

``capture`` runs on the caller's thread and returns as soon as every shard is
safe from the next step:

* on CPU, a shard's ``np.asarray`` is a zero-copy view of the live buffer. While
  a view is alive, XLA will not donate that buffer (it copies instead), so the
  view is a stable source for the background copy: one memcpy in all.
* on accelerators (``Staging.AUTO``; on CPU too with ``Staging.ALWAYS``),
  each shard is copied in device memory and cut into pieces whose copies to
  host memory are under way when ``capture`` returns; what does not fit the
  staging budget has landed by then (:mod:`..staging`). The drain reads the
  pieces into the slot at their offsets.
* with ``Staging.NEVER``, each leaf is dispatched to ``pinned_host`` memory
  with an async ``device_put``; the drain reads the host copy.

Replicas travel between hosts on the ring (:func:`snapstore._placement.ring_permute`);
a single controller captures per failure domain (:func:`capture_by_domain`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any, cast

import jax
import numpy as np

from ... import _devices, _faults, _parity
from ..._index import Index, nbytes as index_nbytes, normalize
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
from ..._tree import (
  LeafKind,
  LeafSpec,
  Piece,
  addressable_data,
  addressable_pieces,
  batches,
  piece_of,
)
from ...options import Staging
from .._copy import Capture, Packed
from ..staging import Read, Stager, staged


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


def capture(specs: Sequence[LeafSpec], leaves: Sequence[Any], *,
            host: int, domains: dict[int, int] | None = None,
            replicas: int = 0, step: int = -1,
            replica_batch_bytes: int = 64 << 20,
            stripes: _parity.Stripes | None = None,
            stager: Stager | None = None, staging: Staging = Staging.AUTO) -> Capture:
  """Takes a stable reference to every addressable piece of ``leaves``.

  With ``domains`` and ``replicas`` (multi-host), also receives, by a JAX
  resharding onto a ring-permuted mesh, the replica pieces this host keeps
  for hosts of other domains; with ``stripes`` instead, the parity blocks of
  its stripes (:mod:`.._parity`; a leaf the parity collective cannot carry,
  not evenly sharded over every device, still travels as a full replica).
  Collective then: every host calls it with the same state.

  With a ``stager`` (and ``staging`` not ``NEVER``), array leaves are staged
  (:meth:`..staging.Stager.stage`; it blocks only for what does not fit
  its budget). Call it from the training thread.
  """
  cap = Capture(list(specs), [], [], [], {})
  middle = len(specs) // 2
  transfers: list[Transfer] = []
  protect: list[tuple[int, jax.Array]] = []
  arrays = staged(specs, leaves, staging if stager is not None else Staging.NEVER)
  to_stage: list[int] = []  # positions in cap.sources of the shards to stage
  for i, (spec, leaf) in enumerate(zip(specs, leaves, strict=True)):
    if i == middle:
      _faults.point("capture", step)
    if spec.kind is LeafKind.SCALAR:
      cap.scalars[i] = leaf
      continue
    if spec.kind is LeafKind.NUMPY:
      _add_numpy(cap, i, leaf, host)
      continue
    raw, arr, how = arrays[i]
    pieces, data = addressable_data(i, arr)
    cap.pieces.extend(pieces)
    cap.owners.extend([host] * len(pieces))
    # On CPU a view of each shard, which blocks until the step computed it
    # (and pins its buffer: see the module doc); else its staged parts (set
    # below), or the pinned_host copy.
    if how is Read.STAGE:
      to_stage.extend(range(len(cap.sources), len(cap.sources) + len(data)))
    cap.sources.extend(list(map(np.asarray, data)) if how is Read.VIEW else data)
    if domains is None or replicas == 0:
      continue
    mine = {p.index for p in pieces}
    shardings = replica_shardings(arr.sharding, tuple(arr.shape), domains, replicas)
    if shardings and stripes is not None and _parity.evenly_sharded(stripes, raw):
      protect.append((i, raw))  # in device memory (``arr`` may be its pinned_host copy)
    elif shardings:
      owner_of = owners(arr.sharding, tuple(arr.shape))
      transfers.extend(Transfer(i, arr, rs, owner_of, mine) for rs in shardings)
  if to_stage and stager is not None:
    got, cap.staged = stager.stage([cast(jax.Array, cap.sources[k]) for k in to_stage])
    for k, source in zip(to_stage, got, strict=True):
      cap.sources[k] = source
  _replicate(cap, transfers, step=step, batch_bytes=replica_batch_bytes)
  if protect and stripes is not None:  # (protect is filled only with stripes)
    _add_parity(cap, stripes, protect, host=host, step=step)
  return cap


def _add_parity(cap: Capture, st: _parity.Stripes, protect: Sequence[tuple[int, jax.Array]],
                *, host: int, step: int) -> None:
  """Computes the parity of ``protect`` over ``st`` (one collective) and
  adds the blocks this host keeps, one per local device."""
  layouts, length = _parity.layout(st, [i for i, _ in protect], [a for _, a in protect])
  out = _parity.encode(st, [a for _, a in protect], length, order=_devices.devices())
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


class _Later:
  """A placeholder source: view ``k`` of a capture's staged shards."""

  __slots__ = ("k",)

  def __init__(self, k: int) -> None:
    self.k = k


def capture_by_domain(specs: Sequence[LeafSpec], leaves: Sequence[Any], *,
                      domain_of: dict[jax.Device, int], replicas: int,
                      step: int = -1, stager: Stager | None = None,
                      staging: Staging = Staging.AUTO) -> dict[int, Capture]:
  """Single controller (Pathways): one Capture per failure domain (slice).

  Every piece goes to each domain whose devices hold it; a piece held by
  fewer than ``1 + replicas`` domains is also kept by the next domains in
  ring order (its bytes written to their stores), so losing its own domain
  leaves a copy. Numpy leaves and scalars go to every domain. With a
  ``stager``, array leaves are staged as in :func:`capture` (the first
  domain's copy of each piece; its twins are written from it).
  """
  order = sorted(set(domain_of.values()))
  caps = {d: Capture(list(specs), [], [], [], {}) for d in order}  # only active domains
  arrays = staged(specs, leaves, staging if stager is not None else Staging.NEVER)
  later: list[jax.Array] = []  # the shards to stage, each read by one view
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
    _, arr, how = arrays[i]
    views_at, rows = _domain_rows(i, holder_layout(spec.path, arr, domain_of), tuple(order),
                                  replicas, arr.dtype.itemsize)
    shards = shard_arrays(arr)
    # On CPU, one view per index, which pins its buffer (see the module
    # doc): drain_domains reads a piece's first copy and writes the others
    # (data-parallel twins, the same bytes) from the cache. Staged: the
    # same, one staged shard per index.
    views: list[Any] = []
    if how is Read.VIEW:
      views = [np.asarray(shards[at]) for at in views_at]
    elif how is Read.STAGE:
      views = [_Later(len(later) + k) for k in range(len(views_at))]
      later.extend(shards[at] for at in views_at)
    for d, pieces, owners_, which, sources in rows:
      caps[d].pieces.extend(pieces)
      caps[d].owners.extend(owners_)
      caps[d].sources.extend([views[k] for k in which] if how is not Read.PINNED
                             else [shards[at] for at in sources])
  if later and stager is not None:
    got, report = stager.stage(later)
    for cap in caps.values():
      cap.sources = [got[x.k] if isinstance(x, _Later) else x for x in cap.sources]
    caps[order[0]].staged = report  # (counted once)
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
