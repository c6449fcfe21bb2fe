"""The pinned-host backend (single controller): one store per failure
domain (slice). On Pathways (``PinnedMemory.SLICE_HOSTS``) a store holds
``pinned_host`` arrays on that domain's own hosts (:mod:`.capture`), so
losing a slice loses exactly its arrays; where this process has every
device's host memory (``PinnedMemory.PROCESS``: CPU devices, one host's
chips) it holds each slice's copies in memory of its own, staged off
accelerators at the link's speed.

Restore moves each piece used to its target device and checks it: crc32c
of the host copy where this process can address it (PROCESS, or CPU),
else the on-device sum recomputed on the receiving device. Where every
target device holds a copy of its own shard (pause-resume on the same
mesh), :meth:`place_leaf` puts the whole leaf back with one ``device_put``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from concurrent import futures
from typing import Any, cast

import jax
import numpy as np
from jax.sharding import NamedSharding

from ... import _parity
from ..._assemble import Assembler, BadCopy
from ..._checksum import (
  ChecksumKind,
  as_checksum,
  device_checksum,
  shard_checksums,
)
from ..._index import Index
from ..._jax_compat import host_array_to_device
from ..._manifest import piece_row
from ..._planner import Copy, StepPlan
from ..._tree import LeafKind, LeafSpec
from ...options import SnapshotOptions
from ...stores import PinnedChecksum, PinnedHost, PinnedMemory
from .. import _copy
from ..base import DomainStores, Header
from ..staging import Report, Stager
from . import capture as _capture
from .capture import device_of
from .slices import HostParts, SliceStager, join, join_leaf
from .store import PINNED, PinnedHostStore, Stored

logger = logging.getLogger(__name__)

#: SLICE_HOSTS: the device memory a save may hold staged at once on an
#: accelerator that reports no memory stats (``staging_budget_bytes`` caps it)
NO_STATS_ROOM_BYTES = 1 << 30


def memory_for(devices: Sequence[jax.Device], spec: PinnedHost) -> PinnedMemory:
  """``PinnedHost.memory`` -> PROCESS or SLICE_HOSTS. AUTO: PROCESS where
  this process has every device's host memory (CPU devices, or the devices
  of a job of one process that is not a Pathways client: JAX's platforms
  name no ``proxy``, pathwaysutils' own test), unless the checksum asked
  for is the device's."""
  if spec.memory is not PinnedMemory.AUTO:
    return spec.memory
  if spec.checksum is PinnedChecksum.DEVICE:
    return PinnedMemory.SLICE_HOSTS
  if all(d.platform == "cpu" for d in devices):
    return PinnedMemory.PROCESS
  pathways = "proxy" in str(jax.config.jax_platforms or "")
  here = jax.process_index()
  if not pathways and jax.process_count() == 1 and all(d.process_index == here
                                                       for d in devices):
    return PinnedMemory.PROCESS
  return PinnedMemory.SLICE_HOSTS


def checksum_for(devices: Sequence[jax.Device], choice: PinnedChecksum,
                 memory: PinnedMemory = PinnedMemory.SLICE_HOSTS) -> ChecksumKind:
  """``PinnedHost.checksum`` -> kind: crc32c where this process addresses
  the copies in place (PROCESS, or pinned memory on CPU), an on-device sum
  elsewhere."""
  if choice is PinnedChecksum.AUTO:
    choice = (PinnedChecksum.HOST if memory is PinnedMemory.PROCESS
              or all(d.platform == "cpu" for d in devices) else PinnedChecksum.DEVICE)
  return ChecksumKind.CRC32C if choice is PinnedChecksum.HOST else ChecksumKind.DEVICE_SUM


@dataclasses.dataclass
class _Pending:
  header: Header
  capture: _capture.PinnedCapture
  slots: dict[int, int]  # domain -> slot

  @property
  def staging(self) -> Report:
    """What the capture staged (:mod:`..staging`; PROCESS off CPU)."""
    return self.capture.staged


