"""Pinned-host capture: ``pinned_host`` copies of every piece on the failure
domains (slices) that keep it, dispatched asynchronously.

On Pathways the controller owns every array but the bytes of a
``pinned_host`` array live in the RAM of the host of its device. So a
snapshot is one single-device ``pinned_host`` array per stored piece, put on a
device of the domain that keeps it: its own shards, plus a copy of each shard
that has no data-parallel twin on the next domains in ring order
(:func:`._placement.ring_keepers`). Nothing crosses to the controller but the
checksums (:mod:`._checksum`). Numpy leaves and Python scalars are controller
state (the controller survives on Pathways) and are kept as controller copies.

On CPU devices (whose ``pinned_host`` memory is this process's RAM) the copy
is made on the host instead: ``capture`` pins views of the shards, and the
drain copies each piece once with its crc32c into the slot's reused memory
(:meth:`PinnedCapture.copy_on_cpu`), of which the store hands out
``pinned_host`` arrays on demand (:class:`.store.PinnedHostStore`).
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent import futures
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from ... import _faults, _jax_private, _parity
from ..._checksum import (
  Checksum,
  ChecksumKind,
  as_checksum,
  crc_chunks,
  device_checksum,
  piece_key,
  shard_checksums,
)
from ..._index import Index, align, nbytes as index_nbytes, normalize
from ..._jax_compat import single_device_sharding
from ..._placement import HolderLayout, holder_layout, shard_arrays
from ..._tree import LeafKind, LeafSpec, Piece, positions
from ...options import Staging
from .._copy import Capture
from ..staging import Read, Report, Stager, staged
from .host import HostJob, Later, add_host_leaf, copy_to_host
from .ring import Ring, copy_of, structure
from .slices import HostParts, Pending, SliceStager, Staged, stageable
from .store import PINNED, Stored


@dataclasses.dataclass
class PinnedCapture:
  """Pieces per domain, dispatched (not yet complete) ``pinned_host`` copies,
  and the checksum of every distinct piece (pending on device)."""

  pieces: dict[int, list[tuple[Piece, int]]]   # domain -> (piece, owner domain)
  arrays: dict[int, list[Stored | None]]  # None until dispatched, or drained (CPU)
  sums: dict[tuple[int, Index], Callable[[], Checksum]]
  kinds: dict[tuple[int, Index], ChecksumKind]
  scalars: dict[int, Any]
  # (stripe, block) of each parity piece -> (members, layout, length)
  parity: dict[tuple[int, int], tuple[tuple[int, ...], tuple[Any, ...], int]] = \
      dataclasses.field(default_factory=dict)
  # In this process's memory (PinnedMemory.PROCESS): domain -> what the
  # drain copies there, and the crc32c it found of each position
  host: dict[int, HostJob] = dataclasses.field(default_factory=dict)
  host_sums: dict[int, dict[int, Checksum]] = dataclasses.field(default_factory=dict)
  # domain -> position -> the device each host part belongs to (the store's handles)
  host_devices: dict[int, dict[int, jax.Device]] = dataclasses.field(default_factory=dict)
  checksum: ChecksumKind = ChecksumKind.DEVICE_SUM  # of every piece not in ``kinds``
  staged: Report = dataclasses.field(default_factory=Report)  # what staging did

  def kind(self, leaf: int, index: Index) -> ChecksumKind:
    return self.kinds.get((leaf, index), self.checksum)

  def nbytes(self, domain: int) -> int:
    """The bytes ``domain`` keeps: in this process's memory, each piece at a
    page boundary of its slot, as the slot memory holds it."""
    if domain in self.host:
      return sum(align(p.nbytes) for p, _ in self.pieces[domain])
    return sum(p.nbytes for p, _ in self.pieces[domain])

  def copy_to_host(self, take: Callable[[int, int], np.ndarray], pool: futures.Executor,
                   chunk_bytes: int) -> None:
    """``PinnedMemory.PROCESS``: the drain's copy of every domain's pieces
    into ``take(domain, bytes)`` (:func:`.host.copy_to_host`)."""
    jobs = {d: self.host.pop(d) for d in sorted(self.host)}
    copy_to_host(jobs, self.arrays, self.host_sums, self.host_devices, take, pool, chunk_bytes)

  def wait(self) -> None:
    """Blocks until every copy has landed (raises if a slice died meanwhile);
    staged copies become the :class:`.slices.HostParts` the store keeps."""
    for arrs in self.arrays.values():
      for k, a in enumerate(arrs):
        if isinstance(a, Pending):
          arrs[k] = a.resolve()
    jax.block_until_ready([p for arrs in self.arrays.values() for a in arrs
                           for p in (a.parts if isinstance(a, HostParts) else (a,))
                           if isinstance(p, jax.Array)])

  def checksums(self, domain: int, pool: futures.Executor) -> list[Checksum]:
    """Each piece's checksum (crc32c of host copies runs on ``pool``)."""
    done = self.host_sums.get(domain, {})
    rest = [(pos, p) for pos, (p, _) in enumerate(self.pieces[domain]) if pos not in done]
    got = dict(zip((pos for pos, _ in rest),
                   pool.map(lambda x: self.sums[(x[1].leaf, x[1].index)](), rest), strict=True))
    return [done[pos] if pos in done else got[pos] for pos in range(len(self.pieces[domain]))]


