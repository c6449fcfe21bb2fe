"""Index maths: global index ranges of array pieces, their sizes and overlaps.

An *index* is a tuple of ``(start, stop)`` per dimension (half-open, step 1):
the global region of a leaf that one piece covers. Every module that sizes,
cuts or compares pieces uses these functions; none computes them itself.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator, Sequence

import numpy as np

Index = tuple[tuple[int, int], ...]
Slices = tuple[slice, ...]

ALIGN = 4096  # pieces start on page boundaries in a host-store slot


def align(n: int) -> int:
  """``n`` rounded up to a multiple of :data:`ALIGN`."""
  return (n + ALIGN - 1) // ALIGN * ALIGN


def shape_of(index: Index) -> tuple[int, ...]:
  return tuple(b - a for a, b in index)


def volume(index: Index) -> int:
  """Elements in ``index`` (1 for the index of a 0-d array)."""
  return int(np.prod(shape_of(index), dtype=np.int64))


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
  out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
  return out if all(lo < hi for lo, hi in out) else None


def overlaps(pieces: Iterable[Index], region: Index) -> Iterator[tuple[Index, Slices, Slices]]:
  """For each piece overlapping ``region``: (piece, where the overlap sits in
  the region, where it sits in the piece)."""
  for pidx in pieces:
    ov = overlap(pidx, region)
    if ov is not None:
      yield (pidx, tuple(slice(lo - t0, hi - t0) for (lo, hi), (t0, _) in zip(ov, region)),
             tuple(slice(lo - p0, hi - p0) for (lo, hi), (p0, _) in zip(ov, pidx)))


def covered(pieces: Iterable[Index], region: Index) -> int:
  """Elements of ``region`` covered by ``pieces`` (overlaps between pieces
  counted twice: pass distinct, non-overlapping pieces)."""
  return sum(volume(ov) for p in pieces if (ov := overlap(p, region)) is not None)


_MAX_CELLS = 1 << 22


def _coverage(indices: Sequence[Index], shape: Sequence[int]) -> np.ndarray | None:
  """How many of ``indices`` cover each cell of the grid their bounds cut
  ``shape`` into (None if that grid is too large to count)."""
  cuts = [sorted({0, int(shape[d])} | {x for idx in indices for x in idx[d]})
          for d in range(len(shape))]
  if int(np.prod([len(c) - 1 for c in cuts], dtype=np.int64)) > _MAX_CELLS:
    return None
  counts = np.zeros([len(c) - 1 for c in cuts], np.int32)
  for idx in indices:
    counts[tuple(slice(bisect.bisect_left(c, a), bisect.bisect_left(c, b))
                 for c, (a, b) in zip(cuts, idx))] += 1
  return counts


def _pairwise_disjoint(indices: Sequence[Index]) -> bool:
  nonempty = [i for i in indices if volume(i) > 0]
  return all(overlap(a, b) is None for k, a in enumerate(nonempty) for b in nonempty[k + 1:])


def disjoint(indices: Sequence[Index]) -> bool:
  """True if no two of ``indices`` (all of one leaf) share an element."""
  if not indices:
    return True
  shape = [max(idx[d][1] for idx in indices) for d in range(len(indices[0]))]
  counts = _coverage(indices, shape)
  return _pairwise_disjoint(indices) if counts is None else bool((counts <= 1).all())


def tiles(indices: Sequence[Index], shape: Sequence[int]) -> bool:
  """True if ``indices`` cover every element of a leaf of ``shape`` exactly
  once (no gaps, no overlaps)."""
  if volume(full(shape)) == 0:
    return True
  counts = _coverage(indices, shape)
  if counts is None:
    return (_pairwise_disjoint(indices)
            and sum(volume(i) for i in indices) == volume(full(shape)))
  return bool((counts == 1).all())
