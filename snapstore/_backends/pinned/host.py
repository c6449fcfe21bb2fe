"""The pinned-host store's copies in this process's memory
(``PinnedMemory.PROCESS``): what the capture leaves for the drain (a
:class:`HostJob` per domain), and the drain's one pass that copies them
into each slot's reused memory with their crc32c (:func:`copy_to_host`).

A leaf is read as host files read it (:func:`..staging.staged`): a view of
each CPU shard, which pins its buffer against donation; off CPU the shard
staged in device memory and on its way to host memory in pieces; with
``Staging.NEVER`` its ``pinned_host`` copy.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from concurrent import futures
from typing import Any, Protocol, cast

import jax
import numpy as np

from ..._checksum import Checksum
from ..._index import Index, nbytes as index_nbytes, shape_of
from ..._placement import HolderLayout, holder_layout, shard_arrays
from ..._tree import Piece, piece_of, positions
from .._copy import Capture, drain_domains, slot_offsets
from ..staging import Read
from .ring import Ring, copy_of, structure


class Captured(Protocol):
  """What :func:`add_host_leaf` appends to (a :class:`.capture.PinnedCapture`)."""

  pieces: dict[int, list[tuple[Piece, int]]]
  arrays: dict[int, list[Any]]
  host: dict[int, HostJob]


@dataclasses.dataclass
class HostJob:
  """One domain's pieces that the drain copies into this process's memory:
  the copy's capture, each piece's position in the domain's slot, and the
  dtype and shape it is read back as, with the device it belongs to."""

  capture: Capture
  places: list[int] = dataclasses.field(default_factory=list)
  kinds: list[tuple[np.dtype, tuple[int, ...], jax.Device]] = \
      dataclasses.field(default_factory=list)

  def add(self, piece: Piece, owner: int, source: Any, place: int, dtype: np.dtype,
          shape: tuple[int, ...], device: jax.Device) -> None:
    self.capture.pieces.append(piece)
    self.capture.owners.append(owner)
    self.capture.sources.append(source)
    self.places.append(place)
    self.kinds.append((dtype, shape, device))


# per keeping domain: (domain, (piece, owner) of each copy, its piece, which
# view it is read from, the device that keeps it)
_HostRowsDomains = tuple[tuple[int, tuple[tuple[Piece, int], ...], tuple[Piece, ...],
                               tuple[int, ...], tuple[jax.Device, ...]], ...]


@dataclasses.dataclass(frozen=True)
class _HostRows:
  """A leaf's copies in this process's memory, from its layout alone (the
  same every save), as :func:`add_host_leaf` appends them: the shard
  position of each view taken (one per index: a data-parallel twin's own
  buffer is never read), and per keeping domain, in keep order, (domain,
  (piece, owner) of each copy, its piece, which view it is read from, the
  device that keeps it)."""

  views: tuple[int, ...]
  domains: _HostRowsDomains


@functools.lru_cache(maxsize=1 << 16)  # one entry a leaf: a state has thousands
def _host_rows(leaf: int, layout: HolderLayout, device_ids: tuple[int, ...], ring: Ring,
               replicas: int, itemsize: int) -> _HostRows:
  keep, _, copies = structure(layout, device_ids, ring, replicas)
  view_of: dict[Index, int] = {}  # index -> its view's number
  views: list[int] = []           # each view's shard position
  per: dict[int, list[tuple[tuple[Piece, int], Piece, int, jax.Device]]] = {
      d: [] for d in ring.order}
  for (index, d), (at, device, _) in copies.items():  # keep order (see _structure)
    if index not in view_of:
      view_of[index] = len(views)
      views.append(at)
    n = index_nbytes(index, itemsize)
    per[d].append((copy_of(leaf, index, n, keep[(index, d)]), piece_of(leaf, index, n),
                   view_of[index], device))
  # (each domain's rows, transposed: its copies, pieces, views and devices)
  columns = tuple((d, *map(tuple, zip(*rows, strict=True))) for d, rows in per.items() if rows)
  return _HostRows(tuple(views), cast(_HostRowsDomains, columns))


class Later:
  """A placeholder source: shard ``k`` of a capture's shards to stage."""

  __slots__ = ("k",)

  def __init__(self, k: int) -> None:
    self.k = k


def add_host_leaf(cap: Captured, leaf: int, path: str,
                   read: tuple[jax.Array, jax.Array, Read], ring: Ring, replicas: int,
                   later: list[jax.Array]) -> None:
  """PROCESS: appends the copies of one leaf (``replicas`` more than its
  holders', ring order) to the host jobs, each read from one source per
  index: a view of a CPU shard (which pins its buffer against donation), a
  shard to stage (``later``), or its ``pinned_host`` copy (``read``: see
  :func:`..staging.staged`). Its per-copy plan is computed once
  (:func:`_host_rows`): a state has thousands of copies, every save."""
  _, arr, how = read
  rows = _host_rows(leaf, holder_layout(path, arr, ring.domain_of), tuple(positions(arr)),
                    ring, replicas, arr.dtype.itemsize)
  shards = shard_arrays(arr)
  views: list[Any]
  if how is Read.VIEW:
    views = [np.asarray(shards[at]) for at in rows.views]
  elif how is Read.STAGE:
    views = [Later(len(later) + k) for k in range(len(rows.views))]
    later.extend(shards[at] for at in rows.views)
  else:
    views = [shards[at] for at in rows.views]
  dtype = np.dtype(arr.dtype)
  for d, copies, pieces, which, devices in rows.domains:
    job = cap.host[d]
    for (piece, owner), own, k, device in zip(copies, pieces, which, devices, strict=True):
      job.add(own, d, views[k], len(cap.pieces[d]), dtype, shape_of(piece.index), device)
      cap.pieces[d].append((piece, owner))
      cap.arrays[d].append(None)  # the drain's parts fill it


def copy_to_host(jobs: dict[int, HostJob], arrays: dict[int, list[Any]],
                 sums: dict[int, dict[int, Checksum]], devices: dict[int, dict[int, jax.Device]],
                 take: Callable[[int, int], np.ndarray], pool: futures.Executor,
                 chunk_bytes: int) -> None:
  """Copies every domain's pieces into ``take(domain, bytes)`` with their
  crc32c in one pass (the host-files drain); each piece is then its part
  of that memory (``arrays[domain][position]``), with its crc32c and the
  device it belongs to. A piece an earlier domain keeps too (a
  data-parallel twin) is written from the cache as that domain's copy
  passes: the same checked bytes, one read of memory and one crc32c for
  both."""
  offsets = {d: slot_offsets(job.capture.pieces) for d, job in jobs.items()}
  bufs = {d: take(d, job.capture.nbytes) for d, job in jobs.items()}
  crcs = drain_domains({d: job.capture for d, job in jobs.items()}, bufs, offsets,
                       pool=pool, chunk_bytes=chunk_bytes)
  for d, job in jobs.items():
    got, where = sums.setdefault(d, {}), devices.setdefault(d, {})
    for pos, p, at, (dtype, shape, device), crc in zip(
        job.places, job.capture.pieces, offsets[d], job.kinds, crcs[d], strict=True):
      arrays[d][pos] = bufs[d][at:at + p.nbytes].view(dtype).reshape(shape)
      where[pos] = device
      got[pos] = crc
