"""``PinnedMemory.SLICE_HOSTS`` at the link's speed: each leaf staged in
device memory as pieces, then moved into the host memory of the devices
that keep them.

A ``device_put`` of a whole leaf to ``pinned_host`` moves ~1 GB/s on a TPU
v5e; pieces of ~4 MiB moved into ``unpinned_host`` (the host memory kind a
device offers beside ``pinned_host``) reach the link's 12-14 GB/s
(``shared/FIELD-NOTES.md``, "Device to host on a TPU v5e"). So a leaf with
a mesh sharding goes through one jitted ``shard_map`` program (:class:`SliceStager`)
that makes, on every device at once, its shard's bytes as consecutive flat
parts of at most ``piece_bytes`` and the shard's on-device checksum; then
one batched ``device_put`` moves every part into its own device's host
memory (:func:`to_host`), and copies for the next failure domains are puts
of those host parts onto the shifted devices (the ring's, as before). On
Pathways every put runs on the TPU hosts: the controller sends array
handles, never bytes (``xla/python/ifrt_proxy``'s ``CopyArrays``).

A kept copy is a :class:`HostParts`: the parts of one shard, single-device
arrays in one device's host memory. Restore moves them back and joins them
into the shard in one program that also recomputes its checksum
(:func:`join`).

What ran where: CPU devices here (one process; their host memories are this
process's RAM) and one TPU v5e chip (one process). Whether Pathways' remote
hosts offer ``unpinned_host`` is not known here; :func:`host_kind` takes it
where a device lists it, else ``pinned_host``. The host arrays are fresh
every save (a ``device_put`` allocates its result; JAX offers no put into
an existing buffer), so the runtime's allocator, not snapstore, decides
whether their memory is reused: a TPU host's pinned arena keeps what it
took.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ..._checksum import _sums
from ..._jax_compat import host_array_to_device, single_device_sharding
from ..._tree import positions
from ..staging import Report, _group_bytes, part_bounds

#: Host memory kinds in order of preference (:func:`host_kind`).
HOST_KINDS = ("unpinned_host", "pinned_host")


@functools.lru_cache(maxsize=1 << 16)
def host_kind(device: jax.Device) -> str:
  """The host memory kind a staged copy goes to on ``device``: the first of
  :data:`HOST_KINDS` it offers."""
  try:
    kinds = {m.kind for m in device.addressable_memories()}
  except Exception:  # noqa: BLE001 - a runtime without the memories API
    kinds = set()
  return next((k for k in HOST_KINDS if k in kinds), HOST_KINDS[-1])


@dataclasses.dataclass(eq=False)
class HostParts:
  """One shard kept as consecutive flat parts, single-device arrays in the
  host memory of ``device``: part ``k`` is elements ``bounds[k]:bounds[k+1]``
  of the shard's C-order elements."""

  parts: tuple[jax.Array, ...]
  shape: tuple[int, ...]
  device: jax.Device

  @property
  def nbytes(self) -> int:
    return sum(int(p.nbytes) for p in self.parts)

  @property
  def memory_kind(self) -> str | None:
    return self.parts[0].sharding.memory_kind if self.parts else None

  def devices(self) -> set[jax.Device]:
    return {self.device}

  def is_deleted(self) -> bool:
    return any(p.is_deleted() for p in self.parts)

  def delete(self) -> None:
    for p in self.parts:
      try:
        p.delete()
      except Exception:  # noqa: BLE001 - an array of a lost slice may not answer
        pass


def stageable(arr: jax.Array) -> bool:
  """Whether :meth:`SliceStager.stage` can stage ``arr``: a mesh sharding
  of device memory that splits every dimension evenly, and bytes to move."""
  s = arr.sharding
  if not isinstance(s, NamedSharding) or not isinstance(s.mesh, Mesh) or arr.size == 0:
    return False
  if s.memory_kind not in (None, "device"):
    return False
  try:
    s.shard_shape(tuple(arr.shape))  # (raises where a dimension does not divide)
  except ValueError:
    return False
  return True


@dataclasses.dataclass
class Staged:
  """A leaf's parts (global 1-D arrays of devices x part length, a device's
  part its row; filled when :meth:`SliceStager.flush` issues the puts), and
  its shards' checksums (uint32[devices, 2], rows as :attr:`rows` says)."""

  sums: jax.Array
  rows: dict[jax.Device, int]
  shape: tuple[int, ...]  # of one shard
  parts: list[jax.Array] = dataclasses.field(default_factory=list)

  def on(self, device: jax.Device) -> HostParts:
    """The parts of ``device``'s row (call once they are in host memory)."""
    if not self.parts:
      raise RuntimeError("staged parts read before their puts were issued")
    return HostParts(tuple(p.addressable_data(positions(p)[device.id]) for p in self.parts),
                     self.shape, device)


@dataclasses.dataclass(frozen=True)
class Pending:
  """A kept copy whose host parts are under way: ``device``'s row of ``staged``."""

  staged: Staged
  device: jax.Device

  def resolve(self) -> HostParts:
    return self.staged.on(self.device)


