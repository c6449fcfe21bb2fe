"""Agreeing on a restore's candidate steps from one fixed-size record a host.

Each host reads and validates only its own manifests, and contributes one
:class:`Record` per kept step: the step, its incarnation, whether it carries
parity, and a digest of everything the hosts of one step must agree on (the
tree, the leaves, the scalars, the ``extra``, the chunk size, the saved job
size). Gathered (:meth:`._collective.Collective.gather_rows`: 24 bytes a
kept step a host), every host derives the same candidates, freshest first,
each with the hosts that hold it: what no host's manifest names stays on
that host.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence

import msgpack
import numpy as np

from . import _planner
from ._collective import NONE, Collective
from ._layout import spec_row
from ._manifest import Manifest

#: A record's flag: the step's stores hold parity blocks.
PARITY = 1

_EMPTY = -1  # the step of an unused record slot


@dataclasses.dataclass(frozen=True)
class Record:
  host: int
  step: int
  incarnation: int
  flags: int
  digest: int


def shared_content(m: Manifest) -> bytes:
  """What every store's manifest of one step must agree on, as bytes
  (``==`` on values would call NaN unequal to itself, and True equal to
  1.0): the header a host without the step receives (:mod:`._sparse`)."""
  return msgpack.packb([[spec_row(s) for s in m.leaves], sorted(m.scalars.items()), m.extra,
                        m.chunk_bytes, m.tree_digest, m.num_hosts], use_bin_type=True)


def digest_of(content: bytes) -> int:
  return int.from_bytes(hashlib.blake2b(content, digest_size=8).digest(), "little",
                        signed=True)


def local_records(host: int, manifests: Sequence[Manifest], slots: int) -> list[Record]:
  """This host's records: its newest ``slots`` steps (one manifest each:
  the newest incarnation's), after fencing its own superseded ones."""
  newest: dict[int, Manifest] = {}
  for m in _planner.fence(manifests):
    if m.step not in newest or m.incarnation > newest[m.step].incarnation:
      newest[m.step] = m
  out = []
  for step in sorted(newest, reverse=True)[:slots]:
    m = newest[step]
    out.append(Record(host, step, m.incarnation, PARITY if m.parity else 0,
                      digest_of(shared_content(m))))
  return out


def encode_row(records: Sequence[Record], slots: int) -> np.ndarray:
  """``slots`` records as one row of int64 words (step, incarnation and
  flags, digest), unused slots with step -1."""
  row = np.full((slots, 3), 0, np.int64)
  row[:, 0] = _EMPTY
  for i, r in enumerate(records[:slots]):
    row[i] = (r.step, (r.incarnation << 8) | r.flags, r.digest)
  return row.reshape(-1)


def decode_rows(rows: np.ndarray, slots: int) -> list[Record]:
  """Every host's records from the gathered rows (hosts x bytes)."""
  words = np.ascontiguousarray(rows).view(np.int64).reshape(rows.shape[0], slots, 3)
  out = []
  for host in range(words.shape[0]):
    for step, inc_flags, digest in words[host].tolist():
      if step != _EMPTY:
        out.append(Record(host, step, inc_flags >> 8, inc_flags & 0xFF, digest))
  return out


def gather_records(coll: Collective, records: Sequence[Record], slots: int) -> list[Record]:
  """Every host's records (one collective, ``24 * slots`` bytes a host)."""
  row = encode_row(records, slots).view(np.uint8)
  return decode_rows(coll.gather_rows(row), slots)


def fence(records: Sequence[Record]) -> list[Record]:
  """:func:`._planner.fence` on records: drops those a newer incarnation
  superseded (it restored from a step at or before theirs)."""
  newest_start: dict[int, int] = {}
  for r in records:
    newest_start[r.incarnation] = min(newest_start.get(r.incarnation, r.step), r.step)
  incs = sorted(newest_start)
  return [r for r in records
          if not any(i > r.incarnation and newest_start[i] <= r.step for i in incs)]


@dataclasses.dataclass(frozen=True)
class Candidate:
  """A step some hosts hold complete, at its newest incarnation, every
  holder agreeing on its digest."""

  step: int
  incarnation: int
  digest: int
  holders: tuple[int, ...]
  parity: bool


def candidates(records: Sequence[Record], *, step: int | None = None,
               reasons: list[str] | None = None) -> list[Candidate]:
  """The steps to try, freshest first (only ``step``, where given); why a
  step is left out goes to ``reasons``. The same on every host."""
  live = fence(records)
  by_step: dict[int, list[Record]] = {}
  for r in live:
    by_step.setdefault(r.step, []).append(r)
  out = []
  for s in sorted(by_step, reverse=True):
    if step is not None and s != step:
      continue
    inc = max(r.incarnation for r in by_step[s])
    held = [r for r in by_step[s] if r.incarnation == inc]
    if len({r.digest for r in held}) > 1:
      if reasons is not None:
        reasons.append(f"step {s}: hosts disagree on the leaves, scalars or extra")
      continue
    out.append(Candidate(s, inc, held[0].digest, tuple(sorted(r.host for r in held)),
                         any(r.flags & PARITY for r in held)))
  return out


def min64(coll: Collective, values: Sequence[int]) -> tuple[int, ...]:
  """The minimum over hosts of each of ``values`` (ints in [-2**60,
  2**60)), in two int32 reductions: the high bits, then the low bits
  among the hosts that reached the high minimum."""
  u = [int(v) + (1 << 60) for v in values]
  hi = coll.reduce_min(np.array([x >> 31 for x in u], np.int32))
  lo = coll.reduce_min(np.array([x & ((1 << 31) - 1) if (x >> 31) == int(h) else NONE
                                 for x, h in zip(u, hi, strict=True)], np.int32))
  return tuple((int(h) << 31 | int(low)) - (1 << 60) for h, low in zip(hi, lo, strict=True))


def max64(coll: Collective, values: Sequence[int]) -> tuple[int, ...]:
  return tuple(-v for v in min64(coll, [-int(v) for v in values]))
