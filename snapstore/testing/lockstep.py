"""The collective of a multi-controller job, stood in for in one process.

:func:`lockstep` runs ``fn(collective)`` for the hosts that matter to a case
as threads in lockstep; every other host of the ``n``-host job is a
bystander whose contribution is known without running it (:class:`Lockstep`
says what it is). :class:`SimCollective` is the
:class:`snapstore._multihost.Collective` each thread gets, counting the
buffers the real one (``JaxCollective``) would put in and get back. The
point-to-point moves are not simulated.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np


class Lockstep:
  """The collective of the hosts run as threads, bystanders filled in:
  a bystander holds what host 0 holds (the bitmaps of :func:`agree.candidates`
  get its bit where host 0 sets its own), sends no blob (zeros in every
  sum), and never holds a needed piece nearer than a neighbour (it is left
  out of every minimum; the maxima of equal stores are host 0's)."""

  def __init__(self, n: int, hosts: Sequence[int]):
    self.n, self.hosts = n, list(hosts)
    self.bystanders = np.ones(n, bool)
    self.bystanders[self.hosts] = False
    self.barrier = threading.Barrier(len(hosts), action=self._combine)
    self.after = threading.Barrier(len(hosts))
    self.put: dict[int, Any] = {}
    self.kind = ""
    self.out: Any = None

  def _combine(self) -> None:
    vals = list(self.put.values())
    if self.kind == "or":
      out = functools.reduce(np.bitwise_or, vals)
      if np.unpackbits(self.put[0], bitorder="little")[0]:  # host 0 holds: so do they
        bits = np.unpackbits(out, bitorder="little")[:self.n] | self.bystanders
        out = np.packbits(bits, bitorder="little")[:len(out)]
      self.out = out
    elif self.kind == "sum":
      self.out = np.sum(vals, axis=0, dtype=np.uint8)
    elif self.kind == "min":
      self.out = np.min(np.stack(vals), axis=0)
    self.put = {}

  def call(self, host: int, kind: str, value: Any) -> Any:
    self.put[host] = value
    self.kind = kind
    self.barrier.wait()
    out = self.out
    self.after.wait()  # every host has read it before the next call
    return out


class SimCollective:
  """:class:`snapstore._multihost.collective.Collective` for one simulated host,
  counting the buffers :class:`JaxCollective` would use."""

  def __init__(self, world: Lockstep, host: int):
    from snapstore._multihost import Traffic
    self.world, self.host, self.num_hosts = world, host, world.n
    self.traffic = Traffic()

  def _count(self, nbytes: int) -> None:
    from snapstore._multihost import bucket
    size = bucket(nbytes) if nbytes else 0
    self.traffic.add(size, size)

  def reduce_or(self, bits: np.ndarray) -> np.ndarray:
    self._count(bits.nbytes)
    return self.world.call(self.host, "or", np.asarray(bits, np.uint8))

  def sum_bytes(self, buf: np.ndarray) -> np.ndarray:
    buf = np.ascontiguousarray(buf).reshape(-1).view(np.uint8)
    self._count(buf.nbytes)
    return self.world.call(self.host, "sum", buf).copy()

  def reduce_min(self, values: np.ndarray) -> np.ndarray:
    values = np.asarray(values, np.int32)
    if values.size:
      self.traffic.add(4 * _bucket(values.size), 4 * _bucket(values.size))
    return self.world.call(self.host, "min", values)

  def start_reduce_min(self, values: np.ndarray) -> Callable[[], np.ndarray]:
    out = self.reduce_min(values)  # (the world meets at the call)
    return lambda: out

  def permute(self, *a: Any) -> Any:  # pragma: no cover - not simulated
    raise NotImplementedError("the moves are not simulated (their bytes are reported)")


def _bucket(n: int) -> int:
  from snapstore._multihost import bucket
  return bucket(n)


def lockstep(n: int, hosts: Sequence[int], fn: Any) -> list[Any]:
  """``fn(collective)`` on each of ``hosts`` of an ``n``-host job, as
  threads in lockstep (:class:`Lockstep`); their results, in ``hosts``
  order. An error in one is raised here (the others are released)."""
  world = Lockstep(n, hosts)
  results: dict[int, Any] = {}
  errors: list[BaseException] = []

  def one(h: int) -> None:
    try:
      results[h] = fn(SimCollective(world, h))
    except BaseException as e:  # noqa: BLE001 - carried back to the caller
      errors.append(e)
      world.barrier.abort()
      world.after.abort()
  threads = [threading.Thread(target=one, args=(h,)) for h in hosts]
  for th in threads:
    th.start()
  for th in threads:
    th.join()
  if errors:
    raise errors[0]
  return [results[h] for h in hosts]