def capture(specs: Sequence[LeafSpec], leaves: Sequence[Any], *,
            slices: Mapping[int, Sequence[jax.Device]], replicas: int,
            step: int = -1, checksum: ChecksumKind = ChecksumKind.DEVICE_SUM,
            chunk_bytes: int = 16 << 20,
            before_dispatch: Callable[[dict[int, int]], None] = lambda nbytes: None,
            stripes: _parity.Stripes | None = None, host: bool = False,
            stager: Stager | None = None, staging: Staging = Staging.AUTO,
            slice_stager: SliceStager | None = None) -> PinnedCapture:
  """Dispatches ``pinned_host`` copies of every piece to the domains that keep
  it; returns at once (the copies and checksums complete asynchronously, and
  XLA orders them before any later step that donates the buffers).

  With ``host`` (``PinnedMemory.PROCESS``; crc32c checksums) every piece is
  left for the drain to copy into this process's memory
  (:meth:`PinnedCapture.copy_to_host`), read as host files read it: a
  view of each CPU shard, else (with a ``stager``) the shard staged in
  device memory and on its way to host memory in pieces, which blocks only
  for what does not fit the staging budget (:mod:`..staging`).

  With ``stripes`` (``redundancy="parity"``), a leaf with a piece that no
  other domain holds is kept by its own domain only, plus the parity blocks
  of its stripes (:mod:`..._parity`), unless it is not evenly sharded over the
  stripes' devices: then it gets ``replicas`` full copies as usual.

  Else (``PinnedMemory.SLICE_HOSTS``) with a ``slice_stager`` each leaf
  that allows it is staged in device memory as pieces that move into its
  devices' host memory at the link's speed (:mod:`.slices`); the others
  are put to ``pinned_host`` as they are.

  ``before_dispatch(bytes per domain)`` runs before any memory is taken: it
  may raise (over budget) or evict older snapshots.
  """
  ring = Ring(slices)
  cap = PinnedCapture({k: [] for k in ring.order}, {k: [] for k in ring.order}, {}, {}, {},
                      checksum=checksum)
  # In this process's memory a piece is copied once by the drain, which
  # checksums it as it goes, into memory reused from the slot's last
  # snapshot (a put to pinned_host would cost the caller a JAX call a leaf,
  # the drain a second pass for the crc32c and fresh pages, and a TPU the
  # link's speed: ~1 GB/s, not ~14, on a v5e).
  if host and checksum is not ChecksumKind.CRC32C:
    raise ValueError("a pinned-host capture into this process's memory checks by crc32c")
  arrays = staged(specs, leaves, staging if stager is not None else Staging.NEVER) if host else {}
  if host:
    cap.host = {d: HostJob(Capture(list(specs), [], [], [], {})) for d in ring.order}
  later: list[jax.Array] = []  # shards to stage (PROCESS off CPU), each read by one _Later
  placed, protect = _place_leaves(cap, specs, leaves, ring, replicas=replicas, step=step,
                                  chunk_bytes=chunk_bytes, stripes=stripes, arrays=arrays,
                                  later=later)
  length = (_place_parity(cap, ring, stripes, protect)
            if protect and stripes is not None else 0)
  if later and stager is not None:  # before before_dispatch (it evicts): a failure keeps all
    got, cap.staged = stager.stage(later)
    for job in cap.host.values():
      job.capture.sources = [got[x.k] if isinstance(x, Later) else x
                             for x in job.capture.sources]
  before_dispatch({d: cap.nbytes(d) for d in ring.order})
  slot = ({} if host and not protect else
          {(p.leaf, p.index, d): n for d, ps in cap.pieces.items()
           for n, (p, _) in enumerate(ps)})
  _dispatch_leaves(cap, specs, placed, ring, slot, chunk_bytes, slice_stager)
  if slice_stager is not None:
    slice_stager.flush()
    cap.staged = slice_stager.report()
  if protect and stripes is not None:
    _dispatch_parity(cap, ring, stripes, protect, length, slot, step=step,
                     chunk_bytes=chunk_bytes)
  return cap