class PinnedHostBackend(DomainStores):
  """``pinned_host`` arrays per failure domain, held by the controller."""

  runs = False  # pieces are arrays of their own, not bytes of one slot

  def __init__(self, options: SnapshotOptions, spec: PinnedHost, *,
               slices: Mapping[int, Sequence[jax.Device]], pool: futures.Executor):
    self.options = options
    self.spec = spec
    self._pool = pool
    self._slices = {k: list(v) for k, v in slices.items()}
    devices = [d for v in slices.values() for d in v]
    self.memory = memory_for(devices, spec)
    self.checksum = checksum_for(devices, spec.checksum, self.memory)
    in_process = self.memory is PinnedMemory.PROCESS
    self._stager = Stager.of(options)
    # SLICE_HOSTS checked on device: leaves staged as pieces (.slices); its
    # budget comes from the same accounting as PROCESS's staging
    self._slice_staging = (not in_process and self._stager is not None
                           and self.checksum is ChecksumKind.DEVICE_SUM)
    # Where this process can read the stored bytes (CRC32C: PROCESS), a piece
    # is verified while it is copied out (one pass, on the pool, ahead of
    # use) and the copy put back; else each leaf is put back from its
    # devices' own copies at once and verified there (place_leaf).
    self.prefetch_pool = pool if self.checksum is ChecksumKind.CRC32C else None
    self.prefetch_workers = options.copy_threads
    super().__init__({i: PinnedHostStore(i, keep=options.keep,
                                         budget_bytes=spec.budget_bytes)
                      for i in sorted(slices)}, run_id=options.run_id)


  def describe(self) -> str:
    return f"the pinned_host stores of slices {sorted(self.stores)}"


  # ------------------------------------------------------------------ save
  def capture(self, header: Header, specs: Sequence[LeafSpec], leaves: Sequence[Any], *,
              replicas: int) -> _Pending:
    slots: dict[int, int] = {}

    def make_room(nbytes: Mapping[int, int]) -> None:  # before any copy is made
      for sid, n in nbytes.items():
        slots[sid] = self.stores[sid].reserve(header.step, n, header.kept_step)

    live = {k: self._slices[k] for k in self.live()}
    stripes = None
    k = self.options.parity_k
    if replicas and k is not None:
      stripes = _parity.slice_stripes(live, k)
      if stripes is None:
        logger.warning("step %d: slices %s do not form groups of %d: full replicas instead "
                       "of parity", header.step, sorted(live), k + 1)
    slice_stager, probe = None, None
    if self._slice_staging and self._stager is not None:
      probe = live[min(live)][0]  # the devices run one program: one stands for all
      room = self._stager.room(probe)
      if room is None and probe.platform != "cpu":  # no memory stats: a bounded default
        room = NO_STATS_ROOM_BYTES
      slice_stager = SliceStager(piece_bytes=self.options.staging_piece_bytes,
                                 chunk_bytes=self.options.chunk_bytes, room=room)
    in_process = self.memory is PinnedMemory.PROCESS
    cap = _capture.capture(specs, leaves, slices=live, replicas=replicas,
                           step=header.step, checksum=self.checksum,
                           chunk_bytes=self.options.chunk_bytes, before_dispatch=make_room,
                           stripes=stripes, host=in_process,
                           stager=self._stager if in_process else None,
                           staging=self.options.staging, slice_stager=slice_stager)
    if slice_stager is not None and probe is not None and self._stager is not None:
      self._stager.held(probe, slice_stager.peak)
    return _Pending(header, cap, slots)

  def drain(self, pending: _Pending) -> int:
    cap = pending.capture
    if cap.host:  # PROCESS: one pass per byte, on the host, into the slot's memory
      cap.copy_to_host(lambda sid, n: self.stores[sid].memory(pending.slots[sid], n),
                       self._pool, self.options.chunk_bytes)
    # Checksums first: each waits for its own copy only, so they run while
    # later copies still land; then every copy (the ones no checksum read).
    sums_of = {sid: cap.checksums(sid, self._pool) for sid in pending.slots}
    cap.wait()
    nbytes = 0
    for sid, slot in pending.slots.items():
      store = self.stores[sid]
      sums = sums_of[sid]
      nbytes += cap.nbytes(sid)
      store.fill(slot, cap.arrays[sid], cap.host_devices.get(sid))
      _copy.commit(store, pending.header,
                   (piece_row(p.leaf, p.index, pos, p.nbytes, ck, owner, cap.kind(p.leaf, p.index))
                    for pos, ((p, owner), ck) in enumerate(zip(cap.pieces[sid], sums,
                                                               strict=True))),
                   cap.parity, slot=slot, scalars=cap.scalars, options=self.options)
    return nbytes

  # --------------------------------------------------------------- restore
  def _stored(self, copy: Copy) -> Stored:
    return self.stores[copy.store].part(copy.slot, copy.record.offset)

  def fetch(self, plan: StepPlan, copy: Copy, device: jax.Device | None, *,
            out: np.ndarray | None = None) -> np.ndarray | jax.Array:
    rec = copy.record
    path, dtype = plan.path_and_dtype(rec)
    holder = f"slice {copy.store}"
    got: np.ndarray | jax.Array | None
    try:
      stored = self._stored(copy)
      if rec.kind is ChecksumKind.CRC32C:  # a private copy, verified as it is made
        got = _copy.verified_piece(np.asarray(stored), rec, path, dtype,
                                   chunk_bytes=plan.chunk_bytes, pool=self._pool, out=out)
        ok = got is not None
      elif isinstance(stored, HostParts):  # staged pieces: joined and summed on device
        got, sums = join(stored, device or stored.device)
        ok = as_checksum(sums) == tuple(rec.checksum)
      else:  # (a device-summed copy is a jax.Array)
        on = device or device_of(cast(jax.Array, stored))
        got = host_array_to_device(cast(jax.Array, stored), on)
        ok = as_checksum(device_checksum(got)) == tuple(rec.checksum)
    except (RuntimeError, KeyError) as e:  # JaxRuntimeError (slice lost), freed buffers
      # DATA_LOSS reading a host copy is its slice's memory gone (Pathways):
      # every copy that slice holds is lost, not just this one. Not on the
      # device path: there the target device may be the one that failed.
      lost = (copy.store if rec.kind is ChecksumKind.CRC32C and _data_loss(e) else None)
      raise BadCopy(copy.key(plan.step), path,
                    why=f"unreadable ({str(e).splitlines()[0] if str(e) else e!r})",
                    holder=holder, lost_store=lost) from e
    if not ok or got is None:
      raise BadCopy(copy.key(plan.step), path, holder=holder)
    return got

  def fetch_run(self, plan: StepPlan, copies: Sequence[Copy], out: np.ndarray
                ) -> list[np.ndarray | jax.Array | None]:
    raise NotImplementedError("pinned_host copies are fetched one by one (runs is False)")

  def check(self, plan: StepPlan, copy: Copy) -> None:
    self.fetch(plan, copy, None)  # the controller reads pinned copies by moving them

  def place_leaf(self, assembler: Assembler, leaf: int, sharding: jax.sharding.Sharding,
                 wanted: Sequence[tuple[jax.Device, Index]]) -> jax.Array | None:
    """The whole leaf from the target devices' own copies: one pinned array
    and one ``device_put`` back to device memory, all devices in parallel.
    Each copy is verified (in place, or on device after the put). None if
    the layout does not allow it or a copy is bad (the general path takes
    over and finds which)."""
    plan = assembler.plan
    spec = plan.specs[leaf]
    if spec.kind is LeafKind.NUMPY or self.prefetch_pool is not None:
      return None  # host copies: the general path puts the verified copies
    picks: list[tuple[Copy, jax.Array | HostParts]] = []
    for device, index in wanted:
      found = None
      for copy in plan.copies.get((leaf, index), ()):
        if (copy.key(plan.step) in assembler.bad or not self.holds(copy.store)
            or copy.store in assembler.lost_stores):
          continue
        stored = self._stored(copy)
        if isinstance(stored, (jax.Array, HostParts)) and _alive_on(stored, device):
          found = (copy, stored)
          break
      if found is None:
        return None
      picks.append(found)
    # Only DEVICE_SUM copies get here (host-readable ones are prefetched).
    if any(c.record.kind is not ChecksumKind.DEVICE_SUM for c, _ in picks):
      return None
    try:
      got = (self._place_parts(spec, sharding, picks, wanted)
             if any(isinstance(st, HostParts) for _, st in picks)
             else _place_arrays(spec, sharding, picks, wanted))
      if got is None:
        return None
      arr, sums = got
      for (copy, _), ck in zip(picks, sums, strict=True):
        if as_checksum(ck) != tuple(copy.record.checksum):
          raise BadCopy(copy.key(plan.step), spec.path, holder=f"slice {copy.store}")
    except BadCopy as e:
      assembler.mark_bad(e)
      return None
    except RuntimeError:  # an unreadable copy: the general path finds which
      return None
    assembler.bytes_read += sum(c.record.nbytes for c, _ in picks)
    return arr

  @staticmethod
  def _place_parts(spec: LeafSpec, sharding: jax.sharding.Sharding,
                   picks: Sequence[tuple[Copy, jax.Array | HostParts]],
                   wanted: Sequence[tuple[jax.Device, Index]]
                   ) -> tuple[jax.Array, list[np.ndarray]] | None:
    """:meth:`place_leaf` from staged copies: (the leaf, each pick's sum
    recomputed on its device). The whole leaf in one program where the
    target is a mesh of the copies' devices (:func:`.slices.join_leaf`),
    else each copy joined on its device, every join dispatched before any
    sum is read."""
    if not all(isinstance(st, HostParts) for _, st in picks):
      return None
    held = [cast(HostParts, st) for _, st in picks]
    whole = (join_leaf(held, sharding, tuple(spec.shape))
             if isinstance(sharding, NamedSharding) else None)
    if whole is not None:
      arr, table, rows = whole
      host = np.asarray(table)
      return arr, [host[rows[device]] for device, _ in wanted]
    joined = [join(st, device) for st, (device, _) in zip(held, wanted, strict=True)]
    sums = jax.device_get([ck for _, ck in joined])
    return (jax.make_array_from_single_device_arrays(spec.shape, sharding,
                                                     [x for x, _ in joined]), sums)


