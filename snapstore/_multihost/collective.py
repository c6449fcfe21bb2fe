"""The few collectives a multi-host restore agrees with, sized by what they carry.

A restore's metadata travels in four shapes, none of them a host's
inventory times the host count:

* :meth:`Collective.reduce_or`: a bitmap, a bit a host (who holds a step);
* :meth:`Collective.sum_bytes`: byte buffers whose non-zero bytes each come
  from one host, summed: :func:`gather_blobs` lays every sender's blob end
  to end with it, so its buffer is the sum of the blobs, not the host count
  times the largest;
* :meth:`Collective.reduce_min`: an element-wise minimum of an int32 vector
  (:func:`snapstore._multihost.agree.max64` builds 64-bit maxima of it; who holds each needed
  piece); :meth:`Collective.start_reduce_min` dispatches one and reads it
  later (a save's retention agreement, :mod:`snapstore._watermark`);
* :meth:`Collective.permute`: one buffer from each sending host to its one
  receiver (a piece moves point to point; no other host sees it).

:class:`JaxCollective` runs them as jitted XLA collectives over the job's
devices in their agreed order (:func:`snapstore._devices.devices`): JAX stays the data
plane. A benchmark stands in a simulated one (``benchmarks/scale.py``) to run
one host's view of a job of thousands through the same code. Every method is
collective: all processes call it in the same order with the same shapes.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from .. import _devices

_AXIS = "snapstore_hosts"


@dataclasses.dataclass
class Traffic:
  """Bytes this host put into collectives and got out of them (what a real
  network would carry to and from it), and the calls made."""

  sent: int = 0
  received: int = 0
  calls: int = 0

  def add(self, sent: int, received: int) -> None:
    self.sent += sent
    self.received += received
    self.calls += 1


class Collective(Protocol):
  """What a multi-host restore needs of the job's hosts."""

  num_hosts: int
  host: int
  traffic: Traffic

  def reduce_or(self, bits: np.ndarray) -> np.ndarray:
    """The bitwise OR over hosts of ``bits`` (uint8, one length everywhere;
    each host sets only its own bit, host ``h`` at bit ``h % 8`` of byte
    ``h // 8``)."""

  def sum_bytes(self, buf: np.ndarray) -> np.ndarray:
    """The sum over hosts of ``buf`` (uint8, one length everywhere), where
    each byte is non-zero on one host at most: that byte, exact."""

  def reduce_min(self, values: np.ndarray) -> np.ndarray:
    """The element-wise minimum over hosts of ``values`` (1-d int32, one
    length everywhere; :data:`NONE` is the largest)."""

  def start_reduce_min(self, values: np.ndarray) -> Callable[[], np.ndarray]:
    """:meth:`reduce_min`, dispatched now (the collective call is this one)
    and read by calling what it returns (which raises its error, if any)."""

  def permute(self, pairs: Sequence[tuple[int, int]], payload: np.ndarray | None,
              width: int) -> np.ndarray | None:
    """Moves each (sender, receiver) pair's buffer of ``width`` bytes: each
    host sends at most one and receives at most one. ``payload``: this
    host's outgoing bytes (at most ``width``; None if it sends nothing).
    Returns the bytes received (``width`` of them), or None."""


