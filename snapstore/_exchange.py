"""Multi-host restore: inventories exchanged, missing pieces moved by JAX.

Every call here is collective: all processes of the restarted job call it in
the same order. Small metadata goes through
``multihost_utils.process_allgather``; array bytes go through XLA (a jitted
reduction over a host axis), never through a socket of snapstore's own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import msgpack
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ._index import Index, covered, normalize, volume
from ._manifest import Manifest, decode, encode
from ._planner import Copy, StepPlan


def allgather_bytes(blob: bytes) -> list[bytes]:
  """Every process's ``blob``, in process order."""
  n = np.asarray(multihost_utils.process_allgather(np.array([len(blob)], np.int64)))
  size = int(n.max())
  buf = np.zeros(max(size, 1), np.uint8)
  buf[:len(blob)] = np.frombuffer(blob, np.uint8)
  every = np.asarray(multihost_utils.process_allgather(buf))
  return [every[i, :int(n[i, 0])].tobytes() for i in range(every.shape[0])]


def gather_manifests(local: Sequence[Manifest]) -> list[Manifest]:
  blobs = allgather_bytes(msgpack.packb([encode(m) for m in local]))
  out = []
  for blob in blobs:
    out.extend(decode(b) for b in msgpack.unpackb(blob))
  return out


def gather_ints(value: Sequence[int]) -> np.ndarray:
  return np.asarray(multihost_utils.process_allgather(np.asarray(value, np.int64)))


def chosen_source(copies: Sequence[Copy]) -> Copy:
  """The copy every host agrees to use: the owner's own, else the lowest host."""
  return sorted(copies, key=lambda c: (c.store != c.record.owner, c.store))[0]


def locally_coverable(plan: StepPlan, leaf: int, sharding: jax.sharding.Sharding,
                      shape: tuple[int, ...]) -> bool:
  """True if every device's target shard can be cut from its own host's copies."""
  held: dict[int, set[Index]] = {}
  for (lf, idx), copies in plan.copies.items():
    if lf == leaf:
      for c in copies:
        held.setdefault(c.store, set()).add(idx)
  for device, idx in sharding.devices_indices_map(shape).items():
    target = normalize(idx, shape)
    if covered(held.get(device.process_index, set()), target) != volume(target):
      return False
  return True


BATCH_BYTES = 64 << 20


def _sum_over_hosts(x: jax.Array) -> jax.Array:
  return jnp.sum(x, axis=0, dtype=jnp.uint8)


def sum_bytes(contribution: np.ndarray) -> np.ndarray:
  """Sums every process's flat uint8 ``contribution`` (same length
  everywhere) and returns the total on every process.

  Callers give each byte a non-zero value on at most one process, so the sum
  is that byte, exact. The bytes travel by one jitted reduction over a
  ``(hosts, local)`` mesh; the result is sharded over the local devices, so
  each process holds it once.
  """
  devices = np.array(sorted(jax.devices(), key=lambda d: (d.process_index, d.id)))
  mesh = Mesh(devices.reshape(jax.process_count(), -1), ("hosts", "local"))
  n_local = mesh.shape["local"]
  size = contribution.size
  padded = -(-max(size, 1) // n_local) * n_local
  mine = np.zeros(padded, np.uint8)
  mine[:size] = contribution
  per = padded // n_local
  local = sorted(jax.local_devices(), key=lambda d: d.id)
  parts = [jax.device_put(mine[None, j * per:(j + 1) * per], d) for j, d in enumerate(local)]
  g = jax.make_array_from_single_device_arrays(
      (jax.process_count(), padded), NamedSharding(mesh, P("hosts", "local")), parts)
  total = jax.jit(_sum_over_hosts, out_shardings=NamedSharding(mesh, P("local")))(g)
  shards = sorted(total.addressable_shards, key=lambda sh: sh.index[0].start or 0)
  return np.concatenate([np.asarray(sh.data) for sh in shards])[:size]


def gather_bad(local_bad: Sequence[tuple[int, int, int, Index]]) -> list[Any]:
  rows = [[h, s, lf, [list(r) for r in idx]] for h, s, lf, idx in local_bad]
  out = []
  for blob in allgather_bytes(msgpack.packb(rows)):
    for h, s, lf, idx in msgpack.unpackb(blob):
      out.append((h, s, lf, tuple(tuple(r) for r in idx)))
  return out
