"""The pinned-host store (single controller, Pathways): snapshots held as
``pinned_host`` jax.Arrays on each failure domain's own hosts.

On Pathways the controller owns every array but the bytes of a
``pinned_host`` array live in the RAM of the host of its device. So a
snapshot is one single-device ``pinned_host`` array per stored piece, put on a
device of the domain (slice) that keeps it: its own shards, plus a copy of
each shard that has no data-parallel twin on the next domains in ring order.
Losing a slice loses exactly the arrays on its devices; the other domains'
arrays stay valid. Nothing crosses to the controller on save or restore but
two uint32 checksums per piece (:mod:`._checksum`, computed on device).

Each domain's store mirrors :class:`._hoststore.HostStore`: manifests (in this
process's memory; ``PieceRecord.offset`` is the piece's position in the
domain's array list, ``crcs`` its checksum), so the planner and the retention
rules are shared. Numpy leaves and Python scalars are controller state (the
controller survives on Pathways) and are kept as controller copies.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding

from . import _faults, errors
from ._assemble import BadCopy, build_leaf, overlap
from ._checksum import (Checksum, as_checksum, device_checksum, host_checksum,
                        shard_checksums)
from ._layout import Index, LeafKind, LeafSpec, Piece, normalize_index, wants_numpy
from ._manifest import Manifest
from ._persistent import target_sharding
from ._planner import Copy, CopyKey, StepPlan

logger = logging.getLogger(__name__)

PINNED = "pinned_host"
Stored = jax.Array | np.ndarray


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

  def checksums(self, domain: int) -> list[Checksum]:
    return [self.sums[(p.leaf, p.index)]() for p, _ in self.pieces[domain]]


def capture(specs: Sequence[LeafSpec], leaves: Sequence[Any], *,
            slices: Mapping[int, Sequence[jax.Device]], replicas: int,
            step: int = -1,
            before_dispatch: Callable[[dict[int, int]], None] = lambda nbytes: None
            ) -> PinnedCapture:
  """Dispatches ``pinned_host`` copies of every piece to the domains that keep
  it; returns at once (the copies and checksums complete asynchronously, and
  XLA orders them before any later step that donates the buffers).

  ``before_dispatch(bytes per domain)`` runs before any memory is taken: it
  may raise (over budget) or evict older snapshots.
  """
  order = sorted(slices)
  domain_of = {d: k for k, devs in slices.items() for d in devs}
  position = {d: i for devs in slices.values() for i, d in enumerate(devs)}
  cap = PinnedCapture({k: [] for k in order}, {k: [] for k in order}, {}, {})
  srcs: list[jax.Array] = []
  dsts: list[SingleDeviceSharding] = []
  slots: list[tuple[int, int]] = []  # (domain, position in its list) per put
  for i, (spec, leaf) in enumerate(zip(specs, leaves)):
    if i == len(specs) // 2:
      _faults.point("capture", step)
    if spec.kind is LeafKind.SCALAR:
      cap.scalars[i] = leaf
      continue
    if spec.kind is LeafKind.NUMPY:
      data = np.array(leaf, copy=True)  # the caller may mutate it
      index = tuple((0, n) for n in data.shape)
      ck = host_checksum(data)
      cap.sums[(i, index)] = lambda c=ck: c
      for k in order:
        cap.pieces[k].append((Piece(i, index, data.nbytes), order[0]))
        cap.arrays[k].append(data)
      continue
    arr = jax.random.key_data(leaf) if spec.kind is LeafKind.KEY else leaf
    shape = tuple(arr.shape)
    per_shard = shard_checksums(arr)
    holders: dict[Index, dict[int, jax.Array]] = {}  # index -> domain -> shard data
    for shard in arr.addressable_shards:
      if shard.device not in domain_of:
        raise ValueError(f"leaf {spec.path!r} has a shard on {shard.device}, which is in "
                         "no slice that is up; snapshots go to the active slices only")
      index = normalize_index(shard.index, shape)
      holders.setdefault(index, {}).setdefault(domain_of[shard.device], shard.data)
    for index, by_domain in holders.items():
      owner = min(by_domain)
      src = by_domain[owner]
      cap.sums[(i, index)] = _pending_sum(src, per_shard)
      keepers = dict(by_domain)
      k = order.index(owner)
      while len(keepers) < min(1 + replicas, len(order)):  # ring: next domains
        k = (k + 1) % len(order)
        keepers.setdefault(order[k], src)
      nbytes = int(np.prod([b - a for a, b in index], dtype=np.int64)) * arr.dtype.itemsize
      for d, data in sorted(keepers.items()):
        here = next(iter(data.devices()))
        if domain_of[here] != d:  # a cross-domain copy: same position in slice d
          devs = slices[d]
          here = devs[position[here] % len(devs)]
        srcs.append(data)
        dsts.append(SingleDeviceSharding(here, memory_kind=PINNED))
        slots.append((d, len(cap.arrays[d])))
        cap.pieces[d].append((Piece(i, index, nbytes), owner))
        cap.arrays[d].append(None)  # filled below
  before_dispatch({d: cap.nbytes(d) for d in order})
  if srcs:
    for (d, pos), out in zip(slots, jax.device_put(srcs, dsts)):
      cap.arrays[d][pos] = out
  return cap


def _pending_sum(src: jax.Array, per_shard: tuple[jax.Array, dict] | None
                 ) -> Callable[[], Checksum]:
  if per_shard is not None:
    out, rows = per_shard
    row = rows[next(iter(src.devices()))]
    return lambda: as_checksum(np.asarray(out)[row])
  pending = device_checksum(src)  # dispatched now, read in the drain
  return lambda: as_checksum(pending)


# ------------------------------------------------------------------ restore
class PinnedAssembler:
  """Builds restored leaves from a plan over pinned-host stores, on device.

  Each piece used is moved from ``pinned_host`` memory to the target device
  and its checksum recomputed there; a mismatch or an unreadable array (its
  slice is gone) raises :class:`BadCopy` so the manager re-plans.
  """

  def __init__(self, plan: StepPlan, stores: Mapping[int, PinnedHostStore]):
    self.plan = plan
    self._stores = stores
    self._verified: dict[tuple[int, Index], Stored] = {}
    self.bytes_read = 0
    self.notes: list[str] = []  # copies found bad and passed over
    self.bad_keys: set[CopyKey] = set()

  def _fetch(self, leaf: int, index: Index, device: jax.Device | None) -> Stored:
    """A verified copy of piece (leaf, index): on ``device``, or on the host
    for ``device=None`` and numpy leaves. A bad copy is noted and the next
    one tried; :class:`BadCopy` once none is left."""
    key = (leaf, index)
    got = self._verified.get(key)
    if got is None:
      for copy in self.plan.copies[key]:
        try:
          got = self._verify(copy, device)
          break
        except BadCopy as e:
          self.bad_keys.add(e.key)
          self.notes.append(f"step {self.plan.step}: {e}; using another copy")
          if copy is self.plan.copies[key][-1]:
            raise
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
        got, ck = stored, host_checksum(stored)
      else:
        where = device or next(iter(stored.devices()))
        got = jax.device_put(stored, SingleDeviceSharding(where))
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
    for pidx in pieces:
      ov = overlap(pidx, index)
      if ov is None:
        continue
      src = self._fetch(leaf, pidx, device)
      dst = tuple(slice(lo - t0, hi - t0) for (lo, hi), (t0, _) in zip(ov, index))
      out = out.at[dst].set(src[tuple(slice(lo - p0, hi - p0)
                                      for (lo, hi), (p0, _) in zip(ov, pidx))])
    return out

  def _host_region(self, leaf: int, index: Index) -> tuple[np.ndarray, bool]:
    out = np.empty(tuple(b - a for a, b in index), self.plan.specs[leaf].np_dtype)
    for pidx in self.plan.leaf_copies(leaf):
      ov = overlap(pidx, index)
      if ov is not None:
        src = np.asarray(self._fetch(leaf, pidx, None))
        out[tuple(slice(lo - t0, hi - t0) for (lo, hi), (t0, _) in zip(ov, index))] = \
            src[tuple(slice(lo - p0, hi - p0) for (lo, hi), (p0, _) in zip(ov, pidx))]
    return out, True

  def leaf(self, leaf: int, target_spec: LeafSpec, target: Any) -> Any:
    spec = self.plan.specs[leaf]
    if spec.kind is LeafKind.SCALAR:
      return self.plan.scalars.get(leaf)
    if wants_numpy(spec, target_spec, target):
      return build_leaf(spec, target_spec, target, lambda idx: self._host_region(leaf, idx))
    sharding = target_sharding(target)
    bufs = []
    for device, idx in sharding.addressable_devices_indices_map(spec.shape).items():
      nidx = (normalize_index(idx, spec.shape) if idx is not None
              else tuple((0, d) for d in spec.shape))
      bufs.append(self._region(leaf, nidx, device))
    arr = jax.make_array_from_single_device_arrays(
        spec.shape, sharding.with_memory_kind("device")
        if sharding.memory_kind not in (None, "device") else sharding, bufs)
    if sharding.memory_kind not in (None, "device"):
      arr = jax.device_put(arr, sharding)
    if spec.kind is LeafKind.KEY:
      arr = jax.random.wrap_key_data(arr, impl=spec.key_impl)
    return arr

  def tree(self, target_specs: Sequence[LeafSpec], targets: Sequence[Any]) -> list[Any]:
    by_path = {s.path: i for i, s in enumerate(self.plan.specs)}
    return [self.leaf(by_path[t.path], t, tgt) for t, tgt in zip(target_specs, targets)]
