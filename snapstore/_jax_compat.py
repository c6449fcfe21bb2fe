"""Public JAX names that moved between the supported releases (jax 0.10-0.12).

- ``jax.sharding.SingleDeviceSharding`` is deprecated in jax 0.12.1 in favour
  of ``make_single_device_sharding`` and ``is_single_device_sharding``
  (the latter new in 0.12.1); older releases have only the class.
- jaxlib 0.12.1 hangs a multi-process CPU job (gloo) whose processes run
  one collective program under different run ids; with the persistent
  compilation cache on, process 0 loads a program from it while the others
  compile it (JAX keys the cache by each process's own topology and writes
  it from process 0 only), and the loaded executable's fingerprint, so its
  run id, differs: every restarted job hangs in its first step
  (``docs/limits.md``; the reproduction: ``python -m
  benchmarks.cpu_cache_probe``).
  :func:`cpu_cache_hangs` says whether this jaxlib is one of those.
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (jax is imported where it is used: the supervisor asks
  import jax  # cpu_cache_hangs() without starting JAX)

logger = logging.getLogger(__name__)
CACHE_ENV = "JAX_COMPILATION_CACHE_DIR"

# jaxlib releases whose cached multi-process CPU executables hang (first seen
# in 0.12.1; 0.12.0.1 is fine). No fixed release is known yet: every release
# from here on counts until one is measured fixed with benchmarks.cpu_cache_probe.
CPU_CACHE_HANG_SINCE = (0, 12, 1)


def single_device_sharding(device: jax.Device, *,
                           memory_kind: str | None = None) -> jax.sharding.Sharding:
  """A sharding that puts a whole array on ``device``."""
  import jax
  make = getattr(jax.sharding, "make_single_device_sharding", None)
  if make is not None:
    return make(device, memory_kind=memory_kind)
  return jax.sharding.SingleDeviceSharding(device, memory_kind=memory_kind)


def is_single_device_sharding(sharding: object) -> bool:
  """Whether ``sharding`` puts a whole array on one device by construction."""
  import jax
  check = getattr(jax.sharding, "is_single_device_sharding", None)
  if check is not None:
    return bool(check(sharding))
  return isinstance(sharding, jax.sharding.SingleDeviceSharding)


@functools.cache
def jaxlib_version() -> tuple[int, ...]:
  """The installed jaxlib's release as numbers (``0.12.0.1`` -> ``(0, 12, 0, 1)``),
  read from its package metadata (JAX is not imported)."""
  parts = []
  for p in importlib.metadata.version("jaxlib").split("."):
    digits = "".join(c for c in p if c.isdigit())
    if not digits:
      break
    parts.append(int(digits))
  return tuple(parts)


def cpu_cache_hangs() -> bool:
  """Whether a multi-process CPU job on this jaxlib hangs when one process
  loads a program from the persistent compilation cache and the others
  compile it (module doc): then such a job must not use the cache."""
  return jaxlib_version()[:3] >= CPU_CACHE_HANG_SINCE


def without_cpu_cache(env: dict[str, str]) -> dict[str, str]:
  """``env`` for a process of a multi-process CPU job: without
  ``$JAX_COMPILATION_CACHE_DIR`` where this jaxlib hangs on cached programs
  (:func:`cpu_cache_hangs`; it logs a warning that says so), else as given."""
  if CACHE_ENV not in env or not cpu_cache_hangs():
    return env
  _warn_once(env[CACHE_ENV])
  return {k: v for k, v in env.items() if k != CACHE_ENV}


@functools.cache
def _warn_once(where: str) -> None:
  logger.warning(
      "jaxlib %s: the persistent compilation cache (%s=%s) is left out of this multi-process "
      "CPU job: a program loaded from it by one process and compiled by the others hangs in "
      "its first collective on this jaxlib (docs/limits.md). Restarted processes compile "
      "their programs again.",
      ".".join(map(str, jaxlib_version())), CACHE_ENV, where)


@functools.cache
def check_cpu_cache() -> None:
  """Logs a warning where this process is one of a multi-process CPU job
  with the persistent compilation cache on, on a jaxlib whose cached
  programs hang (:func:`cpu_cache_hangs`); once a process. Changes nothing."""
  import jax
  if not cpu_cache_hangs() or jax.process_count() < 2 or jax.default_backend() != "cpu":
    return
  where = jax.config.jax_compilation_cache_dir or os.environ.get(CACHE_ENV)
  if where:
    logger.warning(
        "jaxlib %s with the persistent compilation cache (%s) in a multi-process CPU job: a "
        "program loaded from the cache can hang in its first collective after a restart "
        "(docs/limits.md). Turn the cache off (jax_compilation_cache_dir unset) or use "
        "jaxlib < %s.", ".".join(map(str, jaxlib_version())), where,
        ".".join(map(str, CPU_CACHE_HANG_SINCE)))


def host_array_to_device(x: jax.Array, device: jax.Device) -> jax.Array:
  """A single-device array in a host memory kind (``pinned_host``), put
  into ``device``'s memory. On CPU devices through numpy (the same RAM):
  jaxlib 0.12.1's CPU client refuses a ``device_put`` of a ``pinned_host``
  array that a put between two devices' pinned memories made ("Unsupported
  layout used for PjRt CPU buffers: {1,0:S(5)}"); elsewhere a plain
  ``device_put``."""
  import jax
  import numpy as np
  if device.platform == "cpu":
    return jax.device_put(np.asarray(x), single_device_sharding(device))
  return jax.device_put(x, single_device_sharding(device))
