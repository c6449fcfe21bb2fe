"""A restore from host copies onto an accelerator puts each group of leaves
on its devices while the pool still reads and verifies the next group (one
process, host files, 8 CPU devices told they copy on a put, as a TPU does;
on CPU devices, which adopt the host pieces, the restore reads all, then
places)."""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import snapstore
from snapstore import _assemble
from snapstore._multihost import peers
from tests.helpers import assert_bitwise_equal, host_copy, opts


def state(seed: int) -> dict:
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("d",))
  return {f"w{i}": jax.device_put(jnp.arange(64 * 1024, dtype=jnp.float32) * (i + 1) + seed,
                                  NamedSharding(mesh, P("d"))) for i in range(8)}


def abstract() -> dict:
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                      state(0))


@pytest.mark.parametrize("copy_threads", [1, 2])
def test_the_first_leaf_is_placed_before_the_last_is_read(store_dir, monkeypatch, copy_threads):
  """Each leaf its own group: reading the last leaf's pieces waits until the
  first leaf is placed. Read all, then place all (the old order) would never
  place it: the wait's guard runs out and the test fails."""
  monkeypatch.setattr(_assemble, "GROUP_BYTES", 1)
  monkeypatch.setattr(peers, "_puts_copy", lambda targets: True)  # (as on an accelerator)
  placed_first = threading.Event()
  seen: list[bool] = []
  real_fetch, real_leaf = _assemble.Assembler._fetch_item, _assemble.Assembler.leaf
  last = len(state(0)) - 1  # (leaf numbers follow the sorted paths w0..w7)

  def fetch_item(self, item, out):
    leaves = {item[0]} if not isinstance(item, list) else {k[0] for k, _ in item}
    if last in leaves:
      seen.append(placed_first.wait(timeout=60))
    return real_fetch(self, item, out)

  def leaf(self, leaf, target_spec, target):
    got = real_leaf(self, leaf, target_spec, target)
    if leaf == 0:
      placed_first.set()
    return got
  with snapstore.SnapshotManager(opts(store_dir, copy_threads=copy_threads)) as mgr:
    mgr.save(3, state(3))
    mgr.wait_until_finished()
    monkeypatch.setattr(_assemble.Assembler, "_fetch_item", fetch_item)
    monkeypatch.setattr(_assemble.Assembler, "leaf", leaf)
    got = mgr.restore(abstract())
  assert seen and all(seen)
  assert got.step == 3
  assert_bitwise_equal(host_copy(state(3)), got.state)
  assert {"read_verify", "read_place"} <= set(got.timings)


def test_only_targets_on_accelerators_overlap():
  """CPU devices adopt the host pieces on a put: there the restore reads
  all, then places (faster for many small leaves); so do host targets."""
  targets = list(abstract().values())
  assert not peers._puts_copy(targets)
  assert not peers._puts_copy([np.zeros(4), 3, jax.ShapeDtypeStruct((4,), jnp.float32)])
