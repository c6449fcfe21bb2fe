"""Multi-host restore: inventories exchanged, missing pieces moved by JAX.

Every call here is collective: all processes of the restarted job call it in
the same order. Metadata and array bytes alike go through XLA (one jitted
all-reduce over the job's devices in :func:`snapstore._devices.devices` order), never
through a socket of snapstore's own.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import msgpack
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from .. import _devices
from .._index import Index, normalize, overlaps
from .._manifest import Manifest, decode, encode
from .._planner import REBUILT, Copy, StepPlan
from . import collective


def allgather_bytes(blob: bytes) -> list[bytes]:
  """Every process's ``blob``, in process order: two all-reduces (the
  lengths, then the bytes), or one where every blob is empty."""
  n, me = jax.process_count(), jax.process_index()
  lengths = np.zeros(n, np.int64)
  lengths[me] = len(blob)
  lengths = sum_bytes(lengths.view(np.uint8)).view(np.int64)
  if not lengths.any():  # alike everywhere: every process skips the second
    return [b""] * n
  size = int(lengths.max())
  buf = np.zeros(n * size, np.uint8)
  buf[me * size: me * size + len(blob)] = np.frombuffer(blob, np.uint8)
  every = sum_bytes(buf)
  return [every[i * size: i * size + int(lengths[i])].tobytes() for i in range(n)]


def gather_manifests(local: Sequence[Manifest], values: Sequence[int] = ()
                     ) -> tuple[list[Manifest], tuple[int, ...]]:
  """Every process's manifests, and the maximum of each of ``values``
  (as many on every process) over the processes: one exchange (each is two
  all-reduces; a restore's first collectives, before any plan)."""
  blobs = allgather_bytes(msgpack.packb([[encode(m) for m in local], [int(v) for v in values]]))
  out: list[Manifest] = []
  maxes: list[int] | None = None
  for blob in blobs:
    if not blob:  # a process outside the job's membership (it went on without it)
      continue
    manifests, theirs = msgpack.unpackb(blob)
    out.extend(decode(b) for b in manifests)
    if len(theirs) != len(values):
      raise ValueError(f"a process sent {len(theirs)} values to agree on, this one {len(values)}")
    maxes = (list(theirs) if maxes is None
             else [max(a, int(b)) for a, b in zip(maxes, theirs, strict=True)])
  return out, tuple(maxes or ())


def chosen_source(copies: Sequence[Copy]) -> Copy:
  """The copy every host agrees to use: the owner's own, else the lowest
  host's, else a parity rebuild's (which every host holds once rebuilt)."""
  return sorted(copies, key=lambda c: (c.store == REBUILT, c.store != c.record.owner,
                                       c.store))[0]


def contributes(copies: Sequence[Copy], host: int) -> bool:
  """True if ``host`` puts this piece into an exchange (host 0 for a rebuilt one)."""
  store = chosen_source(copies).store
  return store == host or (store == REBUILT and host == 0)


def missing_pieces(plan: StepPlan, leaf: int, sharding: jax.sharding.Sharding,
                   shape: tuple[int, ...]) -> list[Index]:
  """The pieces of ``leaf`` that some host's devices need (they overlap a
  target shard there) and that host holds no copy of, in index order; empty
  where every host can cut its shards from its own copies (a rebuilt piece
  is on every host). The same on every host: a function of the plan."""
  held: dict[int, set[Index]] = {}
  everywhere: set[Index] = set()
  for idx, copies in plan.leaf_copies(leaf).items():
    for c in copies:
      (everywhere if c.store == REBUILT else held.setdefault(c.store, set())).add(idx)
  pieces = list(plan.leaf_copies(leaf))
  out: set[Index] = set()
  idx_map: Mapping[Any, Any] = sharding.devices_indices_map(shape)
  for device, slices in idx_map.items():
    mine = held.get(device.process_index, set())
    target = normalize(slices, shape)
    if target in mine:  # the common case: the saved layout, its own copy
      continue
    for piece, _, _ in overlaps(pieces, target):
      if piece not in mine and piece not in everywhere:
        out.add(piece)
  return sorted(out)


BATCH_BYTES = 64 << 20


_AXIS = "snapstore_all"


@functools.lru_cache(maxsize=8)
def _sum_fn(mesh: Mesh, dtype: Any) -> Any:
  return jax.jit(lambda g: jnp.sum(g, axis=0, dtype=dtype),
                 out_shardings=NamedSharding(mesh, P()))


def sum_words(contribution: np.ndarray) -> np.ndarray:
  """Like :func:`sum_bytes` for uint32 words summed modulo 2**32 (a parity
  rebuild: every process adds what it holds, see :mod:`._parity`), in
  batches of :data:`BATCH_BYTES` (one compiled sum, a bounded buffer on
  every device)."""
  words = contribution.astype(np.uint32, copy=False)
  count = -(-words.size // max(BATCH_BYTES // 4, 1))
  if count <= 1:
    return _sum(words)
  width = -(-words.size // count)  # equal batches: the last one is not mostly padding
  out = np.empty_like(words)
  for at in range(0, words.size, width):
    part = np.zeros(width, np.uint32)
    n = min(width, words.size - at)
    part[:n] = words[at:at + n]
    out[at:at + n] = _sum(part)[:n]
  return out


def sum_bytes(contribution: np.ndarray) -> np.ndarray:
  """Sums every process's flat uint8 ``contribution`` (same length
  everywhere) and returns the total on every process.

  Callers give each byte a non-zero value on at most one process, so the sum
  is that byte, exact. The bytes travel by one jitted all-reduce over every
  device of the job in :func:`snapstore._devices.devices` order (one communicator, keyed
  by that order: see :mod:`snapstore._devices`); a process's first local device carries
  its contribution, the others zeros.
  """
  return _sum(contribution.astype(np.uint8, copy=False))


def bucket(n: int) -> int:
  """``n`` rounded up to one of 8 sizes per power of two (at most 12.5%
  more), at least 4096: the all-reduce is compiled once per size, and
  inventories and batches change size with every step."""
  return collective.bucket(max(n, 4096))


def _sum(contribution: np.ndarray) -> np.ndarray:
  mesh = Mesh(np.array(_devices.devices()), (_AXIS,))
  size = bucket(contribution.size)
  mine = np.zeros((1, size), contribution.dtype)
  mine[0, :contribution.size] = contribution
  zeros = np.zeros_like(mine)
  local = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
  parts = [jax.device_put(mine if i == 0 else zeros, d) for i, d in enumerate(local)]
  g = jax.make_array_from_single_device_arrays(
      (mesh.size, size), NamedSharding(mesh, P(_AXIS)), parts)
  total = _sum_fn(mesh, contribution.dtype)(g)
  return np.asarray(total.addressable_shards[0].data)[:contribution.size]
