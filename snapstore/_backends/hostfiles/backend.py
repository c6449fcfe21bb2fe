"""The host-files backend: each store is a directory of slot files and
manifests on a RAM disk (:mod:`.store`), which outlives the trainer process.

Multi-controller (``jax.distributed``): one store, this process's; replica
pieces for hosts of other failure domains arrive by a JAX ring permute
(:mod:`.capture`). Single controller with ``slices=``: one store per failure
domain, all written by this process.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
from collections.abc import Mapping, Sequence
from concurrent import futures
from pathlib import Path
from typing import Any

import jax
import numpy as np

from ... import _devices, _parity
from ..._assemble import Assembler, BadCopy
from ..._checksum import (
  ChecksumKind,
  copy_crc_many,
  crc_matches,
  first_seed,
  piece_key,
)
from ..._index import Index, shape_of
from ..._multihost import Collective
from ..._placement import host_domains
from ..._planner import Copy, StepPlan
from ..._tree import LeafSpec
from ...options import SnapshotOptions
from ...stores import HostFiles
from .. import _copy
from ..base import DomainStores, Header
from ..staging import Report, Stager
from . import adopt as _adopt, capture as _capture
from .store import HostStore, host_dir, read_progress

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _Pending:
  header: Header
  jobs: list[tuple[HostStore, _copy.Capture, int]]  # (store, capture, slot)

  @property
  def staging(self) -> Report:
    """What the capture staged (:mod:`..staging`), all stores together."""
    reports = [cap.staged for _, cap, _ in self.jobs]
    return Report(staged_bytes=sum(r.staged_bytes for r in reports),
                  copied_bytes=sum(r.copied_bytes for r in reports),
                  stall_seconds=sum(r.stall_seconds for r in reports))


@functools.lru_cache(maxsize=8)
def _stripes_of(devices: tuple[jax.Device, ...], domains: tuple[tuple[int, int], ...],
                k: int) -> _parity.Stripes:
  return _parity.stripes(devices, dict(domains), k)


class HostFilesBackend(DomainStores):
  """Snapshots in files on a RAM disk, one store per process (or per failure
  domain on a single controller)."""

  runs = True  # a slot's consecutive pieces are fetched in one copy (fetch_run)

  def __init__(self, options: SnapshotOptions, spec: HostFiles, *, host: int, num_hosts: int,
               slices: Mapping[int, Sequence[jax.Device]] | None,
               pool: futures.Executor):
    self.options = options
    self.spec = spec
    self._pool = pool
    # host copies: fetched in parallel (Assembler.prefetch)
    self.prefetch_pool: futures.Executor | None = pool
    self.prefetch_workers = options.copy_threads
    self._host = host
    self._domain_of = ({d: k for k, devs in slices.items() for d in devs}
                       if slices is not None else None)
    ids = sorted(slices) if slices is not None else [host]
    super().__init__({i: HostStore(host_dir(spec.dir, options.run_id, i),
                                   run_id=options.run_id, host=i, keep=options.keep,
                                   budget_bytes=spec.budget_bytes) for i in ids},
                     run_id=options.run_id)
    self._domains = (host_domains(jax.devices(), options.hosts_per_domain)
                     if num_hosts > 1 else None)
    if self._domains is not None and options.parity_k is not None:
      why = _parity.groups_error(len(set(self._domains.values())), options.parity_k)
      if why:
        raise ValueError(why)
    self._stager = Stager.of(options)
    # A multi-controller process claims its own store and may adopt others
    # found on its machine at a restore (.adopt)
    self._run_dir = Path(spec.dir) / options.run_id
    self._adopted: dict[int, _adopt.Adopted] = {}
    self._refused: set[int] = set()  # found, not adopted: never tried again here
    self._claim: int | None = None
    self._claims = slices is None and num_hosts > 1
    if self._claims:  # (another's probe may hold it a moment)
      self._claim = _adopt.lock(self.stores[host].root, tries=20, wait_s=0.05)
      if self._claim is None:
        logger.warning("host %d: %s is locked by another process (an older one of this "
                       "host still running?); its snapshots stay fenced by incarnation",
                       host, self.stores[host].root)
    self._views_plan: StepPlan | None = None  # slot views of the plan being read
    self._views: dict[tuple[int, int], np.ndarray] = {}
    self._views_lock = threading.Lock()  # fetches run on the pool


  def _stripes(self) -> _parity.Stripes | None:
    """The parity stripes over the job's devices now (None: replicas)."""
    k = self.options.parity_k
    if k is None or self._domains is None:
      return None
    return _stripes_of(tuple(_devices.devices()), tuple(sorted(self._domains.items())), k)

  def close(self) -> None:
    """Drops the mappings of the last restore's slots, then the stores'
    (and the locks of its own store and the adopted ones)."""
    with self._views_lock:
      self._views, self._views_plan = {}, None
    super().close()
    for a in self._adopted.values():
      a.store.close()
      _adopt.unlock(a.fd)
    self._adopted.clear()
    if self._claim is not None:
      _adopt.unlock(self._claim)
      self._claim = None

  # ------------------------------------------------------ stores of others
  def read_progress(self) -> tuple[int, int]:
    """The newest progress over this process's stores and, multi-controller,
    every other store of the run on this machine (read only: a restart that
    gave this process another index continues their incarnations)."""
    own = super().read_progress()
    if not self._claims:
      return own
    others = [read_progress(path) for q, path in _adopt.host_dirs(self._run_dir)
              if q not in self.stores]
    return (max([own[0]] + [p[0] for p in others]), max([own[1]] + [p[1] for p in others]))

  def adoption_pending(self) -> bool:
    """Whether this machine holds a store of this run that no live process
    claims, or one adopted whose snapshots have not gone home (a restore
    then adopts and sends them: :meth:`repatriate`)."""
    if not self._claims:
      return False
    return any(not a.sent for a in self._adopted.values()) or bool(
        _adopt.unclaimed(self._run_dir, set(self.stores) | set(self._adopted) | self._refused))

  def repatriate(self, coll: Collective) -> list[str]:
    """Adopts the unclaimed stores on this machine and sends every adopted
    store's snapshots to the process of its index (:func:`.adopt.repatriate`).
    Collective (a restore's, where any host's :meth:`adoption_pending`)."""
    if self._claims:
      self._adopted.update(_adopt.adopt(self._run_dir, set(self.stores), self._adopted,
                                        run_id=self.run_id, keep=self.options.keep,
                                        refused=self._refused))
    return _adopt.repatriate(coll, self.stores[self._host], self._adopted, self.run_id,
                             self._refused)

  def restore_done(self, step: int | None) -> None:
    """The job restored ``step`` (None: from the persistent tier): the
    adopted stores sent home go once a newer step is held (:func:`.adopt.settle`)."""
    _adopt.settle(self._adopted, step)

  def watermark_moved(self, watermark: int | None) -> None:
    """Deletes the adopted stores sent home once ``watermark``, a step every
    store holds, is newer than the step restored (:func:`.adopt.release`)."""
    if self._adopted:
      _adopt.release(self._adopted, watermark)

  def describe(self) -> str:
    return f"the host stores in {self.stores[min(self.stores)].root.parent}"


  # ------------------------------------------------------------------ save
  def capture(self, header: Header, specs: Sequence[LeafSpec], leaves: Sequence[Any], *,
              replicas: int) -> _Pending:
    if self._claims and self._claim is None:  # its old holder may be gone now
      self._claim = _adopt.lock(self.stores[self._host].root)
    if self._domain_of is not None:
      up = set(self.live())
      live = {d: k for d, k in self._domain_of.items() if k in up}
      caps = _capture.capture_by_domain(specs, leaves, domain_of=live,
                                        replicas=replicas, step=header.step,
                                        stager=self._stager, staging=self.options.staging)
    else:
      caps = {self._host: _capture.capture(specs, leaves, host=self._host,
                                           domains=self._domains,
                                           replicas=replicas,
                                           step=header.step,
                                           stripes=self._stripes() if replicas else None,
                                           stager=self._stager,
                                           staging=self.options.staging)}
    jobs = []
    for sid, cap in caps.items():
      store = self.stores[sid]
      jobs.append((store, cap, store.reserve(header.step, cap.nbytes, header.kept_step)))
    if len(jobs) > 1:  # their new slots are made in the drain: room for all of them
      HostStore.check_room_for([store for store, _, _ in jobs])
    return _Pending(header, jobs)

  def drain(self, pending: _Pending) -> int:
    try:
      nbytes = _copy.drain_and_commit(pending.jobs, pending.header, pool=self._pool,
                                      options=self.options)
    except BaseException:
      for _, cap, _ in pending.jobs:  # (the failure keeps pending: not its sources)
        cap.release()
      raise
    for store, _, _ in pending.jobs:  # the next new slot, made before a save needs it
      store.make_ahead()
    return nbytes

  def ahead_seconds(self) -> float:
    return sum(store.ahead_seconds for store in self.stores.values())

  # --------------------------------------------------------------- restore
  def _slot(self, plan: StepPlan, copy: Copy) -> np.ndarray:
    """The bytes of ``copy``'s slot: opened and its length checked once per
    plan (not once per piece: a state has thousands)."""
    if self._views_plan is plan:  # the usual case: no lock (dict reads are atomic)
      buf = self._views.get((copy.store, copy.slot))
      if buf is not None and buf.nbytes >= copy.slot_bytes:
        return buf
    with self._views_lock:
      if self._views_plan is not plan:
        self._views = {}  # before the plan: a reader without the lock that
        self._views_plan = plan  # sees this plan sees its views
      buf = self._views.get((copy.store, copy.slot))
      if buf is None or buf.nbytes < copy.slot_bytes:
        try:
          buf = self.stores[copy.store].read_buffer(copy.slot, copy.slot_bytes)
        except (OSError, ValueError) as e:  # CorruptSnapshotError is a ValueError
          raise BadCopy(copy.key(plan.step), plan.path_and_dtype(copy.record)[0],
                        why=f"unreadable ({e})") from e
        self._views[(copy.store, copy.slot)] = buf
    return buf

  def _read(self, plan: StepPlan, copy: Copy) -> np.ndarray:
    """The bytes of ``copy``."""
    rec = copy.record
    return self._slot(plan, copy)[rec.offset: rec.offset + rec.nbytes]

  def check(self, plan: StepPlan, copy: Copy) -> None:
    rec = copy.record
    path, _ = plan.path_and_dtype(rec)
    if rec.kind is not ChecksumKind.CRC32C or not crc_matches(
        self._read(plan, copy), rec.checksum, chunk_bytes=plan.chunk_bytes,
        key=piece_key(path, rec.index), pool=self._pool):
      raise BadCopy(copy.key(plan.step), path)

  def fetch(self, plan: StepPlan, copy: Copy, device: jax.Device | None, *,
            out: np.ndarray | None = None) -> Any:
    rec = copy.record
    path, dtype = plan.path_and_dtype(rec)
    got = _copy.verified_piece(self._read(plan, copy), rec, path, dtype,
                               chunk_bytes=plan.chunk_bytes, pool=self._pool, out=out)
    if got is None:
      raise BadCopy(copy.key(plan.step), path)
    return got

  def fetch_run(self, plan: StepPlan, copies: Sequence[Copy], out: np.ndarray
                ) -> list[Any]:
    """Consecutive copies of one slot (see :meth:`.._assemble.PieceSource.fetch_run`)
    into ``out``, each piece checked as it is copied
    (:func:`.._checksum.copy_crc_many`: one call for the whole run where
    :mod:`.._stream` is built, no Python a piece but its row and its view)."""
    first, last = copies[0], copies[-1]
    start = first.record.offset
    try:
      span = self._slot(plan, first)[start: last.record.offset + last.record.nbytes]
    except BadCopy:  # each copy alone then says why
      return [None] * len(copies)
    if span.nbytes != out.nbytes:
      return [None] * len(copies)
    # (per piece: its row, a lookup and a view; thousands of pieces)
    recs = [c.record for c in copies]
    rows: list[int] = []
    usable: list[bool] = []
    leaf = None
    chunk_bytes = plan.chunk_bytes
    for rec in recs:
      if rec.leaf != leaf:
        leaf = rec.leaf
        path, _ = plan.path_and_dtype(rec)
      ok = (rec.kind is ChecksumKind.CRC32C and len(rec.checksum) == 1
            and rec.nbytes <= chunk_bytes)
      usable.append(ok)
      rows += (rec.offset - start, rec.nbytes if ok else 0, first_seed(path, rec.index))
    crcs = copy_crc_many(span, out, rows)
    got: list[Any] = []
    leaf = None
    for rec, ok, crc, at in zip(recs, usable, crcs, rows[::3], strict=True):
      if not ok or crc != rec.checksum[0]:
        got.append(None)
        continue
      if rec.leaf != leaf:
        leaf = rec.leaf
        _, dtype = plan.path_and_dtype(rec)
      part = out[at: at + rec.nbytes].view(dtype)
      got.append(part if rec.leaf < 0 else part.reshape(shape_of(rec.index)))
    return got

  def place_leaf(self, assembler: Assembler, leaf: int, sharding: jax.sharding.Sharding,
                 wanted: Sequence[tuple[jax.Device, Index]]) -> None:
    return None  # host bytes go to devices shard by shard


