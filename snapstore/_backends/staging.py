"""Staged capture for accelerators: a state's shards, copied in device memory
and cut into pieces the device-to-host link moves fast, leave for host
memory while the next step runs.

On a TPU v5e a ``device_put`` to ``pinned_host`` moves ~1 GB/s, while pieces
of ~4 MiB with many ``copy_to_host_async()`` in flight reach 14.5 GB/s
(``shared/FIELD-NOTES.md``, "Device to host on a TPU v5e"). A copy made in
device memory first lets the next step donate the state at once: the copy,
not the state, is what travels.

:meth:`Stager.stage` runs on the training thread (in a backend's
``capture``). Per device, the shards' bytes are cut into *parts*: each
``chunk_bytes`` chunk of a shard's C-order bytes (the drain's crc32c unit)
into near-equal parts of at most ``piece_bytes``, on element boundaries, so
part ``k`` of a shard is bytes ``bounds[k]:bounds[k + 1]`` of its slot bytes
(:class:`Parts`). One jitted program per device (cached by its cuts) makes
every part at once; each then starts its copy to host.

The parts left in device memory for the drain must fit a budget per device
(:func:`budget`); what does not fit is copied out before ``stage`` returns,
in batches of half the budget with two in flight, and that wait is
reported. Below two pieces of budget nothing is staged: the shards are
copied to host as they are. Either way, once ``stage`` returns no part
reads the state: the next step may donate it.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax import lax

from .. import _jax_private
from .._tree import LeafKind, LeafSpec
from ..options import SnapshotOptions, Staging

logger = logging.getLogger(__name__)

#: Device memory kept free beyond the budget: the larger of these.
HEADROOM_BYTES = 256 << 20
HEADROOM_FRACTION = 0.05


class Parts:
  """A shard's bytes as consecutive parts: part ``k`` is bytes
  ``bounds[k]:bounds[k + 1]`` of the shard's C-order bytes, held as a device
  array whose copy to host is under way, or as its host copy once landed.
  Each part is read once (:meth:`take`), on the drain's threads."""

  __slots__ = ("arrays", "bounds")

  def __init__(self, bounds: tuple[int, ...]) -> None:
    self.bounds = bounds
    self.arrays: list[jax.Array | np.ndarray | None] = [None] * (len(bounds) - 1)

  def take(self, k: int) -> np.ndarray:
    """Part ``k``'s bytes in host memory (blocks until they land), flat
    uint8; the part is dropped here, so its device and host memory go as
    soon as the caller is done with the bytes."""
    x = self.arrays[k]
    self.arrays[k] = None
    if x is None:
      raise RuntimeError(f"part {k} of a staged shard was already read")
    return np.ascontiguousarray(np.asarray(x)).reshape(-1).view(np.uint8)


@dataclasses.dataclass(frozen=True)
class Report:
  """What one :meth:`Stager.stage` did."""

  staged_bytes: int = 0     # left in device memory, in flight to host, for the drain
  copied_bytes: int = 0     # copied to host before stage returned (over the budget)
  stall_seconds: float = 0.0  # time stage waited for those copies


