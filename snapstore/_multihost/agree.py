"""Agreeing on a restore's candidate steps in reductions of a few bytes a host.

Each host reads and validates only its own manifests (the newest incarnation
of each step, after fencing its own superseded ones). The job then walks the
candidate steps freshest first, each found by one maximum over the hosts:

1. the newest step every host saw, the incarnation, the persistent tier's
   newest commit every host sees, the newest incarnation any manifest names
   (one :func:`max64`);
2. per candidate step ``s``: the newest incarnation at ``s``, the newest
   incarnation of any step below ``s`` (a newer one there fences ``s``: it
   restored from before ``s`` and went on), and the next step below ``s``
   (one :func:`max64`);
3. the hosts holding ``s`` at that incarnation (one bitmap: a bit a host),
   the least and greatest digest of what they must agree on
   (:func:`snapstore._planner.shared_content`: the tree, the
   leaves, the scalars, the ``extra``, the chunk size, the saved job size)
   and whether any holds parity (one :func:`min64`).

Every host derives the same candidates from the same reductions. A host
contributes a few dozen bytes a step and the job a bit a host; no host's
manifest leaves it.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterator, Sequence

import numpy as np

from .. import _planner
from .._manifest import Manifest
from .collective import NONE, Collective

#: The least value :func:`min64` and :func:`max64` take (and "none" for max64).
LEAST = -(1 << 60)


def digest_of(content: bytes) -> int:
  """A signed 60-bit digest (what :func:`min64` carries exactly)."""
  return int.from_bytes(hashlib.blake2b(content, digest_size=8).digest(), "little") \
      % (1 << 60) - (1 << 59)


def newest_per_step(manifests: Sequence[Manifest]) -> dict[int, Manifest]:
  """This host's manifest of each step: the newest incarnation's, after
  fencing its own superseded ones."""
  out: dict[int, Manifest] = {}
  for m in _planner.fence(manifests):
    if m.step not in out or m.incarnation > out[m.step].incarnation:
      out[m.step] = m
  return out


@dataclasses.dataclass(frozen=True)
class Candidate:
  """A step some hosts hold complete, at its newest incarnation, every
  holder agreeing on its digest."""

  step: int
  incarnation: int
  digest: int
  holders: np.ndarray  # the hosts that hold it, ascending (int32: thousands of them)
  parity: bool

  def missing(self, num_hosts: int) -> set[int]:
    """The hosts that do not hold it."""
    have = np.zeros(num_hosts, bool)
    have[self.holders] = True
    return {int(h) for h in np.flatnonzero(~have)}


def candidates(coll: Collective, manifests: Sequence[Manifest], *, step: int | None = None,
               reasons: list[str] | None = None) -> Iterator[Candidate]:
  """The steps to try, freshest first (only ``step``, where given); why a
  step is passed over goes to ``reasons``. Collective: every host draws the
  same candidates, and must draw as many (stop at the same one)."""
  mine = newest_per_step(manifests)
  steps = sorted(mine, reverse=True)

  def below(s: int | None) -> int:
    return max((t for t in steps if s is None or t < s), default=LEAST)
  if step is None:
    first = below(None)
  else:
    first = step if step in mine else LEAST
  (s,) = max64(coll, [first])
  if step is not None and s != step:
    return
  while s != LEAST:
    lower = [t for t in steps if t < s]
    inc_s, inc_below, next_s = max64(coll, [
        mine[s].incarnation if s in mine else LEAST,
        max((mine[t].incarnation for t in lower), default=LEAST),
        below(s) if step is None else LEAST])
    if inc_below > inc_s:
      if reasons is not None:
        reasons.append(f"step {s}: superseded by incarnation {inc_below}, which restored "
                       "an earlier step")
    else:
      holds = s in mine and mine[s].incarnation == inc_s
      bits = np.zeros(-(-coll.num_hosts // 8), np.uint8)
      if holds:
        bits[coll.host // 8] = 1 << (coll.host % 8)
      holders = _hosts(coll.reduce_or(bits), coll.num_hosts)
      digest = digest_of(_planner.shared_content(mine[s])) if holds else None
      parity = bool(holds and mine[s].parity)
      lo, neg_hi, neg_parity = min64(coll, [
          digest if digest is not None else -LEAST - 1,
          -digest if digest is not None else -LEAST - 1, -int(parity)])
      if lo != -neg_hi:
        if reasons is not None:
          reasons.append(f"step {s}: hosts disagree on the leaves, scalars or extra")
      else:
        yield Candidate(s, inc_s, lo, holders, neg_parity < 0)
    s = next_s


def _hosts(bits: np.ndarray, n: int) -> np.ndarray:
  return np.flatnonzero(np.unpackbits(bits, bitorder="little")[:n]).astype(np.int32)


def branch(coll: Collective, manifests: Sequence[Manifest], restored: int,
           incarnation: int) -> int:
  """The incarnation saves continue as after restoring step ``restored``: a
  new one (one more than any manifest names) where this incarnation already
  saved a later step (a new branch, which fences the abandoned steps); else
  ``incarnation``. Collective (one :func:`max64`)."""
  later = any(m.incarnation == incarnation and m.step > restored for m in manifests)
  top = max((m.incarnation for m in manifests), default=LEAST)
  (flag, top) = max64(coll, [int(later), top])
  return top + 1 if flag else incarnation


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
  """The maximum over hosts of each of ``values`` (ints in (-2**60, 2**60])."""
  return tuple(-v for v in min64(coll, [-int(v) for v in values]))