_Placed = list[tuple[int, jax.Array, "_LeafPlacement"]]


def _place_leaves(cap: PinnedCapture, specs: Sequence[LeafSpec], leaves: Sequence[Any],
                 ring: Ring, *, replicas: int, step: int, chunk_bytes: int,
                 stripes: _parity.Stripes | None,
                 arrays: Mapping[int, tuple[jax.Array, jax.Array, Read]],
                 later: list[jax.Array]) -> tuple[_Placed, list[tuple[int, jax.Array]]]:
  """Where each leaf's pieces go: scalars and numpy leaves taken now (a
  checked copy a domain), array leaves read as ``arrays`` says (PROCESS:
  :func:`..staging.staged`) into the host jobs, the rest placed for
  dispatch. Returns the placed leaves and those that parity protects
  instead of replicas."""
  placed: _Placed = []
  protect: list[tuple[int, jax.Array]] = []
  for i, (spec, leaf) in enumerate(zip(specs, leaves, strict=True)):
    if i == len(specs) // 2:
      _faults.point("capture", step)
    if spec.kind is LeafKind.SCALAR:
      cap.scalars[i] = leaf
    elif spec.kind is LeafKind.NUMPY:
      data = np.array(leaf, copy=True)  # the caller may mutate it
      index = tuple((0, n) for n in data.shape)
      ck = crc_chunks(data, chunk_bytes=chunk_bytes, key=piece_key(spec.path, index))
      cap.sums[(i, index)] = _known(ck)
      cap.kinds[(i, index)] = ChecksumKind.CRC32C
      for k in ring.order:  # a copy each: one bad byte must not spoil them all
        cap.pieces[k].append((Piece(i, index, data.nbytes), ring.order[0]))
        cap.arrays[k].append(data if k == ring.order[0] else data.copy())
    else:
      arr = jax.random.key_data(leaf) if spec.kind is LeafKind.KEY else leaf
      if i in arrays:  # PROCESS: its device-memory value (parity reads it)
        arr = arrays[i][0]
      kept = replicas
      if stripes is not None and _held_once(holder_layout(spec.path, arr, ring.domain_of)) \
          and _parity.evenly_sharded(stripes, arr):
        kept = 0  # its own domain's copy, and the stripes' parity blocks
        protect.append((i, arr))
      if i in arrays:
        add_host_leaf(cap, i, spec.path, arrays[i], ring, kept, later)
        continue
      plan = _LeafPlacement.of(spec, arr, ring, kept)
      for (index, d), owner in plan.keep.items():
        cap.pieces[d].append(copy_of(i, index, plan.nbytes(index), owner))
        cap.arrays[d].append(None)  # filled at dispatch
      placed.append((i, arr, plan))
  return placed, protect


