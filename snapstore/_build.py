"""One restored leaf in the target's layout: its shards cut region by region
from the stored pieces and put on their devices in one batched call
(:func:`build_leaf`), or built at once by a backend's fast path."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from . import _jax_private
from ._index import Index, full, normalize
from ._tree import LeafKind, LeafSpec, target_sharding, wants_numpy

Stored = np.ndarray | jax.Array
# (region of a leaf, device it is for, or None for host) ->
# (array of that region, whether it is a fresh buffer the caller may keep)
Region = Callable[[Index, jax.Device | None], tuple[Stored, bool]]


FastPath = Callable[[jax.sharding.Sharding, Sequence[tuple[jax.Device, Index]]],
                    jax.Array | None]


def build_leaf(spec: LeafSpec, target_spec: LeafSpec, target: Any, region: Region, *,
               fast: FastPath | None = None) -> Any:
  """One restored leaf in the target's layout, cut region by region (or built
  at once by ``fast`` where it can)."""
  whole = full(spec.shape)
  if wants_numpy(spec, target_spec, target):
    data, fresh = region(whole, None)
    out = np.asarray(data) if fresh else np.array(data, copy=True)
    return out[()] if isinstance(target, np.generic) else out
  sharding = target_sharding(target)
  on_device = (sharding.with_memory_kind("device")
               if sharding.memory_kind not in (None, "device") else sharding)
  wanted = wanted_shards(on_device, tuple(spec.shape))
  arr: jax.Array | None = fast(on_device, wanted) if fast is not None else None
  if arr is None:
    host: dict[Index, np.ndarray] = {}  # one host region per distinct index
    bufs: list[Any] = []
    puts: list[int] = []  # positions in bufs of host regions still to put
    for device, nidx in wanted:
      got: Stored | None = host.get(nidx)
      if got is None:
        got, _ = region(nidx, device)
        if not isinstance(got, jax.Array):
          host[nidx] = got
      if not isinstance(got, jax.Array):
        puts.append(len(bufs))
      elif device not in got.devices():
        got = jax.device_put(got, device)
      bufs.append(got)
    if len(puts) == len(bufs):  # all on the host: one call places every shard
      # (JAX batches the transfers in C++, where a put a shard is a Python
      # call each); ``bufs`` are private to this restore (verified copies, or cut anew),
      # so the device arrays may adopt them
      arr = place_host(spec, on_device, wanted, [host[idx] for _, idx in wanted])
    else:
      if puts:  # one batched put, adopting the host regions as above
        placed = jax.device_put([bufs[i] for i in puts], [wanted[i][0] for i in puts],
                                may_alias=True)
        for i, a in zip(puts, placed, strict=True):
          bufs[i] = a
      arr = jax.make_array_from_single_device_arrays(spec.shape, on_device, bufs)
  if on_device is not sharding:
    arr = jax.device_put(arr, sharding)
  if spec.kind is LeafKind.KEY:
    arr = jax.random.wrap_key_data(arr, impl=spec.key_impl)
  return arr


@functools.lru_cache(maxsize=4096)
def wanted_shards(sharding: jax.sharding.Sharding, shape: tuple[int, ...]
            ) -> tuple[tuple[jax.Device, Index], ...]:
  """(device, index) of each addressable shard of ``sharding`` (the same for
  every restore of a leaf: computed once)."""
  return tuple((device, normalize(idx, shape))
               for device, idx in sharding.addressable_devices_indices_map(shape).items())


def place_host(spec: LeafSpec, sharding: jax.sharding.Sharding,
                wanted: Sequence[tuple[jax.Device, Index]], bufs: Sequence[np.ndarray]
                ) -> jax.Array:
  """The array whose shard on each device of ``wanted`` is (adopts, on CPU)
  the host buffer beside it: JAX's own batched put, which
  ``make_array_from_callback`` ends in, without its per-shard Python, where
  this JAX has it; else ``make_array_from_callback``."""
  placed = _jax_private.batched_put(spec.shape, bufs[0].dtype if bufs else spec.np_dtype,
                                    sharding, bufs, [d for d, _ in wanted])
  if placed is not None:
    return placed
  by_index = {idx: buf for (_, idx), buf in zip(wanted, bufs, strict=True)}
  return jax.make_array_from_callback(
      spec.shape, sharding, lambda idx: by_index[normalize(idx, spec.shape)])
