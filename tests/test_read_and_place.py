"""A restore from host copies onto an accelerator puts each group of leaves
on its devices while the pool still reads and verifies the next group (one
process, host files, 8 CPU devices told they copy on a put, as a TPU does;
on CPU devices, which adopt the host pieces, the restore reads all, then
places)."""

from __future__ import annotations

import gc
import threading
import weakref

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


def test_a_failed_attempt_frees_the_leaves_it_placed_before_the_next_one(store_dir,
                                                                          monkeypatch):
  """The last leaf of step 2 is corrupt: its attempt has placed every other
  leaf when it finds out. Those leaves must be gone by reference counting
  alone (the collector off) when the attempt at step 1 starts: on an
  accelerator they hold device memory the next attempt needs."""
  monkeypatch.setattr(_assemble, "GROUP_BYTES", 1)
  monkeypatch.setattr(peers, "_puts_copy", lambda targets: True)
  placed: dict[int, list[weakref.ref]] = {}  # step -> its attempt's placed leaves
  alive: list[tuple[int, int]] = []  # (step tried, earlier attempts' leaves alive then)
  real_assemble, real_leaf = peers.Solo.assemble, _assemble.Assembler.leaf

  def assemble(self, assembler, specs, targets):
    alive.append((assembler.plan.step,
                  sum(r() is not None for refs in placed.values() for r in refs)))
    return real_assemble(self, assembler, specs, targets)

  def leaf(self, leaf, target_spec, target):
    got = real_leaf(self, leaf, target_spec, target)
    placed.setdefault(self.plan.step, []).append(weakref.ref(got))
    return got
  with snapstore.SnapshotManager(opts(store_dir, keep=2)) as mgr:
    for step in (1, 2):
      mgr.save(step, state(step))
    mgr.wait_until_finished()
    (store,) = mgr._backend.stores.values()
    (m,) = [m for m in store.manifests() if m.step == 2]
    last = max(r for r in m.pieces if m.leaves[r.leaf].path.endswith("w7"))
    with open(store.root / f"slot-{m.slot}.bin", "r+b") as f:
      f.seek(last.offset + 5)
      b = f.read(1)
      f.seek(last.offset + 5)
      f.write(bytes([b[0] ^ 0x10]))
    monkeypatch.setattr(peers.Solo, "assemble", assemble)
    monkeypatch.setattr(_assemble.Assembler, "leaf", leaf)
    gc.collect()
    gc.disable()
    try:
      got = mgr.restore(abstract())
    finally:
      gc.enable()
  assert got.step == 1
  assert_bitwise_equal(host_copy(state(1)), got.state)
  assert len(placed[2]) == 7, placed  # w0..w6 placed before w7 failed
  assert alive == [(2, 0), (1, 0)], alive  # none of them left when step 1 is tried


def test_several_hosts_put_early_only_leaves_in_device_memory(store_dir, monkeypatch):
  """A leaf whose target lives in another memory kind is built after the
  hosts' collectives: moving it there may run a program over every process
  (all must run it in the same order). The plan and pieces are a real
  restore's; ``_all_here`` is asked as host 0 of several would ask."""
  seen: list[tuple] = []
  real = peers.Solo.assemble

  def assemble(self, assembler, specs, targets):
    seen.append((assembler, specs))
    return real(self, assembler, specs, targets)
  monkeypatch.setattr(peers.Solo, "assemble", assemble)
  with snapstore.SnapshotManager(opts(store_dir)) as mgr:
    mgr.save(1, state(1))
    mgr.wait_until_finished()
    mgr.restore(abstract())
  ((assembler, specs),) = seen
  targets = list(abstract().values())
  on_device = peers._all_here(assembler, assembler.plan, specs, targets, 0)
  assert on_device == [True] * len(targets)
  pinned = targets[3].sharding.with_memory_kind("pinned_host")
  targets[3] = jax.ShapeDtypeStruct(targets[3].shape, targets[3].dtype, sharding=pinned)
  assert peers._all_here(assembler, assembler.plan, specs, targets, 0) == [
      i != 3 for i in range(len(targets))]


def test_small_leaves_are_read_in_runs_across_leaves(store_dir, monkeypatch):
  """200 leaves of 1 KiB in one slot: a group's small pieces are read back to
  back in a few runs, as the prefetch reads them, not one read a leaf."""
  monkeypatch.setattr(peers, "_puts_copy", lambda targets: True)
  small = {f"b{i:03d}": jnp.full((256,), i, jnp.float32) for i in range(200)}
  reads: list[int] = []  # pieces a fetch got
  real = _assemble.Assembler._fetch_item

  def fetch_item(self, item, out):
    reads.append(len(item) if isinstance(item, list) else 1)
    return real(self, item, out)
  with snapstore.SnapshotManager(opts(store_dir)) as mgr:
    mgr.save(1, small)
    mgr.wait_until_finished()
    monkeypatch.setattr(_assemble.Assembler, "_fetch_item", fetch_item)
    got = mgr.restore(jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), small))
  assert_bitwise_equal(host_copy(small), got.state)
  assert sum(reads) == 200 and len(reads) <= 8, reads
