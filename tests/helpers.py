"""Shared test helpers (the bitwise checks are shipped: snapstore.testing.checks)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import snapstore
from snapstore._jax_compat import single_device_sharding
from snapstore.testing.checks import assert_bitwise_equal, host_copy

__all__ = ["assert_bitwise_equal", "host_copy", "only_store", "opts", "shardings",
           "slice_abstract", "slice_state"]


def shardings(tree: Any) -> list[Any]:
  return [getattr(x, "sharding", None) for x in jax.tree.leaves(tree)]


def opts(store_dir: Any, *, budget_bytes: int | None = None,
         **kw: Any) -> snapstore.SnapshotOptions:
  """Options whose store is ``Auto(dir=store_dir, budget_bytes=...)`` (host
  files, or pinned host under ``slices=``), unless ``store=`` names one."""
  if "store" in kw:
    if budget_bytes is not None:
      raise TypeError("opts(): with store=, give budget_bytes to the store value")
    return snapstore.SnapshotOptions(**kw)
  return snapstore.SnapshotOptions(
      store=snapstore.Auto(dir=store_dir, budget_bytes=budget_bytes), **kw)


def only_store(mgr: snapstore.SnapshotManager) -> Any:
  """The one store of a single-process manager (host files: ``.root``)."""
  (store,) = mgr._backend.stores.values()  # type: ignore[attr-defined]
  return store


def slice_state(devices: list[jax.Device], step: int = 0) -> dict[str, jax.Array]:
  """A leaf sharded across the slices (no DP twin), a DP-replicated leaf, a
  SingleDeviceSharding leaf and a typed PRNG key."""
  n = len(devices) // 4
  mesh = jax.sharding.Mesh(np.array(devices).reshape(n, 4), ("replica", "model"))
  tp = jnp.arange(8 * 16, dtype=jnp.float32).reshape(8, 16) + step
  dp = jnp.ones((4, 8), jnp.bfloat16) * step
  return {
      "tp": jax.device_put(tp, NamedSharding(mesh, P("replica", "model"))),
      "dp": jax.device_put(dp, NamedSharding(mesh, P(None, "model"))),
      "single": jax.device_put(jnp.full((3,), step, jnp.int32),
                               single_device_sharding(devices[0])),
      "rng": jax.device_put(jax.random.key(step), NamedSharding(mesh, P())),
  }


def slice_abstract(devices: list[jax.Device]) -> Any:
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                      slice_state(devices))
