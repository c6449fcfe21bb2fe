"""The pinned-host store (single controller, Pathways): snapshots held as
``pinned_host`` jax.Arrays on each failure domain's own hosts.

On Pathways the controller owns every array but the bytes of a
``pinned_host`` array live in the RAM of the host of its device. So a
snapshot is one single-device ``pinned_host`` array per stored piece, put on a
device of the domain (slice) that keeps it: its own shards, plus a copy of
each shard that has no data-parallel twin on the next domains in ring order.
Losing a slice loses exactly the arrays on its devices; the other domains'
arrays stay valid. Nothing crosses to the controller on save or restore but
the checksums (:mod:`._checksum`): computed on the device where the
controller cannot address the pinned memory (TPU, GPU), crc32c of the pinned
buffer where it can (CPU).

Each domain's store mirrors :class:`._hoststore.HostStore`: manifests (in this
process's memory; ``PieceRecord.offset`` is the piece's position in the
domain's array list, ``crcs`` its checksum), so the planner and the retention
rules are shared. Numpy leaves and Python scalars are controller state (the
controller survives on Pathways) and are kept as controller copies.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent import futures
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding

from . import _faults, errors
from ._assemble import BadCopy, build_leaf, overlaps
from ._checksum import Checksum, as_checksum, device_checksum, host_crc, shard_checksums
from ._layout import Index, LeafKind, LeafSpec, Piece, normalize_index, wants_numpy
from ._manifest import Manifest
from ._persistent import target_sharding
from ._placement import ring_keepers
from ._planner import Copy, CopyKey, StepPlan

logger = logging.getLogger(__name__)

PINNED = "pinned_host"
Stored = jax.Array | np.ndarray
HOST, DEVICE = "host", "device"  # where checksums are computed


def integrity_for(devices: Sequence[jax.Device]) -> str:
  """``host`` where the controller addresses pinned memory in place (CPU)."""
  return HOST if all(d.platform == "cpu" for d in devices) else DEVICE


def supports_pinned_host(devices: Sequence[jax.Device]) -> bool:
  """True if every device has a ``pinned_host`` memory space."""
  try:
    return all(any(m.kind == PINNED for m in d.addressable_memories()) for d in devices)
  except Exception:  # noqa: BLE001 - a backend without memories API
    return False


class PinnedHostStore:
  """One failure domain's snapshots: manifests plus their arrays."""

  def __init__(self, domain: int, *, keep: int, budget_bytes: int | None):
    self.host = domain  # the planner names copies by the store's id
    self.keep = keep
    self.budget_bytes = budget_bytes
    self._snaps: dict[int, tuple[Manifest, list[Stored]]] = {}
    self._num_slots = keep + 1
    self._progress = (-1, 0)

  def __repr__(self) -> str:
    return f"pinned_host store of slice {self.host}"

  @property
  def num_slots(self) -> int:
    return self._num_slots

  def plan_slots(self, snapshot_bytes: int) -> int:
    """Snapshots this domain may hold at once: min(keep + 1, budget // size)."""
    want = self.keep + 1
    if self.budget_bytes is not None:
      fit = self.budget_bytes // max(snapshot_bytes, 1)
      if fit < 2:
        raise errors.BudgetExceededError(
            f"a snapshot of this state takes {snapshot_bytes} bytes of pinned host "
            f"memory on slice {self.host}; the budget of {self.budget_bytes} bytes must "
            f"hold two (the newest complete one and the one being written): raise "
            f"budget_bytes to at least {2 * snapshot_bytes} or shrink the state.")
      want = min(want, fit)
    self._num_slots = want
    return want

  def make_room(self, step: int) -> None:
    """Evicts the oldest snapshots so the one being taken fits."""
    while len(self._snaps) >= self._num_slots:
      self.delete(min(self._snaps), f"evicted for step {step}")

  def manifests(self) -> list[Manifest]:
    return [self._snaps[s][0] for s in sorted(self._snaps)]

  def array(self, step: int, position: int) -> Stored:
    return self._snaps[step][1][position]

  def commit(self, manifest: Manifest, arrays: list[Stored]) -> None:
    _faults.point("manifest", manifest.step)
    self._snaps[manifest.step] = (manifest, arrays)

  def delete(self, step: int, reason: str) -> None:
    logger.debug("slice %d: dropping snapshot of step %d (%s)", self.host, step, reason)
    entry = self._snaps.pop(step, None)
    if entry is not None:
      _free(entry[1])

  def wipe(self) -> None:
    """Forgets every snapshot (the domain's host memory is gone)."""
    for step in list(self._snaps):
      self.delete(step, "wiped")
    self._progress = (-1, 0)

  def write_progress(self, step: int, incarnation: int) -> None:
    self._progress = (step, incarnation)

  def read_progress(self) -> tuple[int, int]:
    return self._progress

  def close(self) -> None:
    self.wipe()