@functools.lru_cache(maxsize=1 << 16)  # the same shards every snapshot
def part_bounds(nbytes: int, itemsize: int, piece_bytes: int, chunk_bytes: int
                ) -> tuple[int, ...]:
  """Byte offsets of a shard's parts: each ``chunk_bytes`` chunk cut into
  near-equal parts of at most about ``piece_bytes``, on element boundaries
  (a chunk, a multiple of 4096 bytes, starts on one)."""
  out = [0]
  for c in range(0, nbytes, chunk_bytes):
    elems = min(chunk_bytes, nbytes - c) // itemsize
    k = max(1, -(-elems * itemsize // piece_bytes))
    out.extend(c + elems * j // k * itemsize for j in range(1, k + 1))
  return tuple(out)


def budget(stats: Mapping[str, int] | None, cap: int | None, *, held: int = 0,
           need: int | None = None) -> tuple[int | None, int | None]:
  """(bytes a capture may leave staged on a device, the device's own need
  to remember for the next call). ``stats``: ``device.memory_stats()``;
  ``cap``: ``SnapshotOptions.staging_budget_bytes``.

  The device's need is its peak use less what this stager held when that
  peak could have been reached (``held``: the most it had staged since the
  last call; the first call's peak is all the program's), never below its
  use now: the next step's temporaries must still fit beside the parts.
  The budget is the limit less that need, less a headroom of
  ``max(HEADROOM_BYTES, HEADROOM_FRACTION x limit)``, capped by ``cap``.
  Without ``bytes_limit`` (CPU devices) it is ``cap`` (None: no limit)."""
  if not stats or "bytes_limit" not in stats:
    return cap, need
  limit = int(stats["bytes_limit"])
  in_use = int(stats.get("bytes_in_use", 0))
  peak = int(stats.get("peak_bytes_in_use", in_use))
  own = peak if need is None else max(need, peak - held)
  headroom = max(HEADROOM_BYTES, int(limit * HEADROOM_FRACTION))
  free = max(0, limit - max(own, in_use) - headroom)
  return (free if cap is None else min(free, cap)), own


@functools.lru_cache(maxsize=1024)
def _cutter(cuts: tuple[tuple[int, int, int], ...]) -> Callable[..., list[jax.Array]]:
  """A jitted ``f(*shards) -> parts``: part ``j`` is elements
  ``cuts[j][1]:cuts[j][2]`` of shard ``cuts[j][0]`` flattened (a new buffer:
  nothing it returns aliases a shard)."""

  def cut(*xs: jax.Array) -> list[jax.Array]:
    flat = [x.reshape(-1) for x in xs]
    return [lax.slice(flat[k], (a,), (b,)) for k, a, b in cuts]
  return jax.jit(cut)


# (shard position in ``shards``, part k, start byte, end byte) of one part
_Part = tuple[int, int, int, int]


@dataclasses.dataclass
class _Device:
  """What a stager remembers of one device between captures."""

  need: int | None = None  # its program's own peak (see budget)
  held: int = 0            # the most staged on it since the last capture


class Stager:
  """Stages shards in device memory (:meth:`stage`), one per backend: it
  remembers each device's need between captures. Not thread-safe: call it
  from the training thread only."""

  def __init__(self, *, piece_bytes: int, chunk_bytes: int, budget_bytes: int | None) -> None:
    self.piece_bytes, self.chunk_bytes, self.budget_bytes = piece_bytes, chunk_bytes, budget_bytes
    self._devices: dict[jax.Device, _Device] = {}
    self._oom_logged = False

  @classmethod
  def of(cls, options: SnapshotOptions) -> Stager | None:
    """The stager ``options`` ask for (None with ``Staging.NEVER``)."""
    if options.staging is Staging.NEVER:
      return None
    return cls(piece_bytes=options.staging_piece_bytes, chunk_bytes=options.chunk_bytes,
               budget_bytes=options.staging_budget_bytes)

  def room(self, device: jax.Device) -> int | None:
    """Bytes a capture may leave staged on ``device`` now (None: no limit);
    tell :meth:`held` what it then staged."""
    return self._budget(device)

  def held(self, device: jax.Device, nbytes: int) -> None:
    """The most a capture staged on ``device`` since :meth:`room` asked."""
    self._devices.setdefault(device, _Device()).held = nbytes

  def _budget(self, device: jax.Device) -> int | None:
    seen = self._devices.setdefault(device, _Device())
    got, seen.need = budget(device.memory_stats(), self.budget_bytes, held=seen.held,
                            need=seen.need)
    seen.held = 0
    return got

  def stage(self, shards: Sequence[jax.Array]) -> tuple[list[Parts | np.ndarray], Report]:
    """Per single-device shard, its bytes: :class:`Parts` (in flight from
    device memory, or landed) or, for a shard copied whole, its host copy.
    Blocks for the copies over the budget only (reported). From the
    training thread; the shards may be donated once it returns."""
    itemsizes = [np.dtype(x.dtype).itemsize for x in shards]
    out: list[Parts | np.ndarray | None] = [None] * len(shards)
    by_device: dict[jax.Device, list[int]] = {}
    for j, x in enumerate(shards):
      if x.size == 0:
        out[j] = np.empty(0, np.uint8)
      else:
        by_device.setdefault(next(iter(x.devices())), []).append(j)
    direct: list[int] = []       # shards copied whole, no staging
    overflow: list[list[list[_Part]]] = []  # per device, its groups copied before return
    kept: list[list[_Part]] = []  # groups left staged
    for device, js in by_device.items():
      parts: list[_Part] = []
      for j in js:
        bounds = part_bounds(shards[j].nbytes, itemsizes[j], self.piece_bytes,
                             self.chunk_bytes)
        out[j] = Parts(bounds)
        parts.extend((j, k, bounds[k], bounds[k + 1]) for k in range(len(bounds) - 1))
      total = sum(p[3] - p[2] for p in parts)
      room = self._budget(device)
      seen = self._devices[device]
      if room is None or total <= room:
        kept.append(parts)
        seen.held = total
      elif room < 2 * self.piece_bytes:
        direct.extend(js)
      else:
        size = _group_bytes(room, self.piece_bytes)
        groups = _groups(parts, size)
        n = len(groups)
        while n > 0 and sum(_nbytes(g) for g in groups[n - 1:]) <= room:
          n -= 1
        overflow.append(groups[:n])
        kept.extend(groups[n:])
        seen.held = max(2 * size, sum(_nbytes(g) for g in groups[n:]))
    t = time.perf_counter()
    try:
      self._copy_now(shards, out, direct, overflow)
      staged = [(a, p) for group in kept for a, p in zip(self._dispatch(shards, group), group,
                                                          strict=True)]
    except jax.errors.JaxRuntimeError as e:
      if "RESOURCE_EXHAUSTED" not in str(e):
        raise
      if not self._oom_logged:
        self._oom_logged = True
        logger.warning("staging a snapshot in device memory ran out of memory; this and "
                       "later saves whose staging fails copy the state to host before "
                       "save returns (set SnapshotOptions.staging_budget_bytes lower): %s", e)
      every = [j for js in by_device.values() for j in js]
      self._copy_now(shards, out, every, [])
      return _done(out), Report(copied_bytes=sum(shards[j].nbytes for j in every),
                                stall_seconds=time.perf_counter() - t)
    waited = time.perf_counter() - t if direct or overflow else 0.0
    for arr, (j, k, _, _) in staged:
      part = out[j]
      if isinstance(part, Parts):
        part.arrays[k] = arr
    _jax_private.copy_to_host_async([a for a, _ in staged])
    copied = (sum(shards[j].nbytes for j in direct)
              + sum(_nbytes(g) for groups in overflow for g in groups))
    return _done(out), Report(staged_bytes=sum(p[3] - p[2] for _, p in staged),
                              copied_bytes=copied, stall_seconds=waited)

  def _dispatch(self, shards: Sequence[jax.Array], group: Sequence[_Part]) -> list[jax.Array]:
    """The parts of ``group`` (one device's), made in one jitted program."""
    inputs: dict[int, int] = {}
    for j, *_ in group:
      inputs.setdefault(j, len(inputs))
    cuts = tuple((inputs[j], a // _itemsize(shards[j]), b // _itemsize(shards[j]))
                 for j, _, a, b in group)
    return _cutter(cuts)(*[shards[j] for j in inputs])

  def _copy_now(self, shards: Sequence[jax.Array], out: list[Parts | np.ndarray | None],
                direct: Sequence[int], overflow: Sequence[Sequence[Sequence[_Part]]]) -> None:
    """Copies ``direct`` shards whole, and the ``overflow`` groups of each
    device (two rounds in flight: a device holds at most two groups), to
    host memory; returns once every byte has landed."""
    _jax_private.copy_to_host_async([shards[j] for j in direct])
    pending: list[list[tuple[jax.Array, _Part]]] = []
    for r in range(max((len(g) for g in overflow), default=0)):
      round_ = [(a, p) for groups in overflow if r < len(groups)
                for a, p in zip(self._dispatch(shards, groups[r]), groups[r], strict=True)]
      _jax_private.copy_to_host_async([a for a, _ in round_])
      pending.append(round_)
      if len(pending) == 2:
        _land(out, pending.pop(0))
    for round_ in pending:
      _land(out, round_)
    for j in direct:
      out[j] = np.asarray(shards[j])


def _plain(spec: LeafSpec, leaf: Any) -> jax.Array:
  """The leaf as a plain array (key data for keys), where the state holds it."""
  return jax.random.key_data(leaf) if spec.kind is LeafKind.KEY else leaf


@functools.lru_cache(maxsize=4096)
def _on_cpu(sharding: jax.sharding.Sharding) -> bool:
  devices: set[jax.Device] = sharding.device_set
  return all(d.platform == "cpu" for d in devices)


@functools.lru_cache(maxsize=4096)
def _in_device_memory(sharding: jax.sharding.Sharding) -> bool:
  """Whether a leaf lives in device memory (a leaf already in host memory
  is not staged: a program reads device memory)."""
  return sharding.memory_kind in (None, "device")


class Read(enum.Enum):
  """Where a leaf's pieces are read from."""

  VIEW = "view"      # CPU: a zero-copy view of each shard
  STAGE = "stage"    # the shards, staged by the capture (:mod:`..staging`)
  PINNED = "pinned"  # its pinned_host copy


def staged(specs: Sequence[LeafSpec], leaves: Sequence[Any], staging: Staging = Staging.NEVER
           ) -> dict[int, tuple[jax.Array, jax.Array, Read]]:
  """leaf position -> (the array leaf as a plain array, the array its pieces
  are read from, how), for every array leaf. On CPU the leaf itself, read
  by views (``Staging.ALWAYS``: staged). On accelerators, the leaf itself
  to stage, or with ``Staging.NEVER`` a ``pinned_host`` copy, dispatched
  asynchronously, all leaves in one ``device_put`` (JAX batches the
  transfers of a list in C++: one call a leaf costs Python per leaf on the
  training thread, every snapshot)."""
  out: dict[int, tuple[jax.Array, jax.Array, Read]] = {}
  moves: list[int] = []
  for i, (spec, leaf) in enumerate(zip(specs, leaves, strict=True)):
    if spec.kind in (LeafKind.SCALAR, LeafKind.NUMPY):
      continue
    raw = _plain(spec, leaf)
    here = _on_cpu(raw.sharding)
    if _in_device_memory(raw.sharding) and (
        staging is Staging.ALWAYS or (staging is Staging.AUTO and not here)):
      out[i] = (raw, raw, Read.STAGE)
    else:
      out[i] = (raw, raw, Read.VIEW if here else Read.PINNED)
      if not here:
        moves.append(i)
  if moves:
    raws = [out[i][0] for i in moves]
    # (may_alias=False: a leaf already in pinned_host memory is copied, not
    # handed back, so the drain never reads a buffer the next step may donate)
    pinned = jax.device_put(raws, [r.sharding.with_memory_kind("pinned_host") for r in raws],
                            may_alias=False)
    for i, arr in zip(moves, pinned, strict=True):
      out[i] = (out[i][0], arr, Read.PINNED)
  return out


def _land(out: list[Parts | np.ndarray | None], round_: Sequence[tuple[jax.Array, _Part]]
          ) -> None:
  """Waits for each part of ``round_`` and keeps its host copy (the device
  copy goes)."""
  for arr, (j, k, _, _) in round_:
    part = out[j]
    if isinstance(part, Parts):
      part.arrays[k] = np.asarray(arr)


def _done(out: list[Parts | np.ndarray | None]) -> list[Parts | np.ndarray]:
  got: list[Parts | np.ndarray] = []
  for x in out:
    if x is None:
      raise RuntimeError("a staged shard has no bytes")  # (every shard gets a source)
    got.append(x)
  return got


def _itemsize(x: Any) -> int:
  return np.dtype(x.dtype).itemsize


def _nbytes(group: Sequence[_Part]) -> int:
  return sum(b - a for _, _, a, b in group)


def _group_bytes(room: int, piece_bytes: int) -> int:
  """A batch's bytes over the budget ``room``: half of it, rounded down to
  a power of two times ``piece_bytes`` (few distinct batches, so few
  compiled programs, as the free memory moves), at least one piece."""
  size = piece_bytes
  while size * 4 <= room:
    size *= 2
  return size


def _groups(parts: Sequence[_Part], limit: int) -> list[list[_Part]]:
  """Consecutive parts in groups of at most ``limit`` bytes."""
  out: list[list[_Part]] = [[]]
  used = 0
  for p in parts:
    n = p[3] - p[2]
    if out[-1] and used + n > limit:
      out.append([])
      used = 0
    out[-1].append(p)
    used += n
  return out
