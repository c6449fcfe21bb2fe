"""Capture: take a state's shards out of reach of the next train step, then
drain them into a host-store slot with checksums.

``capture`` runs on the caller's thread and returns as soon as every shard is
safe from the next step:

* on CPU, a shard's ``np.asarray`` is a zero-copy view of the live buffer. While
  a view is alive, XLA will not donate that buffer (it copies instead), so the
  view is a stable source for the background copy: one memcpy in all.
* on accelerators, each leaf is dispatched to ``pinned_host`` memory with an
  async ``device_put``; the drain reads the host copy.

``drain`` copies each piece chunk by chunk into the slot on a thread pool and
computes the crc32c of each chunk while it is hot in cache, then drops the
sources so the next step may donate again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from concurrent import futures
from typing import Any

import crc32c
import jax
import numpy as np

from . import _faults
from ._hoststore import align
from ._layout import LeafKind, LeafSpec, Piece, addressable_pieces
from ._placement import owners, replica_shardings

Source = Callable[[], np.ndarray]


@dataclasses.dataclass
class Capture:
  specs: list[LeafSpec]
  pieces: list[Piece]
  owners: list[int]
  sources: list[Source]
  scalars: dict[int, Any]

  @property
  def nbytes(self) -> int:
    return sum(align(p.nbytes) for p in self.pieces)

  def release(self) -> None:
    self.sources = []


def _bytes_of(x: np.ndarray) -> np.ndarray:
  return np.ascontiguousarray(x).reshape(-1).view(np.uint8)


def capture(specs: Sequence[LeafSpec], leaves: Sequence[Any], *,
            host: int, domains: dict[int, int] | None = None,
            replicas: int = 0, step: int = -1) -> Capture:
  """Takes a stable reference to every addressable piece of ``leaves``.

  With ``domains`` and ``replicas`` (multi-host), also receives, by a JAX
  resharding onto a ring-permuted mesh, the replica pieces this host keeps
  for hosts of other domains. Collective then: every host calls it with the
  same state.
  """
  cap = Capture(list(specs), [], [], [], {})
  middle = len(specs) // 2
  for i, (spec, leaf) in enumerate(zip(specs, leaves)):
    if i == middle:
      _faults.point("capture", step)
    if spec.kind is LeafKind.SCALAR:
      cap.scalars[i] = leaf
      continue
    if spec.kind is LeafKind.NUMPY:
      # numpy leaves are mutable by the caller: copy now (they are small).
      data = np.array(leaf, copy=True)
      cap.pieces.append(Piece(i, tuple((0, d) for d in data.shape), data.nbytes))
      cap.owners.append(host)
      cap.sources.append(lambda d=data: d)
      continue
    arr = jax.random.key_data(leaf) if spec.kind is LeafKind.KEY else leaf
    on_cpu = all(d.platform == "cpu" for d in arr.sharding.device_set)
    if not on_cpu:
      arr = jax.device_put(arr, arr.sharding.with_memory_kind("pinned_host"))
    mine = set()
    for piece, data in addressable_pieces(i, arr):
      mine.add(piece.index)
      _add(cap, piece, data, host, on_cpu)
    if domains is None or replicas == 0:
      continue
    shardings = replica_shardings(arr.sharding, tuple(arr.shape), domains, replicas)
    owner_of = owners(arr.sharding, tuple(arr.shape)) if shardings else {}
    for rs in shardings:  # leaf by leaf: device memory grows by one leaf at most.
      rep = jax.device_put(arr, rs)
      if i >= middle:
        _faults.point("replica", step)
      for piece, data in addressable_pieces(i, rep):
        if piece.index not in mine:
          mine.add(piece.index)
          _add(cap, piece, data, owner_of[piece.index], on_cpu)
  return cap


def _add(cap: Capture, piece: Piece, data: jax.Array, owner: int, on_cpu: bool) -> None:
  cap.pieces.append(piece)
  cap.owners.append(owner)
  if on_cpu:
    view = np.asarray(data)  # blocks until the step computed it.
    cap.sources.append(lambda v=view: v)
  else:
    cap.sources.append(lambda d=data: np.asarray(d))


def layout_offsets(pieces: Sequence[Piece]) -> list[int]:
  offsets, off = [], 0
  for p in pieces:
    offsets.append(off)
    off += align(p.nbytes)
  return offsets


def drain(cap: Capture, dst: np.ndarray, offsets: Sequence[int], *,
          pool: futures.Executor, chunk_bytes: int) -> list[tuple[int, ...]]:
  """Copies every piece into ``dst`` at ``offsets``; returns chunk crcs."""

  def copy_chunk(src: np.ndarray, at: int, a: int, b: int) -> int:
    out = dst[at + a: at + b]
    np.copyto(out, src[a:b])
    return crc32c.crc32c(out)

  jobs = []
  for source, piece, at in zip(cap.sources, cap.pieces, offsets):
    src = _bytes_of(source())
    if src.nbytes != piece.nbytes:
      raise ValueError(f"piece of leaf {piece.leaf} has {src.nbytes} bytes, "
                       f"expected {piece.nbytes}")
    jobs.append([pool.submit(copy_chunk, src, at, a, min(a + chunk_bytes, src.nbytes))
                 for a in range(0, max(src.nbytes, 1), chunk_bytes)])
  crcs = [tuple(f.result() for f in fs) for fs in jobs]
  cap.release()
  return crcs


def verify(buf: np.ndarray, crcs: Sequence[int], *, pool: futures.Executor,
           chunk_bytes: int) -> bool:
  """True if every chunk of ``buf`` matches its recorded crc32c."""
  n = buf.nbytes
  starts = list(range(0, max(n, 1), chunk_bytes))
  if len(starts) != len(crcs):
    return False
  got = pool.map(lambda a: crc32c.crc32c(buf[a:min(a + chunk_bytes, n)]), starts)
  return all(g == c for g, c in zip(got, crcs))