def _free(arrays: Sequence[Stored]) -> None:
  for a in arrays:
    if isinstance(a, jax.Array):
      try:
        a.delete()
      except Exception:  # noqa: BLE001 - an array of a lost slice may not answer
        pass


# ------------------------------------------------------------------ capture
@dataclasses.dataclass
class PinnedCapture:
  """Pieces per domain, dispatched (not yet complete) ``pinned_host`` copies,
  and the checksum of every distinct piece (pending on device)."""

  pieces: dict[int, list[tuple[Piece, int]]]   # domain -> (piece, owner domain)
  arrays: dict[int, list[Stored]]
  sums: dict[tuple[int, Index], Callable[[], Checksum]]
  scalars: dict[int, Any]

  def nbytes(self, domain: int) -> int:
    return sum(p.nbytes for p, _ in self.pieces[domain])

  def wait(self) -> None:
    """Blocks until every copy has landed (raises if a slice died meanwhile)."""
    jax.block_until_ready([a for arrs in self.arrays.values() for a in arrs
                           if isinstance(a, jax.Array)])

  def checksums(self, domain: int, pool: futures.Executor) -> list[Checksum]:
    """Each piece's checksum (crc32c of host copies runs on ``pool``)."""
    return list(pool.map(lambda p: self.sums[(p[0].leaf, p[0].index)](), self.pieces[domain]))


def capture(specs: Sequence[LeafSpec], leaves: Sequence[Any], *,
            slices: Mapping[int, Sequence[jax.Device]], replicas: int,
            step: int = -1, integrity: str = DEVICE,
            before_dispatch: Callable[[dict[int, int]], None] = lambda nbytes: None
            ) -> PinnedCapture:
  """Dispatches ``pinned_host`` copies of every piece to the domains that keep
  it; returns at once (the copies and checksums complete asynchronously, and
  XLA orders them before any later step that donates the buffers).

  ``before_dispatch(bytes per domain)`` runs before any memory is taken: it
  may raise (over budget) or evict older snapshots.
  """
  ring = _Ring(slices)
  cap = PinnedCapture({k: [] for k in ring.order}, {k: [] for k in ring.order}, {}, {})
  planned: list[tuple[int, jax.Array, _LeafPlan]] = []
  for i, (spec, leaf) in enumerate(zip(specs, leaves)):
    if i == len(specs) // 2:
      _faults.point("capture", step)
    if spec.kind is LeafKind.SCALAR:
      cap.scalars[i] = leaf
    elif spec.kind is LeafKind.NUMPY:
      data = np.array(leaf, copy=True)  # the caller may mutate it
      index = tuple((0, n) for n in data.shape)
      ck = host_crc(data)
      cap.sums[(i, index)] = lambda c=ck: c
      for k in ring.order:
        cap.pieces[k].append((Piece(i, index, data.nbytes), ring.order[0]))
        cap.arrays[k].append(data)
    else:
      arr = jax.random.key_data(leaf) if spec.kind is LeafKind.KEY else leaf
      plan = _LeafPlan.of(spec, arr, ring, replicas)
      for (index, d), owner in plan.keep.items():
        cap.pieces[d].append((Piece(i, index, plan.nbytes(index)), owner))
        cap.arrays[d].append(None)  # filled at dispatch
      planned.append((i, arr, plan))
  before_dispatch({d: cap.nbytes(d) for d in ring.order})
  slot = {(p.leaf, p.index, d): n for d, ps in cap.pieces.items() for n, (p, _) in enumerate(ps)}
  for i, arr, plan in planned:
    per_shard = shard_checksums(arr) if integrity == DEVICE else None
    for (index, d), copy in plan.dispatch(arr, ring).items():
      cap.arrays[d][slot[(i, index, d)]] = copy
    first: dict[Index, int] = {}  # the lowest domain keeping each piece
    for index, d in plan.keep:
      first[index] = min(d, first.get(index, d))
    for index, src in plan.sources.items():
      d = first[index]
      cap.sums[(i, index)] = (_pending_sum(src, per_shard) if integrity == DEVICE
                              else _host_sum(cap, d, slot[(i, index, d)]))
  return cap


