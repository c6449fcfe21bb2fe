"""A backend written outside snapstore's engine, for the tests only: each
store's snapshots are numpy buffers in this process's memory, one store per
failure domain (or one, without ``slices=``). It implements
:class:`snapstore._backends.base.Backend` from the shared parts any backend
may use (host files' per-domain capture; ``_copy``'s drain, commit and
verified fetch; the planner's slot rules), and
``tests/test_memory_backend.py`` runs the whole conformance suite on it by
declaring its store value (:class:`InMemory`) and its backdoor.

Not a product: it keeps nothing across processes, and has no parity.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from concurrent import futures
from typing import Any

import jax
import numpy as np

from snapstore import SnapshotOptions, _planner
from snapstore._assemble import Assembler, BadCopy
from snapstore._backends import _copy
from snapstore._backends.base import NO_PROGRESS, DomainStores, Header, ProgressInMemory
from snapstore._backends.hostfiles.capture import capture_by_domain
from snapstore._checksum import crc_matches, piece_key
from snapstore._index import Index
from snapstore._manifest import Manifest, kept_copy
from snapstore._planner import Copy, StepPlan
from snapstore._tree import LeafSpec


class MemoryStore(ProgressInMemory):
  """One domain's snapshots: a uint8 buffer a slot, manifests by
  (step, incarnation)."""

  def __init__(self, sid: int, *, keep: int, budget_bytes: int | None):
    self.host = sid
    self.keep = keep
    self.budget_bytes = budget_bytes
    self.num_slots = keep + 1
    self.slots: dict[int, np.ndarray] = {}
    self._manifests: dict[tuple[int, int], Manifest] = {}

  def reserve(self, step: int, nbytes: int, watermark: int | None = None) -> int:
    self.num_slots = _planner.slot_count(nbytes, keep=self.keep, budget_bytes=self.budget_bytes,
                                         where=f"memory store {self.host}")
    slot, evict = _planner.free_slot(self.manifests(), self.num_slots, watermark)
    if evict is not None:
      self.delete(evict, f"evicted to free a slot for step {step}")
    for m in [m for m in self._manifests.values() if m.slot == slot]:
      self.delete(m, f"slot {slot} reused for step {step}")
    self.slots[slot] = np.zeros(nbytes, np.uint8)
    return slot

  def slot_buffer(self, slot: int) -> np.ndarray:
    return self.slots[slot]

  def commit(self, manifest: Manifest) -> None:
    self._manifests[(manifest.step, manifest.incarnation)] = kept_copy(manifest)

  def manifests(self) -> list[Manifest]:
    return [self._manifests[k] for k in sorted(self._manifests)]

  def delete(self, manifest: Manifest, reason: str) -> None:
    m = self._manifests.pop((manifest.step, manifest.incarnation), None)
    if m is not None and not any(o.slot == m.slot for o in self._manifests.values()):
      self.slots.pop(m.slot, None)

  def wipe(self) -> None:
    self._manifests.clear()
    self.slots.clear()
    self._progress = NO_PROGRESS

  def close(self) -> None:
    self.wipe()


@dataclasses.dataclass
class _Pending:
  header: Header
  jobs: list[tuple[MemoryStore, _copy.Capture, int]]  # (store, capture, slot)


@dataclasses.dataclass(frozen=True, kw_only=True)
class InMemory:
  """The store value of :class:`MemoryBackend` (``SnapshotOptions(store=InMemory())``).

  Attributes:
    budget_bytes: byte budget of each domain's store (None: none).
  """

  budget_bytes: int | None = None

  def __post_init__(self) -> None:
    if self.budget_bytes is not None and (type(self.budget_bytes) is not int
                                          or self.budget_bytes < 1):
      raise ValueError(f"InMemory.budget_bytes must be a positive int or None, "
                       f"got {self.budget_bytes!r}")

  def build(self, options: SnapshotOptions, *, host: int, num_hosts: int,
            slices: Mapping[int, Sequence[jax.Device]] | None,
            pool: futures.Executor) -> MemoryBackend:
    if num_hosts > 1:
      raise ValueError("the memory backend is for one process")
    return MemoryBackend(options, self, slices=slices, pool=pool)


class MemoryBackend(DomainStores):
  """Snapshots in this process's memory, one store per failure domain."""

  runs = False  # no fetch_run: each copy is fetched alone

  def __init__(self, options: SnapshotOptions, spec: InMemory, *,
               slices: Mapping[int, Sequence[jax.Device]] | None, pool: futures.Executor):
    if options.parity_k is not None:
      raise ValueError("the memory backend keeps replicas only")
    self.options = options
    self.spec = spec
    self._pool = pool
    self.prefetch_pool: futures.Executor | None = pool
    self.prefetch_workers = options.copy_threads
    domains = slices if slices is not None else {0: jax.devices()}
    self._domain_of = {d: k for k, devs in domains.items() for d in devs}
    super().__init__({k: MemoryStore(k, keep=options.keep, budget_bytes=spec.budget_bytes)
                      for k in domains}, run_id=options.run_id)

  def describe(self) -> str:
    return "this process's memory"

  def capture(self, header: Header, specs: Sequence[LeafSpec], leaves: Sequence[Any], *,
              replicas: int) -> _Pending:
    up = set(self.live())
    caps = capture_by_domain(specs, leaves, replicas=replicas, step=header.step,
                             domain_of={d: k for d, k in self._domain_of.items() if k in up})
    return _Pending(header, [(self.stores[k], cap, self.stores[k].reserve(header.step,
                                                                           cap.nbytes,
                                                                           header.kept_step))
                             for k, cap in caps.items()])

  def drain(self, pending: _Pending) -> int:
    return _copy.drain_and_commit(pending.jobs, pending.header, pool=self._pool,
                                  options=self.options)

  def _bytes(self, plan: StepPlan, copy: Copy) -> np.ndarray:
    rec = copy.record
    buf = self.stores[copy.store].slots.get(copy.slot)
    if buf is None or buf.nbytes < rec.offset + rec.nbytes:
      raise BadCopy(copy.key(plan.step), plan.path_and_dtype(rec)[0], why="slot gone")
    return buf[rec.offset: rec.offset + rec.nbytes]

  def check(self, plan: StepPlan, copy: Copy) -> None:
    rec = copy.record
    path, _ = plan.path_and_dtype(rec)
    if not crc_matches(self._bytes(plan, copy), rec.checksum, chunk_bytes=plan.chunk_bytes,
                       key=piece_key(path, rec.index)):
      raise BadCopy(copy.key(plan.step), path)

  def fetch(self, plan: StepPlan, copy: Copy, device: jax.Device | None, *,
            out: np.ndarray | None = None) -> Any:
    rec = copy.record
    path, dtype = plan.path_and_dtype(rec)
    got = _copy.verified_piece(self._bytes(plan, copy), rec, path, dtype,
                               chunk_bytes=plan.chunk_bytes, pool=self._pool, out=out)
    if got is None:
      raise BadCopy(copy.key(plan.step), path)
    return got

  def fetch_run(self, plan: StepPlan, copies: Sequence[Copy], out: np.ndarray) -> list[Any]:
    raise NotImplementedError("runs is False")

  def place_leaf(self, assembler: Assembler, leaf: int, sharding: jax.sharding.Sharding,
                 wanted: Sequence[tuple[jax.Device, Index]]) -> None:
    return None  # host bytes go to devices shard by shard
