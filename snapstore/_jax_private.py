"""Every use of JAX's private API, in one place, behind one version check.

snapstore reaches past JAX's public API for five things, each where no
public call does the same:

- the distributed runtime (``jax._src.distributed.global_state``, and
  ``jax._src.lib._jax`` to make a recoverable client and to host the
  coordination service): in-place recovery (:mod:`snapstore.recovery`) and
  its barriers (:mod:`snapstore.recovery.orbax_barrier`) talk to the coordination service
  directly;
- the compilation cache's key (``jax._src.cache_key``): one compiled
  program serves every device order of a mesh on CPU (:mod:`snapstore.recovery.cache_keys`);
- JAX's batched put (``jax._src.interpreters.pxla.batched_device_put``):
  a restore places each leaf's host buffers in one call (:mod:`._assemble`);
- ``jax.Array._arrays``: a leaf's single-device arrays in one attribute
  read, on a save's hot path (:mod:`snapstore._tree`);
- JAX's batched ``copy_to_host_async`` (``jax._src.lib._jax``): a staged
  capture starts the copies of hundreds of pieces in one call
  (:mod:`snapstore._backends.staging`).

Each function degrades to None (or raises ``ImportError`` where there is no
other way) where this JAX lacks what it reaches for; :func:`unsupported`
says whether this JAX is one the private uses were tested with.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

TESTED_JAX = ((0, 10), (0, 12))  # the jax versions whose private APIs this uses


def version_tested() -> str | None:
  """None if this JAX is one the private uses were tested with, else why not."""
  version = tuple(int(p) for p in jax.__version__.split(".")[:2])
  if not TESTED_JAX[0] <= version <= TESTED_JAX[1]:
    return (f"jax {jax.__version__} is outside the versions in-place recovery was "
            f"tested with ({TESTED_JAX[0]} to {TESTED_JAX[1]})")
  return None


def distributed_state() -> Any:
  """JAX's distributed runtime state (``client``, ``coordinator_address``,
  ``process_id``, ``num_processes``). Raises ``ImportError`` where absent."""
  from jax._src import distributed
  return distributed.global_state


def client() -> Any | None:
  """The coordination service client of this process, or None."""
  try:
    return distributed_state().client
  except ImportError:
    return None


def runtime() -> Any:
  """JAX's runtime extension (``get_distributed_runtime_client``,
  ``get_distributed_runtime_service``). Raises ``ImportError`` where absent."""
  from jax._src.lib import _jax
  return _jax


def cache_key_module() -> Any | None:
  """``jax._src.cache_key``, or None."""
  try:
    from jax._src import cache_key
  except ImportError:
    return None
  return cache_key


def batched_put(shape: Sequence[int], dtype: Any, sharding: Any, bufs: Sequence[Any],
                devices: Sequence[jax.Device]) -> jax.Array | None:
  """The array whose shard on each of ``devices`` is the buffer beside it,
  in JAX's one batched call; None where this JAX has no such call."""
  try:
    from jax._src import core
    from jax._src.interpreters.pxla import batched_device_put
  except ImportError:
    return None
  aval = core.ShapedArray(tuple(shape), dtype)
  with_sharding = getattr(core, "update_aval_with_sharding", None)
  if with_sharding is not None:
    aval = with_sharding(aval, sharding)
  return batched_device_put(aval, sharding, list(bufs), list(devices))


def single_device_arrays(arr: jax.Array) -> list[jax.Array] | None:
  """JAX's own list of ``arr``'s single-device arrays (one per addressable
  position), or None where this JAX keeps none."""
  shards = getattr(arr, "_arrays", None)
  return shards if type(shards) is list else None


def copy_to_host_async(arrays: Sequence[jax.Array]) -> None:
  """Starts every array's copy to host memory (``jax.Array.copy_to_host_async``),
  in JAX's one batched call where this JAX's method makes that call itself
  (with a list of one; the same version gate), else one call an array."""
  if not arrays:
    return
  try:
    from jax._src.lib import _jax, ifrt_version, jaxlib_extension_version
    batched = (getattr(_jax, "batched_copy_to_host_async", None)
               if jaxlib_extension_version >= 495 and ifrt_version >= 71 else None)
  except ImportError:
    batched = None
  if batched is not None:
    todo = [a for a in arrays if getattr(a, "_npy_value", None) is None]  # as the method
    if todo:
      batched(todo)
    return
  for a in arrays:
    a.copy_to_host_async()