class _Ring:
  """Failure domains in ring order, and each device's place in its domain."""

  def __init__(self, slices: Mapping[int, Sequence[jax.Device]]):
    self.slices = {k: list(v) for k, v in slices.items()}
    self.order = sorted(self.slices)
    self._where = {d: (k, i) for k, devs in self.slices.items() for i, d in enumerate(devs)}

  def domain(self, device: jax.Device) -> int:
    return self._where[device][0]

  def shifted(self, device: jax.Device, k: int) -> jax.Device | None:
    """The device at the same place ``k`` domains further on the ring."""
    d, pos = self._where[device]
    target = self.slices[self.order[(self.order.index(d) + k) % len(self.order)]]
    return target[pos] if pos < len(target) else None


@dataclasses.dataclass
class _LeafPlan:
  """Which (index, domain) copies one leaf needs, and from where."""

  itemsize: int
  holders: dict[Index, dict[int, jax.Array]]  # index -> domain -> its shard data
  keep: dict[tuple[Index, int], int]          # (index, domain) -> owner domain
  sources: dict[Index, jax.Array]             # index -> the owner's shard

  @classmethod
  def of(cls, spec: LeafSpec, arr: jax.Array, ring: _Ring, replicas: int) -> _LeafPlan:
    shape = tuple(arr.shape)
    holders: dict[Index, dict[int, jax.Array]] = {}
    for shard in arr.addressable_shards:
      try:
        d = ring.domain(shard.device)
      except KeyError:
        raise ValueError(f"leaf {spec.path!r} has a shard on {shard.device}, which is in "
                         "no slice that is up; snapshots go to the active slices only"
                         ) from None
      holders.setdefault(normalize_index(shard.index, shape), {}).setdefault(d, shard.data)
    keep: dict[tuple[Index, int], int] = {}
    sources = {}
    for index, by_domain in holders.items():
      owner = min(by_domain)
      sources[index] = by_domain[owner]
      keep.update({(index, d): owner for d in ring_keepers(by_domain, ring.order, replicas)})
    return cls(arr.dtype.itemsize, holders, keep, sources)

  def nbytes(self, index: Index) -> int:
    return int(np.prod([b - a for a, b in index], dtype=np.int64)) * self.itemsize

  def dispatch(self, arr: jax.Array, ring: _Ring) -> dict[tuple[Index, int], jax.Array]:
    """Starts the copies: whole-array ``device_put``s where the sharding
    allows (async, one dispatch, all devices in parallel), else one put per
    piece."""
    out: dict[tuple[Index, int], jax.Array] = {}
    shape = tuple(arr.shape)
    own = [key for key in self.keep if key[1] in self.holders[key[0]]]
    dense = sum(len(v) for v in self.holders.values()) == len(arr.sharding.device_set)
    whole = None  # the whole leaf in pinned_host memory, where it was put at once
    if own and dense and isinstance(arr.sharding, NamedSharding):
      whole = jax.device_put(arr, arr.sharding.with_memory_kind(PINNED))
      self._collect(whole, ring, shape, own, out)
    else:
      for index, d in own:
        data = self.holders[index][d]
        out[(index, d)] = jax.device_put(data, _pinned_on(_device(data)))
    by_shift: dict[int, list[tuple[Index, int]]] = {}
    n = len(ring.order)
    for index, t in self.keep:
      if t not in self.holders[index]:
        k = next(k for k in range(1, n)
                 if ring.order[(ring.order.index(t) - k) % n] in self.holders[index])
        by_shift.setdefault(k, []).append((index, t))
    for k, wanted in sorted(by_shift.items()):
      moved = _ring_sharding(arr.sharding, ring, k)
      if moved is not None:
        if whole is None:  # a put may change devices or memory kind, not both
          whole = jax.device_put(arr, arr.sharding.with_memory_kind(PINNED))
        self._collect(jax.device_put(whole, moved), ring, shape, wanted, out)
        continue
      for index, t in wanted:  # one by one, from the domain k places back
        src_domain = ring.order[(ring.order.index(t) - k) % n]
        data = self.holders[index][src_domain]
        there = ring.shifted(_device(data), k) or ring.slices[t][0]
        out[(index, t)] = jax.device_put(data, _pinned_on(there))
    return out

  @staticmethod
  def _collect(copy: jax.Array, ring: _Ring, shape: tuple[int, ...],
               wanted: Sequence[tuple[Index, int]], out: dict) -> None:
    want = set(wanted)
    for shard in copy.addressable_shards:
      key = (normalize_index(shard.index, shape), ring.domain(shard.device))
      if key in want and key not in out:
        out[key] = shard.data


