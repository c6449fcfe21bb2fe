"""One failure domain's pinned-host store: manifests (in this process's
memory) and the ``pinned_host`` arrays of each slot.

Mirrors :class:`..hostfiles.store.HostStore`: a fixed number of slots
(:func:`._planner.slot_count`), a slot taken per snapshot (the oldest evicted
when none is free), manifests committed after the data, retention by the
shared rule. ``PieceRecord.offset`` is the piece's position in its slot's
array list.

In this process's memory (``PinnedMemory.PROCESS``) a slot holds each
piece as its part of the slot's host memory (a numpy view: what the drain
wrote and the restore reads), and hands out a ``pinned_host`` array of it
on its device only when asked (:meth:`PinnedHostStore.array`; CPU: the
same bytes, no copy). A jax.Array per
piece held for the life of a snapshot would cost the drain a JAX call per
piece every save, and make thousands of long-lived objects that bring
Python's full collections closer.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import jax
import numpy as np

from ... import _faults, _planner
from ..._arena import ArenaCache
from ..._jax_compat import single_device_sharding
from ..._manifest import Manifest, kept_copy
from ..base import NO_PROGRESS, ProgressInMemory
from .slices import HostParts

logger = logging.getLogger(__name__)

PINNED = "pinned_host"
Stored = jax.Array | np.ndarray | HostParts  # (HostParts: SLICE_HOSTS, staged)


def supports_pinned_host(devices: Sequence[jax.Device]) -> bool:
  """True if every device has a ``pinned_host`` memory space."""
  try:
    return all(any(m.kind == PINNED for m in d.addressable_memories()) for d in devices)
  except Exception:  # noqa: BLE001 - a backend without memories API
    return False


class PinnedHostStore(ProgressInMemory):
  """One failure domain's snapshots. Not thread-safe: the backend serializes."""

  def __init__(self, domain: int, *, keep: int, budget_bytes: int | None):
    self.host = domain  # manifests name their store by this id
    self.keep = keep
    self.budget_bytes = budget_bytes
    self._manifests: dict[tuple[int, int], Manifest] = {}  # (step, incarnation) ->
    self._slots: dict[int, list[Stored]] = {}  # slot -> its arrays
    # PROCESS: slot -> position -> the device each part belongs to
    self._devices: dict[int, dict[int, jax.Device]] = {}
    self._handles: dict[int, dict[int, jax.Array]] = {}  # handed out by array()
    # PROCESS: each slot's host memory, which its arrays adopt and the slot's
    # next snapshot reuses once they are freed (a slot file's counterpart)
    self._memory: dict[int, ArenaCache] = {}
    self.num_slots = keep + 1

  def __repr__(self) -> str:
    return f"pinned_host store of slice {self.host}"

  def reserve(self, step: int, snapshot_bytes: int, watermark: int | None = None) -> int:
    """A slot for ``step``'s arrays, its previous contents freed (the oldest
    snapshot but the job's ``watermark`` step is evicted when none is free:
    :func:`..._planner.free_slot`). Raises BudgetExceededError before
    freeing anything if the budget cannot hold two snapshots."""
    self.num_slots = _planner.slot_count(
        snapshot_bytes, keep=self.keep, budget_bytes=self.budget_bytes,
        where=f"the pinned host memory on slice {self.host}")
    for slot in [s for s in self._slots if s >= self.num_slots]:
      self._drop_slot(slot, "slot count reduced")
    for slot in [s for s in self._memory if s >= self.num_slots]:
      self._memory.pop(slot).release()
    slot, evict = _planner.free_slot(self.manifests(), self.num_slots, watermark)
    if evict is not None:
      self.delete(evict, f"evicted to free a slot for step {step}")
    self._drop_slot(slot, f"slot {slot} reused for step {step}")
    return slot

  def memory(self, slot: int, nbytes: int) -> np.ndarray:
    """``nbytes`` of host memory for ``slot``'s arrays to adopt: the slot's
    last memory once nothing uses it, else fresh (:mod:`..._arena`)."""
    return self._memory.setdefault(slot, ArenaCache()).take(nbytes)

  def fill(self, slot: int, arrays: list[Stored],
           devices: dict[int, jax.Device] | None = None) -> None:
    """``slot``'s pieces, by position; ``devices``: for each host part
    (PROCESS), the device it belongs to."""
    self._slots[slot] = arrays
    self._devices[slot] = devices or {}

  def held_bytes(self) -> int:
    """Bytes of every array this store holds now (all slots)."""
    return sum(a.nbytes for arrays in self._slots.values() for a in arrays if a is not None)

  def part(self, slot: int, position: int) -> Stored:
    """A piece as held: a ``pinned_host`` array, or host bytes (a numpy
    leaf's copy; a PROCESS part). Raises RuntimeError for a part whose
    handed-out array was deleted (its pinned memory is gone, as a lost
    slice's is)."""
    handle = self._handles.get(slot, {}).get(position)
    if handle is not None and handle.is_deleted():
      raise RuntimeError(f"the pinned_host array of piece {position} of slot {slot} was deleted")
    return self._slots[slot][position]

  def array(self, slot: int, position: int) -> Stored:
    """A piece as a ``pinned_host`` array on its device (a PROCESS part is
    adopted on first use: on CPU no copy), or a numpy leaf's copy."""
    held = self._slots[slot][position]
    device = self._devices.get(slot, {}).get(position)
    if device is None or not isinstance(held, np.ndarray):
      return held
    handles = self._handles.setdefault(slot, {})
    if position not in handles:
      handles[position] = jax.device_put(
          held, single_device_sharding(device, memory_kind=PINNED), may_alias=True)
    return handles[position]

  def _forget(self, slot: int) -> None:
    _free(self._slots.pop(slot, ()))
    _free(list(self._handles.pop(slot, {}).values()))
    self._devices.pop(slot, None)

  def commit(self, manifest: Manifest) -> None:
    _faults.point("manifest", manifest.step)
    # ``extra`` is the caller's object: keep a copy of our own.
    self._manifests[(manifest.step, manifest.incarnation)] = kept_copy(manifest)

  def manifests(self) -> list[Manifest]:
    return [self._manifests[s] for s in sorted(self._manifests)]

  def delete(self, manifest: Manifest, reason: str) -> None:
    logger.debug("slice %d: dropping snapshot of step %d (%s)", self.host, manifest.step,
                 reason)
    m = self._manifests.pop((manifest.step, manifest.incarnation), None)
    if m is not None and not any(o.slot == m.slot for o in self._manifests.values()):
      self._forget(m.slot)

  def _drop_slot(self, slot: int, reason: str) -> None:
    for m in [m for m in self._manifests.values() if m.slot == slot]:
      self.delete(m, reason)
    self._forget(slot)

  def wipe(self) -> None:
    """Forgets every snapshot (the domain's host memory is gone)."""
    for m in list(self._manifests.values()):
      self.delete(m, "wiped")
    for slot in list(self._slots):
      self._forget(slot)
    for memory in self._memory.values():
      memory.release()
    self._memory.clear()
    self._progress = NO_PROGRESS

  def close(self) -> None:
    self.wipe()


def _free(arrays: Sequence[Stored]) -> None:
  for a in arrays:
    if isinstance(a, (jax.Array, HostParts)):
      try:
        a.delete()
      except Exception:  # noqa: BLE001 - an array of a lost slice may not answer
        pass
