"""The job's retention watermark: the newest step every store holds.

Retention by one store's own view can leave nothing to restore. A host that
dies inside step ``k``'s snapshot leaves its peers going on; the ones whose
halves of the replica exchange did not touch it commit ``k + 1``, ``k + 2``
and, keeping the newest two, delete ``k - 1``, which was the last step every
store held. So a store deletes a snapshot only when the job knows a newer one
is held by *every* store, and until then keeps the last one that was, past
``keep`` if need be, in place of a newer one (:func:`._planner.evictable`).

The job learns it at every snapshot's capture, before anything is evicted,
in one element-wise minimum over the hosts of a fixed-size record
(:func:`record`, ``1 + 2 * BUCKETS`` int32, 516 bytes, the same at
16,384 hosts as at 4). A host's record holds:

* the watermark it learned last (as a distance back from the step being
  captured): the minimum is the newest any host learned;
* per bucket (a hash of the step), the newest step this host holds that
  carries its replicas (or parity), as a distance, and its negation: where
  the minimum of one equals the maximum of the other, every host holds that
  very step. A host holding none puts what can equal nothing. A collision
  only hides a step (the watermark then moves later), never invents one.

Why the last watermark never disappears: each host deletes only after it
learned a watermark in a reduction that every host took part in, and it
protects what it learned; a host whose reduction failed deletes nothing in
that save. The newest watermark any host learned was held by every host
when it was agreed, and no host deletes it before it learns one at least as
new (the reduction carries the newest learned to everyone). Every host
holding a step with its replicas means every piece of it survives the loss
of one failure domain, which is what a restore needs.

On one process (a single host, or a single controller with one store per
slice) the records of the stores are reduced here, in the same way.

When (``_save.Saver``): with ``keep >= 2`` and no ``budget_bytes`` (3
slots or more, from the options alone) a capture evicts by the last
capture's agreement and starts the next on what it holds after evicting,
read at the next capture (the reduction runs during the step); what a
record names stays held until then. Otherwise it agrees and reads before
evicting.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from ._multihost import NONE

#: Buckets of the record; a store holds a few steps (``keep + 1`` at most):
#: six consecutive snapshot steps never share a bucket, at any fixed interval
#: (Fibonacci hashing; ``tests/test_watermark.py``).
BUCKETS = 64
#: A distance no held step has: what a store without a step in a bucket
#: puts where the maximum is taken.
FAR = NONE - 1
WIDTH = 1 + 2 * BUCKETS


def bucket_of(step: int) -> int:
  """A step's bucket (Fibonacci hashing: consecutive and strided steps
  spread over the buckets)."""
  return ((step * 0x9E3779B1) & 0xFFFFFFFF) * BUCKETS >> 32


def _distance(now: int, step: int) -> int | None:
  d = now - step
  return d if 0 <= d < FAR else None


def record(now: int, held: Iterable[int], learned: int | None) -> np.ndarray:
  """One store's record at the capture of step ``now``: ``held`` the steps it
  holds complete with their replicas (all older than ``now``), ``learned``
  the watermark its process learned last (None: none)."""
  out = np.full(WIDTH, NONE, np.int32)
  d = None if learned is None else _distance(now, learned)
  if d is not None:
    out[0] = d
  newest: dict[int, int] = {}
  for step in held:
    dist = _distance(now, step)
    if dist is not None:
      b = bucket_of(step)
      newest[b] = min(newest.get(b, FAR), dist)
  for b in range(BUCKETS):
    dist = newest.get(b)
    out[1 + b] = NONE if dist is None else dist
    out[1 + BUCKETS + b] = -(FAR if dist is None else dist)
  return out


def combine(records: Iterable[np.ndarray]) -> np.ndarray:
  """The element-wise minimum of records (what the hosts' reduction does)."""
  out = np.full(WIDTH, NONE, np.int32)
  for r in records:
    np.minimum(out, r, out=out)
  return out


def settle(now: int, reduced: np.ndarray) -> int | None:
  """The watermark from the reduction of every store's record at the capture
  of step ``now``: the newer of the newest learned and the newest step every
  store holds (None: neither)."""
  best = None if int(reduced[0]) == NONE else now - int(reduced[0])
  for b in range(BUCKETS):
    lo, hi = int(reduced[1 + b]), -int(reduced[1 + BUCKETS + b])
    if lo == hi and lo < FAR:
      step = now - lo
      best = step if best is None else max(best, step)
  return best