def _pinned_on(device: jax.Device) -> SingleDeviceSharding:
  return SingleDeviceSharding(device, memory_kind=PINNED)


def _ring_sharding(sharding: jax.sharding.Sharding, ring: _Ring, k: int
                   ) -> NamedSharding | None:
  """``sharding`` with every device replaced by the one ``k`` domains on, in
  ``pinned_host`` memory: a put onto it copies each shard to the next domain."""
  if not isinstance(sharding, NamedSharding) or not isinstance(sharding.mesh, Mesh):
    return None
  devs = sharding.mesh.devices
  moved = [ring.shifted(d, k) for d in devs.flat]
  if any(d is None for d in moved) or len(set(moved)) != len(moved):
    return None
  mesh = Mesh(np.array(moved, dtype=object).reshape(devs.shape), sharding.mesh.axis_names)
  return NamedSharding(mesh, sharding.spec, memory_kind=PINNED)


def _host_sum(cap: PinnedCapture, domain: int, position: int) -> Callable[[], Checksum]:
  """crc32c of a piece's first pinned copy, once it has landed (memoized)."""
  memo: list[Checksum] = []
  lock = threading.Lock()  # copies of one piece in several domains share it

  def get() -> Checksum:
    with lock:
      if not memo:
        memo.append(host_crc(np.asarray(cap.arrays[domain][position])))
      return memo[0]
  return get


def _pending_sum(src: jax.Array, per_shard: tuple[jax.Array, dict] | None
                 ) -> Callable[[], Checksum]:
  if per_shard is not None:
    out, rows = per_shard
    row = rows[next(iter(src.devices()))]
    return lambda: as_checksum(np.asarray(out)[row])
  pending = device_checksum(src)  # dispatched now, read in the drain
  return lambda: as_checksum(pending)


def _device(a: jax.Array) -> jax.Device:
  return next(iter(a.devices()))


