"""Stored pieces -> target shards -> jax.Arrays on the caller's sharding.

Each target shard is cut from whichever stored pieces overlap it, so the target
sharding may differ from the one that saved. Every piece used is verified
against its crc32c first; a failed copy raises :class:`BadCopy` so the caller
can drop it and plan again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent import futures
from typing import Any

import jax
import numpy as np

from ._capture import verify
from ._layout import Index, LeafKind, LeafSpec, wants_numpy
from ._persistent import target_sharding
from ._planner import Copy, CopyKey, StepPlan

# Reads the bytes of one stored copy (a read-only view).
Reader = Callable[[Copy], np.ndarray]


class BadCopy(Exception):
  """A stored copy failed verification (internal; the manager re-plans)."""

  def __init__(self, key: CopyKey, leaf: str, *, why: str = "checksum mismatch",
               holder: str | None = None):
    super().__init__(f"{why} in leaf {leaf!r} held by {holder or f'host {key[0]}'}")
    self.key = key
    self.leaf = leaf


def overlap(a: Index, b: Index) -> Index | None:
  out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
  return out if all(lo < hi for lo, hi in out) or not out else None


Slices = tuple[slice, ...]


def overlaps(pieces: Iterable[Index], region: Index) -> Iterator[tuple[Index, Slices, Slices]]:
  """For each piece overlapping ``region``: (piece, where the overlap sits in
  the region, where it sits in the piece)."""
  for pidx in pieces:
    ov = overlap(pidx, region)
    if ov is not None:
      yield (pidx, tuple(slice(lo - t0, hi - t0) for (lo, hi), (t0, _) in zip(ov, region)),
             tuple(slice(lo - p0, hi - p0) for (lo, hi), (p0, _) in zip(ov, pidx)))


class Assembler:
  """Builds restored leaves from a plan; caches verified pieces."""

  def __init__(self, plan: StepPlan, read: Reader, *, pool: futures.Executor,
               pick: Callable[[Sequence[Copy]], Copy] = lambda cs: cs[0]):
    self.plan = plan
    self._pick = pick
    self._read = read
    self._pool = pool
    self._verified: dict[tuple[int, Index], np.ndarray] = {}
    self.bytes_read = 0
    self.bad: dict[CopyKey, BadCopy] = {}  # bad copies passed over (none here:
                                           # the first raises BadCopy and re-plans)

  def piece(self, leaf: int, index: Index) -> np.ndarray:
    """The verified bytes of piece (leaf, index), typed and shaped."""
    cached = self._verified.get((leaf, index))
    if cached is not None:
      return cached
    spec = self.plan.specs[leaf]
    copy = self._pick(self.plan.copies[(leaf, index)])
    raw = self._read(copy)
    if not verify(raw, copy.record.crcs, pool=self._pool,
                  chunk_bytes=self.plan.chunk_bytes):
      raise BadCopy(copy.key(self.plan.step), spec.path)
    self.bytes_read += raw.nbytes
    arr = raw.view(spec.np_dtype).reshape(tuple(b - a for a, b in index))
    self._verified[(leaf, index)] = arr
    return arr

  def region(self, leaf: int, index: Index) -> tuple[np.ndarray, bool]:
    """(array of the global region ``index``, whether it is a fresh buffer)."""
    pieces = self.plan.leaf_copies(leaf)
    if index in pieces:
      return self.piece(leaf, index), False
    spec = self.plan.specs[leaf]
    out = np.empty(tuple(b - a for a, b in index), spec.np_dtype)
    for pidx, dst, src in overlaps(pieces, index):
      out[dst] = self.piece(leaf, pidx)[src]
    return out, True

  def leaf(self, leaf: int, target_spec: LeafSpec, target: Any) -> Any:
    spec = self.plan.specs[leaf]
    if spec.kind is LeafKind.SCALAR:
      return self.plan.scalars.get(leaf)
    return build_leaf(spec, target_spec, target, lambda idx: self.region(leaf, idx))

  def tree(self, target_specs: Sequence[LeafSpec], targets: Sequence[Any]) -> list[Any]:
    by_path = {s.path: i for i, s in enumerate(self.plan.specs)}
    return [self.leaf(by_path[t.path], t, tgt) for t, tgt in zip(target_specs, targets)]


# Returns (array of the global region ``index``, whether it is a fresh buffer).
Region = Callable[[Index], tuple[np.ndarray, bool]]


def build_leaf(spec: LeafSpec, target_spec: LeafSpec, target: Any, region: Region) -> Any:
  """One restored leaf in the target's layout, cut region by region."""
  full = tuple((0, d) for d in spec.shape)
  if wants_numpy(spec, target_spec, target):
    arr, fresh = region(full)
    arr = arr if fresh else np.array(arr, copy=True)
    return arr[()] if isinstance(target, np.generic) else arr
  sharding = target_sharding(target)
  idx_map = sharding.addressable_devices_indices_map(spec.shape)
  by_index: dict[Index, np.ndarray] = {}
  bufs = []
  for device, idx in idx_map.items():
    nidx = tuple((s.indices(d)[0], s.indices(d)[1]) for s, d in
                 zip(idx, spec.shape)) if idx is not None else full
    if nidx not in by_index:
      by_index[nidx] = region(nidx)[0]
    bufs.append(jax.device_put(by_index[nidx], device, may_alias=False))
  arr = jax.make_array_from_single_device_arrays(spec.shape, sharding, bufs)
  if spec.kind is LeafKind.KEY:
    arr = jax.random.wrap_key_data(arr, impl=spec.key_impl)
  return arr


def full_region(full: np.ndarray) -> Region:
  """A Region over one complete host array."""
  return lambda idx: (full[tuple(slice(a, b) for a, b in idx)], False)
