"""Index maths: global index ranges of array pieces, their sizes and overlaps.

An *index* is a tuple of ``(start, stop)`` per dimension (half-open, step 1):
the global region of a leaf that one piece covers. Every module that sizes,
cuts or compares pieces uses these functions; none computes them itself.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
from collections.abc import Iterable, Iterator, Sequence

import numpy as np

Index = tuple[tuple[int, int], ...]
Slices = tuple[slice, ...]

ALIGN = 4096  # pieces start on page boundaries in a host-store slot


def align(n: int) -> int:
  """``n`` rounded up to a multiple of :data:`ALIGN`."""
  return (n + ALIGN - 1) // ALIGN * ALIGN


@functools.lru_cache(maxsize=1 << 16)  # the same pieces every snapshot and restore
def shape_of(index: Index) -> tuple[int, ...]:
  return tuple(b - a for a, b in index)


def volume(index: Index) -> int:
  """Elements in ``index`` (1 for the index of a 0-d array); exact (Python ints)."""
  return math.prod(shape_of(index))


@functools.lru_cache(maxsize=1 << 16)  # the same pieces every snapshot
def nbytes(index: Index, itemsize: int) -> int:
  return volume(index) * itemsize


def full(shape: Sequence[int]) -> Index:
  """The index of a whole leaf of ``shape``."""
  return tuple((0, int(d)) for d in shape)


def normalize(index: tuple[slice, ...] | None, shape: Sequence[int]) -> Index:
  """A JAX shard index (slices, possibly open or None) -> an :data:`Index`."""
  if index is None:
    return full(shape)
  out = []
  for i, dim in enumerate(shape):
    s = index[i] if i < len(index) else slice(None)
    start, stop, step = s.indices(dim)
    if step != 1:
      raise ValueError(f"strided shard index {index} is not supported")
    out.append((start, stop))
  return tuple(out)


def to_slices(index: Index) -> Slices:
  return tuple(slice(a, b) for a, b in index)


def overlap(a: Index, b: Index) -> Index | None:
  """The region ``a`` and ``b`` share, or None (0-d indices always overlap)."""
  out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b, strict=True))
  return out if all(lo < hi for lo, hi in out) else None


def overlaps(pieces: Iterable[Index], region: Index) -> Iterator[tuple[Index, Slices, Slices]]:
  """For each piece overlapping ``region``: (piece, where the overlap sits in
  the region, where it sits in the piece)."""
  for pidx in pieces:
    ov = overlap(pidx, region)
    if ov is not None:
      yield (pidx,
             tuple(slice(lo - t0, hi - t0) for (lo, hi), (t0, _) in zip(ov, region, strict=True)),
             tuple(slice(lo - p0, hi - p0) for (lo, hi), (p0, _) in zip(ov, pidx, strict=True)))


def covered(pieces: Iterable[Index], region: Index) -> int:
  """Elements of ``region`` covered by ``pieces`` (overlaps between pieces
  counted twice: pass distinct, non-overlapping pieces)."""
  return sum(volume(ov) for p in pieces if (ov := overlap(p, region)) is not None)


_MAX_CELLS = 1 << 22


def _coverage(indices: Sequence[Index], shape: Sequence[int]) -> np.ndarray | None:
  """How many of ``indices`` cover each cell of the grid their bounds cut
  ``shape`` into, or None if that grid has more than 4M cells (no sharding
  cuts a leaf that finely). Linear in the pieces: each adds +-1 at its 2**d
  corners of a difference array, summed once along every axis."""
  ndim = len(shape)
  cuts = [sorted({0, int(shape[d])} | {x for idx in indices for x in idx[d]})
          for d in range(ndim)]
  if math.prod(len(c) - 1 for c in cuts) > _MAX_CELLS:
    return None
  diff = np.zeros([len(c) for c in cuts], np.int64)
  corners = list(itertools.product((0, 1), repeat=ndim))
  for idx in indices:
    if volume(idx) == 0:
      continue
    pos = [(bisect.bisect_left(c, a), bisect.bisect_left(c, b))
           for c, (a, b) in zip(cuts, idx, strict=True)]
    for corner in corners:
      diff[tuple(p[k] for p, k in zip(pos, corner, strict=True))] += -1 if sum(corner) % 2 else 1
  for axis in range(ndim):
    diff = np.cumsum(diff, axis=axis)
  return diff[tuple(slice(0, len(c) - 1) for c in cuts)]


def disjoint(indices: Sequence[Index]) -> bool:
  """True if no two of ``indices`` (all of one leaf) share an element (False
  for a grid too fine to check)."""
  return _disjoint(tuple(sorted(indices)))


def tiles(indices: Sequence[Index], shape: Sequence[int]) -> bool:
  """True if ``indices`` cover every element of a leaf of ``shape`` exactly
  once (no gaps, no overlaps)."""
  return _tiles(tuple(sorted(indices)), tuple(int(n) for n in shape))


# Remembered by layout: every snapshot of a state has the same ones, and a
# restore of many leaves would otherwise check them all again each time.
@functools.lru_cache(maxsize=4096)
def _disjoint(indices: tuple[Index, ...]) -> bool:
  if not indices:
    return True
  shape = [max(idx[d][1] for idx in indices) for d in range(len(indices[0]))]
  counts = _coverage(indices, shape)
  return counts is not None and bool((counts <= 1).all())


@functools.lru_cache(maxsize=4096)
def _tiles(indices: tuple[Index, ...], shape: tuple[int, ...]) -> bool:
  if volume(full(shape)) == 0:
    return True
  counts = _coverage(indices, shape)
  return counts is not None and bool((counts == 1).all())