def _alive_on(a: jax.Array, device: jax.Device) -> bool:
  try:
    return not a.is_deleted() and _device(a) == device
  except RuntimeError:
    return False


# ------------------------------------------------------------------ restore
class PinnedAssembler:
  """Builds restored leaves from a plan over pinned-host stores, on device.

  Each piece used is moved from ``pinned_host`` memory to the target device
  and its checksum recomputed there; a mismatch or an unreadable array (its
  slice is gone) raises :class:`BadCopy` so the manager re-plans.
  """

  def __init__(self, plan: StepPlan, stores: Mapping[int, PinnedHostStore], *,
               pool: futures.Executor):
    self.plan = plan
    self._pool = pool
    self._stores = stores
    self._verified: dict[tuple[int, Index], Stored] = {}
    self.bytes_read = 0
    self.bad: dict[CopyKey, BadCopy] = {}  # copies found bad (the manager notes them)

  def _fetch(self, leaf: int, index: Index, device: jax.Device | None) -> Stored:
    """A verified copy of piece (leaf, index): on ``device``, or on the host
    for ``device=None`` and numpy leaves. A bad copy is noted and the next
    one tried; :class:`BadCopy` once none is left."""
    key = (leaf, index)
    got = self._verified.get(key)
    if got is None:
      copies = self.plan.copies[key]
      for copy in copies:
        if copy.key(self.plan.step) not in self.bad:
          try:
            got = self._verify(copy, device)
            break
          except BadCopy as e:
            self.bad[e.key] = e
      else:  # every copy is bad
        raise self.bad[copies[-1].key(self.plan.step)]
      self._verified[key] = got
    if device is None:
      return got
    if isinstance(got, np.ndarray):
      return jax.device_put(got, device)
    return got if device in got.devices() else jax.device_put(got, device)

  def _verify(self, copy: Copy, device: jax.Device | None) -> Stored:
    spec = self.plan.specs[copy.record.leaf]
    stored = self._stores[copy.host].array(self.plan.step, copy.record.offset)
    try:
      if isinstance(stored, np.ndarray):
        got, ck = stored, host_crc(stored)
      elif len(copy.record.crcs) == 1:  # crc32c of the pinned buffer, in place
        ck = host_crc(np.asarray(stored))
        got = jax.device_put(stored, SingleDeviceSharding(device or _device(stored)))
      else:
        got = jax.device_put(stored, SingleDeviceSharding(device or _device(stored)))
        ck = as_checksum(device_checksum(got))
    except RuntimeError as e:  # JaxRuntimeError (slice lost), or freed buffers
      raise BadCopy(copy.key(self.plan.step), spec.path,
                    why=f"unreadable ({str(e).splitlines()[0]})",
                    holder=f"slice {copy.host}") from e
    if ck != tuple(copy.record.crcs):
      raise BadCopy(copy.key(self.plan.step), spec.path, holder=f"slice {copy.host}")
    self.bytes_read += copy.record.nbytes
    return got

  def _region(self, leaf: int, index: Index, device: jax.Device) -> jax.Array:
    pieces = self.plan.leaf_copies(leaf)
    if index in pieces:
      return self._fetch(leaf, index, device)
    spec = self.plan.specs[leaf]
    out = jnp.zeros(tuple(b - a for a, b in index), spec.np_dtype, device=device)
    for pidx, dst, src in overlaps(pieces, index):  # cut and placed on ``device``
      out = out.at[dst].set(self._fetch(leaf, pidx, device)[src])
    return out

  def _host_region(self, leaf: int, index: Index) -> tuple[np.ndarray, bool]:
    out = np.empty(tuple(b - a for a, b in index), self.plan.specs[leaf].np_dtype)
    for pidx, dst, src in overlaps(self.plan.leaf_copies(leaf), index):
      out[dst] = np.asarray(self._fetch(leaf, pidx, None))[src]
    return out, True

  def leaf(self, leaf: int, target_spec: LeafSpec, target: Any) -> Any:
    spec = self.plan.specs[leaf]
    if spec.kind is LeafKind.SCALAR:
      return self.plan.scalars.get(leaf)
    if wants_numpy(spec, target_spec, target):
      return build_leaf(spec, target_spec, target, lambda idx: self._host_region(leaf, idx))
    sharding = target_sharding(target)
    on_device = (sharding.with_memory_kind("device")
                 if sharding.memory_kind not in (None, "device") else sharding)
    wanted = [(device, normalize_index(idx, spec.shape) if idx is not None
               else tuple((0, d) for d in spec.shape))
              for device, idx in sharding.addressable_devices_indices_map(spec.shape).items()]
    arr = self._in_place(leaf, on_device, wanted)
    if arr is None:
      bufs = [self._region(leaf, nidx, device) for device, nidx in wanted]
      arr = jax.make_array_from_single_device_arrays(spec.shape, on_device, bufs)
    if on_device is not sharding:
      arr = jax.device_put(arr, sharding)
    if spec.kind is LeafKind.KEY:
      arr = jax.random.wrap_key_data(arr, impl=spec.key_impl)
    return arr

  def _in_place(self, leaf: int, sharding: jax.sharding.Sharding,
                wanted: Sequence[tuple[jax.Device, Index]]) -> jax.Array | None:
    """The fast path when every target device holds a copy of its own shard
    (pause-resume on the same mesh): one pinned array from those copies and
    one ``device_put`` back to device memory, all devices in parallel. Each
    copy is verified (in place, or on device after the put). None if the
    layout does not allow it or a copy is bad (the general path takes over)."""
    spec = self.plan.specs[leaf]
    if spec.kind is LeafKind.NUMPY:
      return None
    picks: list[tuple[Copy, jax.Array]] = []
    for device, index in wanted:
      found = None
      for copy in self.plan.copies.get((leaf, index), ()):
        if copy.key(self.plan.step) in self.bad:
          continue
        stored = self._stores[copy.host].array(self.plan.step, copy.record.offset)
        if isinstance(stored, jax.Array) and _alive_on(stored, device):
          found = (copy, stored)
          break
      if found is None:
        return None
      picks.append(found)
    try:
      # crc32c in place on the pool while this thread puts the leaf back.
      in_place = [(c, self._pool.submit(host_crc, np.asarray(st)))
                  for c, st in picks if len(c.record.crcs) == 1]
      pinned = jax.make_array_from_single_device_arrays(
          spec.shape, sharding.with_memory_kind(PINNED), [st for _, st in picks])
      arr = jax.device_put(pinned, sharding)
      for copy, ck in in_place:
        if ck.result() != tuple(copy.record.crcs):
          raise BadCopy(copy.key(self.plan.step), spec.path, holder=f"slice {copy.host}")
      sums = shard_checksums(arr) if any(len(c.record.crcs) == 2 for c, _ in picks) else None
      if sums is not None:
        out, rows = sums
        got = np.asarray(out)
        for (copy, _), (device, _) in zip(picks, wanted):
          if as_checksum(got[rows[device]]) != tuple(copy.record.crcs):
            raise BadCopy(copy.key(self.plan.step), spec.path, holder=f"slice {copy.host}")
    except BadCopy as e:
      self.bad[e.key] = e
      return None
    except RuntimeError:  # an unreadable copy: the general path finds which
      return None
    self.bytes_read += sum(c.record.nbytes for c, _ in picks)
    return arr

  def tree(self, target_specs: Sequence[LeafSpec], targets: Sequence[Any]) -> list[Any]:
    by_path = {s.path: i for i, s in enumerate(self.plan.specs)}
    return [self.leaf(by_path[t.path], t, tgt) for t, tgt in zip(target_specs, targets)]
