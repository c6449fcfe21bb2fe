"""The pinned-host store (single controller): where the bytes live, how many
snapshots stay, and that its on-device checksum catches corrupted host RAM.

8 CPU devices as 2 slices of 4. CPU devices have a real ``pinned_host``
memory space, so the arrays here are the same kind of object a TPU host
holds; corruption is a real bit flip in the pinned buffer (through its
address), not a replaced array.
"""

import ctypes

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from snapstore import (
  Auto,
  BudgetExceededError,
  HostFiles,
  PinnedChecksum,
  PinnedHost,
  PinnedMemory,
  Replicas,
  SnapshotManager,
  SnapshotOptions,
  Source,
  TreeMismatchError,
)
from snapstore._backends.pinned.slices import HostParts
from snapstore._checksum import (
  ChecksumKind,
  _sums,
  as_checksum,
  device_checksum,
  shard_checksums,
)
from snapstore._index import align
from tests.helpers import (
  assert_bitwise_equal,
  host_copy,
  slice_abstract as abstract,
  slice_state as make_state,
)


@pytest.fixture
def s2d():
  devs = jax.devices()
  return {0: devs[:4], 1: devs[4:]}


def manager(s2d, *, budget_bytes=None, checksum="auto", **kw):
  """A manager on the pinned-host store of ``s2d`` (``store=``: another)."""
  kw.setdefault("run_id", "pinned")
  kw.setdefault("store", PinnedHost(checksum=PinnedChecksum(checksum),
                                    budget_bytes=budget_bytes))
  return SnapshotManager(SnapshotOptions(**kw), slices=s2d)


def stored(mgr, domain, step):
  """(piece record, stored array) of one domain's snapshot of ``step``."""
  store = mgr._backend.stores[domain]
  (m,) = [m for m in store.manifests() if m.step == step]
  return [(p, store.array(m.slot, p.offset)) for p in m.pieces]


def flip_bit(arr, byte=5, bit=4):
  """A bit flip in the pinned host buffer itself, as failing RAM would do
  (a staged copy's: in its first part)."""
  if isinstance(arr, HostParts):
    arr = arr.parts[0]
  arr.block_until_ready()
  ctypes.c_uint8.from_address(arr.unsafe_buffer_pointer() + byte).value ^= 1 << bit


# ----------------------------------------------------------------- checksum
@pytest.mark.parametrize("dtype", [np.float32, np.int8, np.uint16, ml_dtypes.bfloat16,
                                   np.int32])
