"""Failure domains and where replica shards go.

A failure domain is a set of hosts that fail together: ``host //
hosts_per_domain`` where configured, else ``device.slice_index`` where devices
span several slices, else one domain per host. Replicas are placed by a
ring over domains: replica ``r`` of the shard on host ``h`` (position ``p``
in domain ``k``) lives on the host at position ``p`` of domain
``(k + r) % D``, on the device with the same local position.
The move is a permutation of the mesh's devices, so JAX carries the bytes.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Collection, Mapping, Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from . import _devices
from ._index import Index, normalize
from ._tree import positions


def host_domains(devices: Sequence[jax.Device], hosts_per_domain: int | None) -> dict[int, int]:
  """process index -> failure domain.

  ``hosts_per_domain`` (configured) wins; else ``device.slice_index`` when the
  devices span several slices (CPU devices report slice 0 everywhere); else
  one domain per host.
  """
  if hosts_per_domain:
    return {d.process_index: d.process_index // hosts_per_domain for d in devices}
  slices = {d.process_index: getattr(d, "slice_index", None) for d in devices}
  if None not in slices.values() and len(set(slices.values())) > 1:
    return {h: int(s) for h, s in slices.items() if s is not None}
  return {d.process_index: d.process_index for d in devices}


def host_rings(domains: Mapping[int, int], replicas: int) -> list[dict[int, int]]:
  """Host permutations (host -> the host that keeps a replica of its
  shards), one per replica round, over the hosts of ``domains``.

  Domains of one size: the ring over domains (round ``r`` sends the host at
  position ``p`` of domain ``k`` to position ``p`` of domain ``(k + r) % D``).
  Domains of several sizes (a job that goes on without a host): shifts of
  the hosts sorted by domain, as many as it takes until every host reaches
  ``min(replicas, D - 1)`` other domains; a round may map some hosts into
  their own domain, whose copies are then extra, not missing."""
  by_domain: dict[int, list[int]] = collections.defaultdict(list)
  for h in sorted(domains):
    by_domain[domains[h]].append(h)
  keys = sorted(by_domain)
  want = min(replicas, len(keys) - 1)
  if len({len(v) for v in by_domain.values()}) == 1:
    return [{h: by_domain[keys[(keys.index(k) + r) % len(keys)]][by_domain[k].index(h)]
             for h, k in domains.items()} for r in range(1, want + 1)]
  order = sorted(domains, key=lambda h: (domains[h], h))
  reached: dict[int, set[int]] = {h: set() for h in order}
  rings: list[dict[int, int]] = []
  for shift in range(1, len(order)):
    if all(len(v) >= want for v in reached.values()):
      break
    ring = {h: order[(i + shift) % len(order)] for i, h in enumerate(order)}
    new = {h: domains[p] for h, p in ring.items()
           if domains[p] != domains[h] and len(reached[h]) < want
           and domains[p] not in reached[h]}
    if new:
      rings.append(ring)
      for h, d in new.items():
        reached[h].add(d)
  return rings


def _device_ring(devices: Sequence[jax.Device], ring: Mapping[int, int]
                 ) -> dict[jax.Device, jax.Device]:
  """``ring`` (host -> host) on devices: each host's i-th device (by id) to
  the i-th device of its ring peer."""
  local: dict[int, list[jax.Device]] = collections.defaultdict(list)
  for d in sorted(devices, key=lambda d: d.id):
    local[d.process_index].append(d)
  return {d: local[ring[h]][i] for h, ds in local.items() for i, d in enumerate(ds)}


def replica_shardings(sharding: jax.sharding.Sharding, shape: tuple[int, ...],
                      domains: dict[int, int], replicas: int) -> list[NamedSharding]:
  """Shardings whose devices hold each shard's replicas in other domains.

  Returns [] when every shard already has ``replicas`` twins in other
  domains (data parallelism across domains), or when the sharding is not a
  NamedSharding spanning several domains. Memoized: a state's leaves share a
  few shardings, and this runs for every leaf of every snapshot.
  """
  return list(_replica_shardings(sharding, shape, tuple(sorted(domains.items())), replicas))


@functools.lru_cache(maxsize=4096)
def _replica_shardings(sharding: jax.sharding.Sharding, shape: tuple[int, ...],
                       domain_items: tuple[tuple[int, int], ...],
                       replicas: int) -> tuple[NamedSharding, ...]:
  if replicas == 0 or not isinstance(sharding, NamedSharding):
    return ()
  device_set: set[jax.Device] = sharding.device_set
  present = {d.process_index for d in device_set}  # (a job gone on without a host:
  domains = {h: k for h, k in domain_items if h in present}  # not every host of the job)
  num_domains = len(set(domains.values()))
  if num_domains < 2 or len({domains[d.process_index] for d in device_set}) < 2:
    return ()
  idx_map: Mapping[jax.Device, Any] = sharding.devices_indices_map(shape)
  holders: dict[tuple, set[int]] = collections.defaultdict(set)
  for d, idx in idx_map.items():
    holders[normalize(idx, shape)].add(domains[d.process_index])
  if all(len(v) >= min(replicas + 1, num_domains) for v in holders.values()):
    return ()
  mesh = sharding.mesh
  out = []
  for hosts in host_rings(domains, replicas):
    ring = _device_ring(list(mesh.devices.flat), hosts)
    # Device ring[d] must hold what d holds: place ring[d] where d was.
    devices = np.vectorize(ring.__getitem__, otypes=[object])(mesh.devices)
    out.append(NamedSharding(Mesh(devices, mesh.axis_names,
                                  axis_types=mesh.axis_types), sharding.spec,
                             memory_kind=sharding.memory_kind))
  return tuple(out)


@functools.lru_cache(maxsize=4096)
def owners(sharding: jax.sharding.Sharding, shape: tuple[int, ...]) -> dict[tuple, int]:
  """global index -> lowest process index holding it in ``sharding``."""
  out: dict[tuple, int] = {}
  idx_map: Mapping[jax.Device, Any] = sharding.devices_indices_map(shape)
  for d, idx in idx_map.items():
    key = normalize(idx, shape)
    out[key] = min(out.get(key, d.process_index), d.process_index)
  return out


_AXIS = "snapstore_devices"


def _device_mesh() -> Mesh:
  """All devices on one axis, in the order every process agrees on."""
  return _mesh_of(tuple(_devices.devices()))


@functools.lru_cache(maxsize=16)
def _mesh_of(devices: tuple[jax.Device, ...]) -> Mesh:
  return Mesh(np.array(devices), (_AXIS,))


@functools.lru_cache(maxsize=16)
def _rows(mesh: Mesh) -> NamedSharding:
  """One object per mesh: JAX caches device sets on a sharding object."""
  return NamedSharding(mesh, P(_AXIS))


def ring_permutable(arr: jax.Array) -> bool:
  """True if ``ring_permute`` can carry ``arr``: a NamedSharding over every
  device of the job with even shards."""
  return _ring_permutable(arr.sharding, tuple(arr.shape))


@functools.lru_cache(maxsize=4096)  # every leaf of every save: once per layout
def _ring_permutable(s: jax.sharding.Sharding, shape: tuple[int, ...]) -> bool:
  if not isinstance(s, NamedSharding) or s.device_set != set(jax.devices()):
    return False
  try:
    s.shard_shape(shape)
  except ValueError:
    return False
  return True


def _to_bytes(x: jax.Array) -> jax.Array:
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint8).reshape(-1)
  return jax.lax.bitcast_convert_type(x, jnp.uint8).reshape(-1)


# The permute is two programs, not one: packing (one byte buffer per device,
# per-leaf work) does not depend on the device pairs, so after an in-place
# heal's new device order it comes from the persistent compilation cache
# (:mod:`snapstore.recovery.cache_keys`); only the one-op permute compiles again. As one
# program with the unpacking, the whole of it compiled again after every heal.
@functools.lru_cache(maxsize=4096)  # one per batch layout: a large state has many batches
def _pack_fn(mesh: Mesh, specs: tuple[P, ...] | None = None) -> Any:
  """Each device's shards of the arguments, as bytes, one after another, as
  a row per device of ``mesh`` (in its flat order). ``specs``: the arguments'
  partition specs on ``mesh`` (None: each is one block per device along
  :data:`_AXIS`)."""
  def body(*xs: jax.Array) -> jax.Array:
    return jnp.concatenate([_to_bytes(x) for x in xs])
  axes = tuple(mesh.axis_names)
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(_AXIS) if specs is None else specs,
                               out_specs=P(axes), check_vma=False))


@functools.lru_cache(maxsize=32)
def _move_fn(mesh: Mesh, perms: tuple[tuple[tuple[int, int], ...], ...]) -> Any:
  """``perms[i]`` applied to buffer ``i``: one message per device pair."""
  def body(*bufs: jax.Array) -> tuple[jax.Array, ...]:
    return tuple(jax.lax.ppermute(b, _AXIS, p) for b, p in zip(bufs, perms, strict=True))
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(_AXIS), out_specs=P(_AXIS),
                               check_vma=False))


def _packed(mesh: Mesh, arrays: Sequence[jax.Array]) -> jax.Array:
  """``arrays``' shards as one uint8 row per device of ``mesh``. Arrays in
  device memory that share a mesh whose devices are ``mesh``'s, in its order
  (a state on its trainer's mesh), are packed where they are, in one
  dispatch; others (and staged ``pinned_host`` copies) are
  first relabeled onto ``mesh`` one by one (one JAX call per array: the
  bulk of a save's cost for a state of a hundred small leaves)."""
  rows = _rows(mesh)
  own = arrays[0].sharding.mesh if isinstance(arrays[0].sharding, NamedSharding) else None
  if (isinstance(own, Mesh) and all(isinstance(a.sharding, NamedSharding)
                                    and a.sharding.mesh == own
                                    and a.sharding.memory_kind in (None, "device")
                                    for a in arrays)
      and own.devices.size == mesh.devices.size
      and all(a is b for a, b in zip(own.devices.flat, mesh.devices.flat, strict=True))):
    specs = tuple(cast(NamedSharding, a.sharding).spec for a in arrays)  # checked above
    buf = _pack_fn(own, specs)(*arrays)
    return jax.make_array_from_single_device_arrays(
        buf.shape, rows, [s.data for s in buf.addressable_shards])
  stacked = []
  for a in arrays:
    shard = tuple(a.sharding.shard_shape(tuple(a.shape))) or (1,)
    datas = [a.addressable_data(i) for i in range(len(a.sharding.addressable_devices))]
    datas = datas if a.ndim else [d.reshape(1) for d in datas]
    stacked.append(jax.make_array_from_single_device_arrays(
        (shard[0] * mesh.size, *shard[1:]), rows, datas))
  return _pack_fn(mesh)(*stacked)


def shard_nbytes(a: jax.Array) -> int:
  """Bytes of each shard of ``a`` (even shards: see :func:`ring_permutable`)."""
  return _shard_nbytes(a.sharding, tuple(a.shape), np.dtype(a.dtype).itemsize)


@functools.lru_cache(maxsize=4096)
def _shard_nbytes(s: jax.sharding.Sharding, shape: tuple[int, ...], itemsize: int) -> int:
  return int(np.prod(s.shard_shape(shape), dtype=np.int64)) * itemsize


@functools.lru_cache(maxsize=4096)
def _perm_key(src: Mesh, dst: Mesh, order: tuple[jax.Device, ...]) -> tuple[tuple[int, int], ...]:
  """The permutation that moves each device of ``src`` to the device at the
  same place in ``dst``, as (from, to) positions in ``order``."""
  pos = {d: i for i, d in enumerate(order)}
  return tuple(sorted((pos[a], pos[b])
                      for a, b in zip(src.devices.flat, dst.devices.flat, strict=True)))


def ring_permute(arrays: Sequence[jax.Array], targets: Sequence[NamedSharding]
                 ) -> list[tuple[jax.Array, list[int], list[int]]]:
  """Sends each device's shard of ``arrays[i]`` to the device at its place
  in ``targets[i]``'s mesh (a permutation of its own): the
  arrays that share a permutation travel as one byte buffer per device, in
  one jitted collective permute (XLA carries the bytes). Returns, per such
  group: the uint8 buffer received, one row per device of the agreed device
  mesh (:func:`_device_mesh`, ``rows`` sharding: row ``k`` on its device
  ``k``); the positions in ``arrays`` of the group's members; and the byte
  offset of each member's shard in every row. Collective: every process
  calls it with the same arrays."""
  mesh = _device_mesh()
  flat = tuple(mesh.devices.flat)
  groups: dict[tuple[tuple[int, int], ...], list[int]] = {}
  for i, (a, t) in enumerate(zip(arrays, targets, strict=True)):
    mesh_of = cast(NamedSharding, a.sharding).mesh  # ring_permutable arrays only
    groups.setdefault(_perm_key(mesh_of, t.mesh, flat), []).append(i)
  order = sorted(groups)
  packed = [_packed(mesh, [arrays[i] for i in groups[p]]) for p in order]
  out = []
  for p, buf in zip(order, _move_fn(mesh, tuple(order))(*packed), strict=True):
    which = groups[p]
    offsets = np.cumsum([0] + [shard_nbytes(arrays[i]) for i in which[:-1]]).tolist()
    out.append((buf, which, offsets))
  return out


def ring_keepers(holders: Collection[int], order: Sequence[int], replicas: int) -> list[int]:
  """The domains that keep a piece: those holding it, then the next domains
  after the lowest holder, in ring ``order``, until ``1 + replicas`` do."""
  keepers = set(holders)
  k = order.index(min(holders))
  while len(keepers) < min(1 + replicas, len(order)):
    k = (k + 1) % len(order)
    keepers.add(order[k])
  return sorted(keepers)


# index -> ((domain, position of its first shard there), ...), per distinct index
HolderLayout = tuple[tuple[Index, tuple[tuple[int, int], ...]], ...]


def holder_layout(path: str, arr: jax.Array, domain_of: Mapping[jax.Device, int]
                  ) -> HolderLayout:
  """Single controller: each distinct index of ``arr``, with the domains
  holding it and the position (in :func:`shard_arrays`) of each one's first
  shard. The same for every array of a sharding: computed once (a state has
  thousands of shards). Raises ValueError if a shard sits on a device of no
  active domain."""
  layout = _holder_layout(arr.sharding, tuple(arr.shape), tuple(domain_of.items()),
                          tuple(positions(arr)))
  if isinstance(layout, str):
    raise ValueError(f"leaf {path!r} has a shard on {layout}, which is in no slice that "
                     "is up; snapshots go to the active slices only")
  return layout


def shard_arrays(arr: jax.Array) -> list[jax.Array]:
  """Each addressable shard's array, in position order. ``addressable_data``:
  the shards' own arrays (``addressable_shards`` makes a Shard object per
  device, kept with the array: garbage the collector walks, thousands a
  snapshot), except for a fully replicated array, where it hands out one
  device's copy for every position."""
  if arr.is_fully_replicated:
    return [s.data for s in arr.addressable_shards]
  return [arr.addressable_data(at) for at in range(len(positions(arr)))]


@functools.lru_cache(maxsize=4096)
def _holder_layout(sharding: jax.sharding.Sharding, shape: tuple[int, ...],
                   domain_of: tuple[tuple[jax.Device, int], ...], device_ids: tuple[int, ...]
                   ) -> HolderLayout | str:
  """:func:`holder_layout`, ``device_ids`` in position order; or the first
  device of no domain, as text."""
  where = {device.id: d for device, d in domain_of}
  idx_map: Mapping[jax.Device, Any] = sharding.addressable_devices_indices_map(shape)
  indices = {device.id: idx for device, idx in idx_map.items()}
  out: dict[Index, dict[int, int]] = {}
  for at, device_id in enumerate(device_ids):
    d = where.get(device_id)
    if d is None:
      device_set: set[jax.Device] = sharding.device_set
      return next(str(x) for x in device_set if x.id == device_id)
    out.setdefault(normalize(indices[device_id], shape), {}).setdefault(d, at)
  return tuple((index, tuple(held.items())) for index, held in out.items())