class SliceStager:
  """Stages one capture's leaves (:meth:`stage`) within a device-memory
  budget, and moves their parts to host memory in batched puts
  (:meth:`flush`). ``room``: bytes a device may hold staged at once (None:
  no limit). Per capture, on the training thread."""

  def __init__(self, *, piece_bytes: int, chunk_bytes: int, room: int | None) -> None:
    self.piece_bytes, self.chunk_bytes, self.room = piece_bytes, chunk_bytes, room
    self._puts: list[tuple[Staged, list[jax.Array], NamedSharding]] = []  # to issue
    self._rings: list[tuple[Staged, Staged, NamedSharding]] = []  # (from, to, where)
    self._flying: list[jax.Array] = []  # host parts issued, not known landed
    self._held = 0     # bytes a device holds staged, issued or not
    self._held_all = 0  # the same, over every device
    self._waited = 0   # bytes (every device's) waited for before the capture returned
    self._stall = 0.0
    self._total = 0
    self.peak = 0      # the most a device held staged at once

  @property
  def staging(self) -> bool:
    """Whether the budget leaves room to stage (two pieces at least): else
    leaves go to ``pinned_host`` as they are."""
    return self.room is None or self.room >= 2 * self.piece_bytes

  def stage(self, arr: jax.Array) -> Staged:
    """``arr`` (:func:`stageable`) cut into parts in device memory, with its
    shards' checksums, their puts to host memory queued. Over ``room`` the
    parts are made in groups, each after the ones before it have landed."""
    s = arr.sharding
    assert isinstance(s, NamedSharding) and isinstance(s.mesh, Mesh)
    shape = tuple(s.shard_shape(tuple(arr.shape)))
    itemsize = np.dtype(arr.dtype).itemsize
    nbytes = int(np.prod(shape, dtype=np.int64)) * itemsize
    bounds = part_bounds(nbytes, itemsize, self.piece_bytes, self.chunk_bytes)
    elems = tuple(b // itemsize for b in bounds)
    rows = rows_sharding(s.mesh)
    staged: Staged | None = None
    for lo, hi in self._groups(bounds):
      n = bounds[hi] - bounds[lo]
      if self.room is not None and self._held and self._held + n > self.room:
        self._wait()
      parts = list(_cutter(s.mesh, s.spec, elems[lo:hi + 1], staged is None)(arr))
      if staged is None:  # the first group's program also sums every shard
        staged = Staged(parts.pop(), {d: r for r, d in enumerate(s.mesh.devices.flat)},
                        shape)
      self._puts.append((staged, parts, rows))
      del parts  # (the queue holds them until flush)
      self._held += n
      self._held_all += n * s.mesh.devices.size
      self.peak = max(self.peak, self._held)
      self._total += n * s.mesh.devices.size
    assert staged is not None
    return staged

  def ring(self, staged: Staged, mesh: Mesh) -> Staged:
    """A copy of ``staged``'s host parts on ``mesh``'s devices (row for
    row), put once :meth:`flush` has issued ``staged``'s own puts."""
    copy = Staged(staged.sums, staged.rows, staged.shape)
    self._rings.append((staged, copy, rows_sharding(mesh)))
    return copy

  def flush(self) -> None:
    """Issues every queued put: device to host (one batched ``device_put``),
    then the ring copies host to host (another)."""
    if self._puts:
      flat = [p for _, parts, _ in self._puts for p in parts]
      got = to_host(flat, [sh for _, parts, sh in self._puts for _ in parts])
      at = 0
      for staged, parts, _ in self._puts:
        staged.parts.extend(got[at:at + len(parts)])
        at += len(parts)
      self._flying.extend(got)
      self._puts.clear()
    rings = self._rings
    if rings:
      flat = [p for src, _, _ in rings for p in src.parts]
      got = to_host(flat, [sh for src, _, sh in rings for _ in src.parts])
      at = 0
      for src, copy, _ in rings:
        copy.parts.extend(got[at:at + len(src.parts)])
        at += len(src.parts)
      rings.clear()

  def report(self) -> Report:
    """What staging did (bytes over every device): left in flight when the
    capture returned, waited for before it did, and the wait."""
    return Report(staged_bytes=self._total - self._waited, copied_bytes=self._waited,
                       stall_seconds=self._stall)

  def _wait(self) -> None:
    t = time.perf_counter()
    self.flush()
    jax.block_until_ready(self._flying)
    self._flying.clear()
    self._waited += self._held_all
    self._held = self._held_all = 0
    self._stall += time.perf_counter() - t

  def _groups(self, bounds: tuple[int, ...]) -> list[tuple[int, int]]:
    """Consecutive parts (first, one past last) in groups of at most half
    the room (all in one without a limit or where they fit)."""
    n = len(bounds) - 1
    if self.room is None or bounds[-1] <= self.room:
      return [(0, n)]
    # half the room, rounded down to a power of two of pieces: a few group
    # sizes, so a few compiled cuts, as the free memory moves
    limit = _group_bytes(self.room, self.piece_bytes)
    out, lo = [], 0
    for k in range(1, n + 1):
      if k - 1 > lo and bounds[k] - bounds[lo] > limit:
        out.append((lo, k - 1))
        lo = k - 1
    out.append((lo, n))
    return out


@functools.lru_cache(maxsize=1024)
def _cutter(mesh: Mesh, spec: P, elems: tuple[int, ...], sums: bool) -> Callable[..., Any]:
  """A jitted program over ``mesh``: each device's shard flattened, its
  elements ``elems[k]:elems[k + 1]`` as part ``k`` (a row of a global array),
  and with ``sums`` the shard's checksum last."""
  axes = tuple(mesh.axis_names)

  def body(x: jax.Array) -> tuple[jax.Array, ...]:
    flat = x.reshape(-1)  # (each part 1-D: a device's row of (devices x length))
    parts = [flat[a:b] for a, b in itertools.pairwise(elems)]
    return (*parts, _sums(x)[None]) if sums else tuple(parts)
  n = len(elems) - 1 + (1 if sums else 0)
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,),
                               out_specs=(P(axes),) * n, check_vma=False))