def gather_blobs(coll: Collective, blob: bytes) -> list[bytes]:
  """Every host's ``blob``, in process order: who sends (a bitmap), the
  senders' lengths, then their bytes end to end (three collectives; one
  where no host sends)."""
  n = coll.num_hosts
  bits = np.zeros(-(-n // 8), np.uint8)
  if blob:
    bits[coll.host // 8] = 1 << (coll.host % 8)
  # (disjoint bits: their sum is their OR)
  senders = [int(h) for h in np.flatnonzero(
      np.unpackbits(coll.sum_bytes(bits), bitorder="little")[:n])]
  out = [b""] * n
  if not senders:
    return out
  rank = {h: i for i, h in enumerate(senders)}
  lengths = np.zeros(len(senders), np.int64)
  if blob:
    lengths[rank[coll.host]] = len(blob)
  lengths = coll.sum_bytes(lengths.view(np.uint8)).view(np.int64)
  starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
  mine = np.zeros(int(lengths.sum()), np.uint8)
  if blob:
    at = int(starts[rank[coll.host]])
    mine[at:at + len(blob)] = np.frombuffer(blob, np.uint8)
  every = coll.sum_bytes(mine)
  for h, s, k in zip(senders, starts.tolist(), lengths.tolist(), strict=True):
    out[h] = every[s:s + k].tobytes()
  return out


def bucket(n: int) -> int:
  """``n`` rounded up to one of 8 sizes per power of two (at most 12.5%
  more), at least 64: one compiled program serves many sizes."""
  if n <= 64:
    return 64
  step = 1 << max(n.bit_length() - 4, 0)
  return -(-n // step) * step


class JaxCollective:
  """:class:`Collective` as jitted XLA collectives over every device of the
  job in the agreed order (:func:`snapstore._devices.devices`: gloo keys its
  communicators by that list, which an in-place heal renews), each process
  contributing through its first device there and zeros (or the identity)
  through the others. What a host sends and receives is counted as the
  buffer it contributes and gets back."""

  def __init__(self) -> None:
    self.num_hosts = jax.process_count()
    self.host = jax.process_index()
    self.traffic = Traffic()

  @staticmethod
  def _mesh() -> tuple[Mesh, list[jax.Device]]:
    mesh = _mesh_of(tuple(_devices.devices()))
    local = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    return mesh, local

  def _run(self, fn: Any, mine: np.ndarray, fill: Any) -> np.ndarray:
    return _first_shard(self._dispatch(fn, mine, fill))

  def _dispatch(self, fn: Any, mine: np.ndarray, fill: Any) -> jax.Array:
    mesh, local = self._mesh()
    others = np.full_like(mine, fill)
    parts = [jax.device_put((mine if i == 0 else others)[None], d) for i, d in enumerate(local)]
    g = jax.make_array_from_single_device_arrays(
        (mesh.size, mine.size), NamedSharding(mesh, P(_AXIS)), parts)
    return fn(mesh)(g)

  def reduce_or(self, bits: np.ndarray) -> np.ndarray:
    return self.sum_bytes(bits)  # (each host sets only its own bit: no carries)

  def sum_bytes(self, buf: np.ndarray) -> np.ndarray:
    buf = np.ascontiguousarray(buf).reshape(-1).view(np.uint8)
    if not buf.size:
      return buf.copy()
    width = bucket(buf.size)
    mine = np.zeros(width, np.uint8)
    mine[:buf.size] = buf
    every = self._run(_sum_fn, mine, 0)
    self.traffic.add(width, width)
    return every[:buf.size].copy()

  def reduce_min(self, values: np.ndarray) -> np.ndarray:
    return self.start_reduce_min(values)()

  def start_reduce_min(self, values: np.ndarray) -> Callable[[], np.ndarray]:
    values = np.ascontiguousarray(values, np.int32).reshape(-1)
    n = values.size
    if not n:
      return lambda: values
    mine = np.full(bucket(n), NONE, np.int32)
    mine[:n] = values
    out = self._dispatch(_min_fn, mine, NONE)  # (JAX's dispatch: it runs on its own)
    self.traffic.add(mine.nbytes, mine.nbytes)
    return lambda: _first_shard(out)[:n]

  def permute(self, pairs: Sequence[tuple[int, int]], payload: np.ndarray | None,
              width: int) -> np.ndarray | None:
    mesh, _ = self._mesh()
    first: dict[int, int] = {}
    for i, d in enumerate(mesh.devices.flat):
      first.setdefault(d.process_index, i)
    width = bucket(width)
    buf = np.zeros(width, np.uint8)
    if payload is not None:
      buf[:payload.size] = payload
    perm = tuple(sorted((first[a], first[b]) for a, b in pairs))
    out = self._run(lambda m: _permute_fn(m, perm), buf, 0)
    receives = any(b == self.host for _, b in pairs)
    self.traffic.add(width if payload is not None else 0, width if receives else 0)
    return out if receives else None


def _first_shard(out: jax.Array) -> np.ndarray:
  return np.asarray(out.addressable_shards[0].data).reshape(-1)


#: "No host": what :meth:`Collective.reduce_min` hands back where none put less.
NONE = np.iinfo(np.int32).max


@functools.lru_cache(maxsize=16)
def _mesh_of(devices: tuple[jax.Device, ...]) -> Mesh:
  return Mesh(np.array(devices), (_AXIS,))


@functools.lru_cache(maxsize=8)
def _sum_fn(mesh: Mesh) -> Any:
  return jax.jit(lambda g: jnp.sum(g, axis=0, dtype=jnp.uint8),
                 out_shardings=NamedSharding(mesh, P()))


@functools.lru_cache(maxsize=8)
def _min_fn(mesh: Mesh) -> Any:
  return jax.jit(lambda g: jnp.min(g, axis=0), out_shardings=NamedSharding(mesh, P()))


@functools.lru_cache(maxsize=64)
def _permute_fn(mesh: Mesh, perm: tuple[tuple[int, int], ...]) -> Any:
  def body(b: jax.Array) -> jax.Array:
    return jax.lax.ppermute(b, _AXIS, perm)
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(_AXIS), out_specs=P(_AXIS),
                               check_vma=False))