def _place_arrays(spec: LeafSpec, sharding: jax.sharding.Sharding,
                  picks: Sequence[tuple[Copy, jax.Array | HostParts]],
                  wanted: Sequence[tuple[jax.Device, Index]]
                  ) -> tuple[jax.Array, list[np.ndarray]] | None:
  """:meth:`PinnedHostBackend.place_leaf` from whole pinned arrays: one
  array, one put back to device memory, every shard summed in one program:
  (the leaf, each pick's sum), None for a sharding it cannot sum."""
  arrays = [st for _, st in picks if isinstance(st, jax.Array)]
  if wanted and wanted[0][0].platform == "cpu":  # (_jax_compat.host_array_to_device)
    arr = jax.make_array_from_single_device_arrays(spec.shape, sharding, [
        host_array_to_device(st, device) for st, (device, _) in zip(arrays, wanted,
                                                                    strict=True)])
  else:
    pinned = jax.make_array_from_single_device_arrays(
        spec.shape, sharding.with_memory_kind(PINNED), arrays)
    arr = jax.device_put(pinned, sharding)
  sums = shard_checksums(arr)
  if sums is None:
    return None
  out, rows = sums
  host = np.asarray(out)
  return arr, [host[rows[device]] for device, _ in wanted]


def _data_loss(e: BaseException) -> bool:
  """A JAX runtime error that says the memory read is gone (DATA_LOSS)."""
  return isinstance(e, jax.errors.JaxRuntimeError) and "DATA_LOSS" in str(e)


def _alive_on(a: jax.Array | HostParts, device: jax.Device) -> bool:
  try:
    return not a.is_deleted() and device_of(a) == device
  except RuntimeError:
    return False