@functools.lru_cache(maxsize=1024)
def rows_sharding(mesh: Mesh) -> NamedSharding:
  """One row a device of ``mesh``, in device memory."""
  return NamedSharding(mesh, P(tuple(mesh.axis_names)))


def to_host(parts: Sequence[jax.Array], shardings: Sequence[NamedSharding]) -> list[jax.Array]:
  """Each of ``parts`` moved into host memory on the devices of its
  sharding (one batched ``device_put``; dispatched, not waited for). A
  sharding naming other devices than its part's is a ring copy: the part
  must be in host memory already (a put changes devices or memory kind,
  not both)."""
  targets = [s.with_memory_kind(host_kind(next(iter(s.device_set)))) for s in shardings]
  return list(jax.device_put(list(parts), targets, may_alias=False))


def join(held: HostParts, device: jax.Device) -> tuple[jax.Array, jax.Array]:
  """(the shard ``held`` keeps, in ``device``'s memory; its checksum, made
  in the same program from the bytes that arrived)."""
  if device.platform == "cpu":  # (_jax_compat.host_array_to_device: jaxlib 0.12.1)
    moved = [host_array_to_device(p, device) for p in held.parts]
  else:
    moved = jax.device_put(list(held.parts),
                           [single_device_sharding(device)] * len(held.parts))
  return _joiner(held.shape)(*moved)


@functools.lru_cache(maxsize=1024)
def _joiner(shape: tuple[int, ...]) -> Callable[..., tuple[jax.Array, jax.Array]]:
  def body(*parts: jax.Array) -> tuple[jax.Array, jax.Array]:
    flat = parts[0].reshape(-1) if len(parts) == 1 else jnp.concatenate(
        [p.reshape(-1) for p in parts])
    x = flat.reshape(shape)
    return x, _sums(x)
  return jax.jit(body)


def join_leaf(held: Sequence[HostParts], sharding: NamedSharding, shape: tuple[int, ...]
              ) -> tuple[jax.Array, jax.Array, dict[jax.Device, int]] | None:
  """A whole leaf from its devices' staged copies in one program: each part
  made one global array in host memory (``held[i]`` on the ``i``-th device
  of ``sharding``'s mesh), all moved in one batched put, joined into the
  shards by one ``shard_map``, which also sums each shard. Returns (the
  leaf, uint32[devices, 2] sums, device -> its row), or None where the
  copies do not line up (the caller joins them one by one)."""
  mesh = sharding.mesh
  if not isinstance(mesh, Mesh) or not held:
    return None
  devices = list(mesh.devices.flat)
  first = held[0]
  lengths = tuple(int(p.size) for p in first.parts)
  if (len(held) != len(devices) or any(h.device != d for h, d in zip(held, devices, strict=True))
      or any(h.shape != first.shape or tuple(int(p.size) for p in h.parts) != lengths
             for h in held)
      or any(p.ndim != 1 for h in held for p in h.parts)):
    return None
  rows = rows_sharding(mesh)
  kind = first.memory_kind
  where = rows.with_memory_kind(kind) if kind else rows
  globals_ = [jax.make_array_from_single_device_arrays((len(devices) * n,), where,
                                                       [h.parts[k] for h in held])
              for k, n in enumerate(lengths)]
  moved = jax.device_put(globals_, [rows] * len(globals_))
  arr, sums = _leaf_joiner(mesh, sharding.spec, first.shape, len(lengths))(*moved)
  if tuple(arr.shape) != tuple(shape):
    return None
  return arr, sums, {d: r for r, d in enumerate(devices)}


@functools.lru_cache(maxsize=1024)
def _leaf_joiner(mesh: Mesh, spec: P, shard: tuple[int, ...], n: int
                 ) -> Callable[..., tuple[jax.Array, jax.Array]]:
  axes = tuple(mesh.axis_names)

  def body(*parts: jax.Array) -> tuple[jax.Array, jax.Array]:
    flat = parts[0] if n == 1 else jnp.concatenate(parts)
    x = flat.reshape(shard)
    return x, _sums(x)[None]
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(axes),) * n,
                               out_specs=(spec, P(axes)), check_vma=False))