def _place_parity(cap: PinnedCapture, ring: Ring, stripes: _parity.Stripes,
                 protect: list[tuple[int, jax.Array]]) -> int:
  """A slot for each parity block in its device's domain; returns the
  stripes' padded length."""
  layouts, length = _parity.layout(stripes, [i for i, _ in protect],
                                   [a for _, a in protect])
  for (s, j), device in np.ndenumerate(stripes.grid):
    d = ring.domain(device)
    key = (stripes.stripe_id(s), j)
    cap.pieces[d].append((Piece(_parity.PARITY_LEAF, (key,), length // stripes.k), d))
    cap.arrays[d].append(None)
    cap.parity[key] = (tuple(ring.domain(x) for x in stripes.grid[s]),
                       tuple(layouts[s * stripes.n + m] for m in range(stripes.n)), length)
  return length


def _dispatch_leaves(cap: PinnedCapture, specs: Sequence[LeafSpec], placed: _Placed,
                     ring: Ring, slot: dict[tuple[int, Index, int], int],
                     chunk_bytes: int, stager: SliceStager | None = None) -> None:
  """Off CPU: the pinned copies of the placed leaves (staged where
  ``stager`` is given and the layout allows), and a checksum of each piece
  (on device, or of its host copy)."""
  on_device = cap.checksum is ChecksumKind.DEVICE_SUM
  for i, arr, plan in placed:
    got = plan.dispatch_staged(arr, ring, stager) if stager is not None and on_device else None
    per_shard: tuple[Callable[[], np.ndarray], dict] | None
    if got is not None:
      copies, staged = got
      per_shard = (_fetched_once(staged.sums), staged.rows)
    else:
      sums = shard_checksums(arr) if on_device else None
      per_shard = (_fetched_once(sums[0]), sums[1]) if sums is not None else None
      copies = plan.dispatch(arr, ring)
    for (index, d), copy in copies.items():
      cap.arrays[d][slot[(i, index, d)]] = copy
    first: dict[Index, int] = {}  # the lowest domain keeping each piece
    for index, d in plan.keep:
      first[index] = min(d, first.get(index, d))
    for index, src in plan.sources.items():
      d = first[index]
      cap.sums[(i, index)] = (_pending_sum(src, per_shard) if on_device
                              else _cpu_sum(cap, d, slot[(i, index, d)], chunk_bytes,
                                             piece_key(specs[i].path, index)))


def _dispatch_parity(cap: PinnedCapture, ring: Ring, stripes: _parity.Stripes,
                     protect: list[tuple[int, jax.Array]], length: int,
                     slot: dict[tuple[int, Index, int], int], *, step: int,
                     chunk_bytes: int) -> None:
  """The parity blocks, encoded on device, each to its own device's host
  RAM (PROCESS: left for the drain, their copies to host under way)."""
  out = _parity.encode(stripes, [a for _, a in protect], length)
  _faults.point("replica", step)
  if cap.host:
    _jax_private.copy_to_host_async([shard.data for shard in out.addressable_shards])
  for shard in out.addressable_shards:
    s, j = stripes.where[shard.device]
    d, index = ring.domain(shard.device), ((stripes.stripe_id(s), j),)
    at = slot[(_parity.PARITY_LEAF, index, d)]
    if cap.host:  # a fresh buffer that no step donates: the drain waits for it
      piece = cap.pieces[d][at][0]
      cap.host[d].add(piece, d, shard.data, at, np.dtype(shard.data.dtype),
                      tuple(shard.data.shape), shard.device)
      continue
    cap.arrays[d][at] = jax.device_put(shard.data, _pinned_on(shard.device))
    cap.sums[(_parity.PARITY_LEAF, index)] = (
        _pending_sum(shard.data, None) if cap.checksum is ChecksumKind.DEVICE_SUM
        else _cpu_sum(cap, d, at, chunk_bytes, piece_key(_parity.PARITY_PATH, index)))


def _known(checksum: Checksum) -> Callable[[], Checksum]:
  """A checksum already computed, as :attr:`PinnedCapture.sums` holds one."""
  return lambda: checksum


def _held_once(layout: HolderLayout) -> bool:
  """True if some piece is held by one domain only (no data-parallel twin)."""
  return any(len(held) < 2 for _, held in layout)





@dataclasses.dataclass
class _LeafPlacement:
  """Which (index, domain) copies one leaf needs, and from where."""

  itemsize: int
  holders: dict[Index, dict[int, jax.Array]]  # index -> domain -> its shard data
  keep: dict[tuple[Index, int], int]          # (index, domain) -> owner domain
  sources: dict[Index, jax.Array]             # index -> the owner's shard

  # (index, domain) -> (position of the shard its copy is made from, the
  # device whose host keeps it, how many places back on the ring the domain
  # it is read from is: 0 for its own shard); from :func:`_structure`
  copies: Mapping[tuple[Index, int], tuple[int, jax.Device, int]] = \
      dataclasses.field(default_factory=dict)
  shards: Sequence[jax.Array] = ()  # by position

  @classmethod
  def of(cls, spec: LeafSpec, arr: jax.Array, ring: Ring, replicas: int) -> _LeafPlacement:
    layout = holder_layout(spec.path, arr, ring.domain_of)
    shards = shard_arrays(arr)
    keep, owners, copies = structure(layout, tuple(positions(arr)), ring, replicas)
    holders = {index: {d: shards[at] for d, at in held} for index, held in layout}
    return cls(arr.dtype.itemsize, holders, keep,
               {index: shards[at] for index, at in owners}, copies, shards)

  def nbytes(self, index: Index) -> int:
    return index_nbytes(index, self.itemsize)

  def shift_to(self, index: Index, domain: int) -> int:
    """How many places back on the ring the nearest domain holding
    ``index`` is, for ``domain`` that keeps a copy without holding it."""
    return self.copies[(index, domain)][2]

  def source(self, index: Index, domain: int) -> tuple[jax.Array, jax.Device]:
    """(the shard ``domain``'s copy of ``index`` is made from, the device
    whose host keeps it): its own shard there, else the one ``shift_to``
    places back, kept by the device at the same place in ``domain``."""
    at, device, _ = self.copies[(index, domain)]
    return self.shards[at], device

  def dispatch(self, arr: jax.Array, ring: Ring) -> dict[tuple[Index, int], jax.Array]:
    """Starts the copies: whole-array ``device_put``s where the sharding
    allows (async, one dispatch, all devices in parallel), else one put per
    piece."""
    out: dict[tuple[Index, int], jax.Array] = {}
    shape = tuple(arr.shape)
    own = [key for key in self.keep if key[1] in self.holders[key[0]]]
    dense = sum(len(v) for v in self.holders.values()) == len(arr.sharding.device_set)
    whole = None  # the whole leaf in pinned_host memory, where it was put at once
    if own and dense and isinstance(arr.sharding, NamedSharding):
      whole = jax.device_put(arr, arr.sharding.with_memory_kind(PINNED), may_alias=False)
      self._collect(whole, ring, shape, own, out)
    else:
      for index, d in own:
        data = self.holders[index][d]
        out[(index, d)] = jax.device_put(data, _pinned_on(device_of(data)), may_alias=False)
    by_shift: dict[int, list[tuple[Index, int]]] = {}
    for index, t in self.keep:
      if t not in self.holders[index]:
        by_shift.setdefault(self.shift_to(index, t), []).append((index, t))
    for k, wanted in sorted(by_shift.items()):
      moved = _ring_sharding(arr.sharding, ring, k)
      if moved is not None:
        if whole is None:  # a put may change devices or memory kind, not both
          whole = jax.device_put(arr, arr.sharding.with_memory_kind(PINNED), may_alias=False)
        self._collect(jax.device_put(whole, moved), ring, shape, wanted, out)
        continue
      for index, t in wanted:  # one by one, from the domain k places back
        data, there = self.source(index, t)
        out[(index, t)] = jax.device_put(data, _pinned_on(there))
    return out

  def dispatch_staged(self, arr: jax.Array, ring: Ring, stager: SliceStager
                      ) -> tuple[dict[tuple[Index, int], Any], Staged] | None:
    """As :meth:`dispatch`, from ``arr`` staged as pieces (:mod:`.slices`):
    (each copy, pending until the drain's wait; the staged leaf, whose
    checksums are its shards'). None where the layout does not allow it
    (the caller dispatches as before)."""
    if not stager.staging or not stageable(arr):
      return None
    sharding = arr.sharding
    assert isinstance(sharding, NamedSharding)
    own = [key for key in self.keep if key[1] in self.holders[key[0]]]
    dense = sum(len(v) for v in self.holders.values()) == len(sharding.device_set)
    if own and not dense:  # twins inside a domain: only one of them is kept
      return None
    moved: dict[int, NamedSharding] = {}
    by_shift: dict[int, list[tuple[Index, int]]] = {}
    for index, t in self.keep:
      if t not in self.holders[index]:
        by_shift.setdefault(self.shift_to(index, t), []).append((index, t))
    for k in by_shift:  # (one moved mesh a shift: a copy a device shares it)
      ring_to = _ring_sharding(sharding, ring, k)
      if ring_to is None:
        return None
      moved[k] = ring_to
    staged = stager.stage(arr)
    index_of = _indices(sharding, tuple(arr.shape))
    out: dict[tuple[Index, int], Any] = {}
    _collect_staged(staged, index_of, ring, own, out)
    flat = list(sharding.mesh.devices.flat)
    for k, wanted in sorted(by_shift.items()):
      mesh = moved[k].mesh
      assert isinstance(mesh, Mesh)  # (_ring_sharding makes one)
      copy = stager.ring(staged, mesh)
      _collect_staged(copy, {m: index_of[o] for o, m in zip(flat, mesh.devices.flat,
                                                             strict=True)},
                      ring, wanted, out)
    return out, staged

  @staticmethod
  def _collect(copy: jax.Array, ring: Ring, shape: tuple[int, ...],
               wanted: Sequence[tuple[Index, int]], out: dict) -> None:
    want = set(wanted)
    for shard in copy.addressable_shards:
      key = (normalize(shard.index, shape), ring.domain(shard.device))
      if key in want and key not in out:
        out[key] = shard.data


def _collect_staged(staged: Staged, index_of: Mapping[jax.Device, Index], ring: Ring,
                    wanted: Sequence[tuple[Index, int]], out: dict) -> None:
  """A :class:`.slices.Pending` copy for each wanted (index, domain): the
  row of the device in that domain that holds ``index``."""
  want = set(wanted)
  for device, index in index_of.items():
    key = (index, ring.domain(device))
    if key in want and key not in out:
      out[key] = Pending(staged, device)


@functools.lru_cache(maxsize=4096)
def _indices(sharding: jax.sharding.Sharding, shape: tuple[int, ...]) -> dict[jax.Device, Index]:
  """device -> the index of its shard of an array of ``shape``."""
  return {d: normalize(idx, shape) for d, idx in sharding.devices_indices_map(shape).items()}


@functools.lru_cache(maxsize=4096)
def _pinned_on(device: jax.Device) -> jax.sharding.Sharding:
  return single_device_sharding(device, memory_kind=PINNED)


@functools.lru_cache(maxsize=4096)  # (the same leaves' shardings every save)
def _ring_sharding(sharding: jax.sharding.Sharding, ring: Ring, k: int
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


def _cpu_sum(cap: PinnedCapture, domain: int, position: int, chunk_bytes: int,
              key: bytes) -> Callable[[], Checksum]:
  """crc32c of a piece's first pinned copy, once it has landed (memoized)."""
  memo: list[Checksum] = []
  lock = threading.Lock()  # copies of one piece in several domains share it

  def get() -> Checksum:
    with lock:
      if not memo:
        memo.append(crc_chunks(np.asarray(cap.arrays[domain][position]),
                               chunk_bytes=chunk_bytes, key=key))
      return memo[0]
  return get


def _pending_sum(src: jax.Array,
                 per_shard: tuple[Callable[[], np.ndarray], dict] | None
                 ) -> Callable[[], Checksum]:
  if per_shard is not None:
    host, rows = per_shard
    row = rows[next(iter(src.devices()))]
    return lambda: as_checksum(host()[row])
  pending = device_checksum(src)  # dispatched now, read in the drain
  return lambda: as_checksum(pending)


def _fetched_once(out: jax.Array) -> Callable[[], np.ndarray]:
  """``out``'s host value, fetched once however many drain threads ask for
  it (concurrent ``np.asarray`` of one array raced inside jax 0.10:
  IndexError, seen once in CI). One per leaf: its pieces share it."""
  lock = threading.Lock()
  memo: list[np.ndarray] = []

  def get() -> np.ndarray:
    with lock:
      if not memo:
        memo.append(np.asarray(out))
      return memo[0]
  return get


def device_of(a: jax.Array | HostParts) -> jax.Device:
  """The device of a single-device array (or of a staged copy's parts)."""
  return next(iter(a.devices()))