def test_every_single_bit_flip_changes_both_device_sums(dtype):
  a = (np.arange(24) % 5).astype(dtype)
  base = as_checksum(device_checksum(jnp.asarray(a)))
  raw = a.view(np.uint8)
  n = raw.size * 8
  flipped = np.repeat(raw[None], n, axis=0)  # row r: bit r % 8 of byte r // 8 flipped
  flipped[np.arange(n), np.arange(n) // 8] ^= (1 << (np.arange(n) % 8)).astype(np.uint8)
  sums = np.asarray(jax.vmap(_sums)(jnp.asarray(flipped.view(dtype))))
  assert (sums[:, 0] != base[0]).all() and (sums[:, 1] != base[1]).all()
  swapped = a.copy()
  swapped[[0, 1]] = a[[1, 0]]  # 0 and 1: position is part of the sum
  assert as_checksum(device_checksum(jnp.asarray(swapped))) != base


def test_bool_leaves_have_a_device_sum():
  a = np.zeros(10, bool)
  b = a.copy()
  b[3] = True
  assert as_checksum(device_checksum(jnp.asarray(a))) != \
      as_checksum(device_checksum(jnp.asarray(b)))


def test_per_shard_checksums_match_each_shard(s2d):
  state = make_state(jax.devices(), 3)
  for leaf in (state["tp"], state["dp"]):
    out, rows = shard_checksums(leaf)
    for shard in leaf.addressable_shards:
      assert as_checksum(out[rows[shard.device]]) == as_checksum(device_checksum(shard.data))


# ----------------------------------------------------------------- placement
def test_auto_picks_pinned_host_for_slices_and_host_files_otherwise(s2d, store_dir):
  with manager(s2d, store=Auto(dir=store_dir)) as mgr:
    assert mgr.store == PinnedHost()
    # CPU: the controller reads pinned buffers in place
    assert mgr._backend.checksum is ChecksumKind.CRC32C
  with SnapshotManager(SnapshotOptions(store=Auto(dir=store_dir))) as mgr:
    assert mgr.store == HostFiles(dir=store_dir)
  with pytest.raises(ValueError, match="single controller"):
    SnapshotManager(SnapshotOptions(store=PinnedHost()))


def test_each_slice_holds_its_pieces_in_its_own_pinned_memory(s2d):
  state = make_state(jax.devices(), 1)
  with manager(s2d) as mgr:
    mgr.save(1, state)
    mgr.wait_until_finished()
    names = {i: s.path for i, s in enumerate(mgr._backend.stores[0].manifests()[0].leaves)}
    for d, devs in s2d.items():
      by_leaf: dict[str, list] = {}
      for rec, arr in stored(mgr, d, 1):
        by_leaf.setdefault(names[rec.leaf], []).append(rec)
        assert arr.sharding.memory_kind == "pinned_host"
        assert next(iter(arr.devices())) in devs  # on this slice's hosts
      # 'tp' is split across the slices (no DP twin): each slice keeps its 4
      # own pieces plus a copy of the other slice's 4.
      assert len(by_leaf["tp"]) == 8
      assert {r.owner for r in by_leaf["tp"]} == {0, 1}
      # 'dp' is replicated across the slices: its own 4 pieces, no extra copy
      # (the owner of a replicated piece is the lowest slice holding it).
      assert len(by_leaf["dp"]) == 4
      assert {r.owner for r in by_leaf["dp"]} == {0}


def test_keeps_the_newest_snapshots_and_frees_the_rest(s2d):
  with manager(s2d, keep=2) as mgr:
    held = {}
    for step in range(1, 6):
      mgr.save(step, make_state(jax.devices(), step))
      mgr.wait_until_finished()
      held[step] = [a for d in s2d for _, a in stored(mgr, d, step)]
    assert mgr.snapshot_steps() == [3, 4, 5]  # the newest 2 and the watermark (3)
    assert all(a.is_deleted() for s in (1, 2) for a in held[s])
    assert not any(a.is_deleted() for s in (3, 4, 5) for a in held[s])


def test_on_cpu_each_slot_reuses_its_memory_and_a_lost_slice_frees_it(s2d, monkeypatch):
  """The pinned arrays of a slot adopt host memory that the slot's next
  snapshot reuses once they are freed (no fresh pages every save); the
  memory goes with the slice."""
  from snapstore import _arena
  made = []
  fresh = _arena._mapping
  monkeypatch.setattr(_arena, "_mapping", lambda n: made.append(n) or fresh(n))
  # (no restore memory made ahead: only the slots' mappings are counted)
  with manager(s2d, keep=1, prefault_restore=False) as mgr:
    for step in range(1, 6):
      mgr.save(step, make_state(jax.devices(), step))
      mgr.wait_until_finished()
      if step == 2:
        assert len(made) == 4  # two slots in each of two slices
    assert len(made) == 4, made
    r = mgr.restore(abstract(jax.devices()))
    assert_bitwise_equal(host_copy(make_state(jax.devices(), 5)), r.state)
    mgr.forget_domains([1], "slice lost")
    assert mgr._backend.stores[1]._memory == {}


def test_budget_too_small_raises_before_taking_memory_and_caps_snapshots(s2d):
  state = make_state(jax.devices(), 1)
  with manager(s2d, budget_bytes=64) as mgr:
    with pytest.raises(BudgetExceededError, match="pinned host memory on slice"):
      mgr.save(1, state)
    assert mgr.snapshot_steps() == []
  with manager(s2d) as probe:
    probe.save(1, state)
    probe.wait_until_finished()
    # (in this process's memory, the default here, each piece takes whole pages)
    size = max(sum(align(r.nbytes) for r in m.pieces)
               for st in probe._backend.stores.values() for m in st.manifests())
  with manager(s2d, keep=5, budget_bytes=2 * size) as mgr:
    for step in range(1, 6):
      mgr.save(step, make_state(jax.devices(), step))
    mgr.wait_until_finished()
    assert all(len(st.manifests()) <= 2 for st in mgr._backend.stores.values())
    assert mgr.snapshot_steps()[-1] == 5


def test_the_budget_counts_the_pages_this_process_holds_for_tiny_pieces(s2d):
  """In this process's memory each piece starts on a page of its slot: 64
  leaves of 16 bytes hold 64 pages a snapshot, and a budget for two of 1 KiB
  (what the bytes alone sum to) is refused, not overrun 256 times."""
  tiny = {f"b{i:02d}": jnp.full((4,), i, jnp.float32) for i in range(64)}
  store = PinnedHost(checksum=PinnedChecksum.HOST, memory=PinnedMemory.PROCESS,
                     budget_bytes=10 * 64 * 16)
  with manager(s2d, store=store, keep=1) as mgr:
    with pytest.raises(BudgetExceededError, match=r"takes 262144 bytes"):
      mgr.save(1, tiny)
    assert mgr.snapshot_steps() == []
  store = PinnedHost(checksum=PinnedChecksum.HOST, memory=PinnedMemory.PROCESS,
                     budget_bytes=2 * 64 * 4096)
  with manager(s2d, store=store, keep=1) as mgr:
    for step in (1, 2, 3):
      mgr.save(step, tiny)
    mgr.wait_until_finished()
    assert mgr.snapshot_steps()[-1] == 3
    assert_bitwise_equal(host_copy(tiny), mgr.restore(tiny).state)


# ----------------------------------------------------------------- restore
@pytest.mark.parametrize("checksum", ["host", "device"])
def test_restore_is_bitwise_and_survives_donation_and_eviction(s2d, checksum):
  state = make_state(jax.devices(), 2)
  expected = host_copy(state)
  with manager(s2d, keep=1, checksum=checksum) as mgr:
    mgr.save(2, state)
    step = jax.jit(lambda x: x * 0 - 1, donate_argnums=0)  # overwrites its input
    tp, dp = step(state.pop("tp")), step(state.pop("dp"))
    jax.block_until_ready((tp, dp))
    assert {p.kind for p, _ in stored(mgr, 0, 2)} == {
        ChecksumKind.CRC32C if checksum == "host" else ChecksumKind.DEVICE_SUM}
    r = mgr.restore(abstract(jax.devices()))
    assert (r.step, r.source) == (2, Source.SNAPSHOT)
    assert_bitwise_equal(expected, r.state)
    for step in (3, 4):  # evicts (and deletes) the arrays step 2 was restored from
      mgr.save(step, make_state(jax.devices(), step))
    mgr.wait_until_finished()
    assert_bitwise_equal(expected, r.state)  # the restored state owns its buffers
    with pytest.raises(TreeMismatchError, match="tp"):
      bad = abstract(jax.devices())
      bad["tp"] = jax.ShapeDtypeStruct((4, 4), jnp.float32, sharding=bad["tp"].sharding)
      mgr.restore(bad)


def test_restore_onto_one_slice_and_to_numpy(s2d):
  with manager(s2d) as mgr:
    state = make_state(jax.devices(), 4)
    mgr.save(4, state)
    r = mgr.restore(abstract(s2d[0]))  # replica-resize: 4 devices, bigger tp blocks
    assert_bitwise_equal(host_copy(state), r.state)
    assert r.state["tp"].sharding.device_set == set(s2d[0])
    as_numpy = {k: np.zeros(v.shape, v.dtype) for k, v in host_copy(state).items()}
    as_numpy["rng"] = abstract(jax.devices())["rng"]  # a key stays a key
    r = mgr.restore(as_numpy)
    assert isinstance(r.state["tp"], np.ndarray)
    assert_bitwise_equal(host_copy(state), r.state)


@pytest.mark.parametrize("checksum", ["host", "device"])
@pytest.mark.parametrize("leaf", ["tp", "dp"])
def test_a_flipped_bit_in_pinned_memory_is_caught_and_another_copy_used(s2d, checksum, leaf):
  """'tp': slice 1 keeps a copy of slice 0's piece; 'dp': slice 1's own
  data-parallel twin (on CPU written from the cache as slice 0's copy
  passes, with its checksum): either copy flipped, the other is used."""
  with manager(s2d, keep=2, checksum=checksum) as mgr:
    for step in (1, 2):
      mgr.save(step, make_state(jax.devices(), step))
    mgr.wait_until_finished()
    names = {i: s.path for i, s in enumerate(mgr._backend.stores[0].manifests()[0].leaves)}
    # One copy of a piece that slice 1 also holds: the other copy is used.
    rec, arr = next((r, a) for r, a in stored(mgr, 0, 2) if names[r.leaf] == leaf)
    flip_bit(arr)
    r = mgr.restore(abstract(jax.devices()))
    assert r.step == 2
    assert any(f"checksum mismatch in leaf '{leaf}' held by slice 0" in n
               for n in r.notes), r.notes
    assert_bitwise_equal(host_copy(make_state(jax.devices(), 2)), r.state)
    # Both copies of that piece bad: step 2 cannot be rebuilt, step 1 is.
    (_, twin), = [(q, a) for q, a in stored(mgr, 1, 2)
                  if (q.leaf, q.index) == (rec.leaf, rec.index)]
    flip_bit(twin, byte=0, bit=0)
    r = mgr.restore(abstract(jax.devices()))
    assert r.step == 1 and r.rewind_steps == 1
    assert_bitwise_equal(host_copy(make_state(jax.devices(), 1)), r.state)


def test_each_slice_keeps_its_own_copy_of_a_numpy_leaf(s2d):
  """A numpy leaf is kept by every slice; one bad byte in one slice's copy
  leaves the others good (they were one shared array: found by a red-team
  helper)."""
  with manager(s2d) as mgr:
    state = make_state(jax.devices(), 3)
    state["np"] = np.arange(64, dtype=np.int32)
    mgr.save(3, state)
    mgr.wait_until_finished()
    names = {i: s.path for i, s in enumerate(mgr._backend.stores[0].manifests()[0].leaves)}
    (held,) = [a for r, a in stored(mgr, 0, 3) if names[r.leaf] == "np"]
    held[5] ^= 1  # the store's own copy, as failing RAM would change it
    r = mgr.restore({**abstract(jax.devices()), "np": np.zeros(64, np.int32)})
    assert r.step == 3
    assert any("'np'" in n and "slice 0" in n for n in r.notes), r.notes
    assert (r.state["np"] == np.arange(64, dtype=np.int32)).all()


def test_unreadable_arrays_of_a_lost_slice_are_skipped(s2d):
  """Nobody told the manager (no forget_domains): slice 0's pinned buffers are
  gone, reading them raises, and the copies on slice 1 are used instead.
  (pathwaysutils' DeviceLossSimulator cannot stand in here: it knows arrays by
  id(), and the restore's short-lived arrays reuse ids it marked lost.)"""
  with manager(s2d) as mgr:
    state = make_state(jax.devices(), 6)
    expected = host_copy(state)
    mgr.save(6, state)
    mgr.wait_until_finished()
    for _, a in stored(mgr, 0, 6):
      if isinstance(a, jax.Array):
        a.delete()
    r = mgr.restore(abstract(s2d[1]))
    assert r.step == 6 and r.source is Source.SNAPSHOT
    assert any("unreadable" in n and "slice 0" in n for n in r.notes), r.notes
    assert_bitwise_equal(expected, r.state)


@pytest.mark.parametrize("replicas", [1, 2])
def test_four_slices_two_lost_together(replicas, tmp_path):
  """4 slices of 2 devices, a leaf split over all of them (no DP twin).
  Slices 1 and 2 are lost together: with 2 copies elsewhere every piece
  survives; with 1, slice 1's pieces (kept by slices 1 and 2) do not, and the
  restore falls back to Orbax, saying which leaf."""
  devs = jax.devices()
  s4 = {k: devs[2 * k: 2 * k + 2] for k in range(4)}
  mesh = jax.sharding.Mesh(np.array(devs).reshape(4, 2), ("replica", "model"))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("replica", "model"))

  def state(step):
    return {"w": jax.device_put(jnp.arange(8 * 6, dtype=jnp.float32).reshape(8, 6) + step,
                                sharding)}
  survivors = jax.sharding.Mesh(np.array(s4[0] + s4[3]).reshape(2, 2), ("replica", "model"))
  target = {"w": jax.ShapeDtypeStruct((8, 6), jnp.float32, sharding=jax.sharding.NamedSharding(
      survivors, jax.sharding.PartitionSpec("replica", "model")))}
  mgr = SnapshotManager(SnapshotOptions(redundancy=Replicas(replicas), persistent_interval=2,
                                        run_id=f"four-{replicas}"),
                        slices=s4, persistent=str(tmp_path / "orbax"))
  with mgr:
    for step in (2, 3):
      mgr.save(step, state(step))
    mgr.wait_until_finished()
    copies = {}
    for d in s4:
      for rec, arr in stored(mgr, d, 3):
        copies.setdefault(rec.index, []).append(d)
        assert next(iter(arr.devices())) in s4[d]
    assert all(len(ds) == 1 + replicas for ds in copies.values())
    mgr.forget_domains([1, 2], "slices lost")
    r = mgr.restore(target)
    if replicas == 2:
      assert (r.step, r.source) == (3, Source.SNAPSHOT)
      assert_bitwise_equal(host_copy(state(3)), r.state)
    else:
      assert (r.step, r.source) == (2, Source.PERSISTENT)
      assert any("leaf 'w'" in n for n in r.notes), r.notes
      assert_bitwise_equal(host_copy(state(2)), r.state)
