"""The backend conformance suite: every store behind ``SnapshotManager``
passes the same tests (zarr's ``StoreTests`` pattern).

A backend is one :class:`Kind` in ``KINDS``: how to build a manager on it and
how to flip one byte of one stored copy (as failing RAM would). A new backend
adds itself there and gets every test below. 8 CPU devices; the kinds with
``slices`` see them as 2 failure domains (slices) of 4.
"""

from __future__ import annotations

import ctypes
import dataclasses
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding

from snapstore import (
    BudgetExceededError,
    BusyPolicy,
    SnapshotManager,
    SnapshotOptions,
    Source,
    StepNotFoundError,
    StoreKind,
)
from tests.helpers import assert_bitwise_equal, host_copy


@dataclasses.dataclass(frozen=True)
class Kind:
  name: str
  store: StoreKind
  slices: bool  # a single controller holding one store per failure domain

  def manager(self, store_dir, **kw) -> SnapshotManager:
    kw.setdefault("run_id", "conformance")
    devs = jax.devices()
    return SnapshotManager(SnapshotOptions(store=self.store, store_dir=store_dir, **kw),
                           slices={0: devs[:4], 1: devs[4:]} if self.slices else None)

  def flip_byte(self, mgr: SnapshotManager, store_id: int, step: int, leaf: str) -> None:
    """Flips a byte in the middle of store ``store_id``'s own copy of the
    first piece of ``leaf`` at ``step``."""
    store = mgr._backend.stores[store_id]
    (m,) = [m for m in store.manifests() if m.step == step]
    names = {i: s.path for i, s in enumerate(m.leaves)}
    p = next(p for p in m.pieces if names[p.leaf] == leaf and p.owner == store_id)
    if self.store is StoreKind.HOST_FILES:
      with open(store.root / f"slot-{m.slot}.bin", "r+b") as f:
        f.seek(p.offset + p.nbytes // 2)
        b = f.read(1)
        f.seek(p.offset + p.nbytes // 2)
        f.write(bytes([b[0] ^ 0x10]))
    else:
      arr = store.array(m.slot, p.offset)
      arr.block_until_ready()
      ctypes.c_uint8.from_address(arr.unsafe_buffer_pointer() + p.nbytes // 2).value ^= 0x10


KINDS = [Kind("host_files_per_process", StoreKind.HOST_FILES, slices=False),
         Kind("host_files_per_slice", StoreKind.HOST_FILES, slices=True),
         Kind("pinned_host_per_slice", StoreKind.PINNED_HOST, slices=True)]
SLICED = [k for k in KINDS if k.slices]


@pytest.fixture(params=KINDS, ids=lambda k: k.name)
def kind(request):
  return request.param


@pytest.fixture(params=SLICED, ids=lambda k: k.name)
def sliced(request):
  return request.param


def awkward_state(devices, step):
  """Sharded without a twin across domains, DP-replicated, 0-d, bool, int8,
  bf16, uint16 on one device, a typed key, numpy leaves and Python scalars."""
  n = len(devices) // 4
  mesh = jax.sharding.Mesh(np.array(devices).reshape(n, 4), ("replica", "model"))
  put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
  return {
      "tp": put(jnp.arange(8 * 16, dtype=jnp.float32).reshape(8, 16) + step,
                P("replica", "model")),
      "dp": put(jnp.ones((4, 8), jnp.bfloat16) * step, P(None, "model")),
      "flags": put(jnp.arange(8) % (step + 2) == 0, P("model")),
      "small": put(jnp.arange(15, dtype=jnp.int8).reshape(3, 5) - step, P()),
      "zero_d": put(jnp.float32(step) / 3, P()),
      "single": jax.device_put(jnp.arange(5, dtype=jnp.uint16) * step,
                               SingleDeviceSharding(devices[-1])),
      "key": jax.device_put(jax.random.key(step), SingleDeviceSharding(devices[0])),
      "np": np.arange(6, dtype=np.int64).reshape(2, 3) * step,
      "np_scalar": np.float64(step + 0.25),
      "py": {"i": step, "f": 1 / 3, "s": f"step {step}", "b": True, "none": None},
  }


def abstract(state):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                      if isinstance(x, jax.Array) else x, state)


def save_steps(mgr, steps, devices=None):
  refs = {}
  for s in steps:
    state = awkward_state(devices or jax.devices(), s)
    assert mgr.save(s, state, extra={"data": [s, "it"]})
    refs[s] = host_copy(state)
  mgr.wait_until_finished()
  return refs


def test_round_trip_is_bitwise_for_awkward_leaves(kind, store_dir):
  with kind.manager(store_dir) as mgr:
    refs = save_steps(mgr, [1, 2])
    target = abstract(awkward_state(jax.devices(), 0))
    newest = mgr.restore(target)
    older = mgr.restore(target, step=1)
  assert (newest.step, newest.source, newest.extra) == (2, Source.SNAPSHOT, {"data": [2, "it"]})
  assert_bitwise_equal(refs[2], newest.state)
  assert older.step == 1
  assert_bitwise_equal(refs[1], older.state)
  assert newest.state["tp"].sharding == target["tp"].sharding


@pytest.mark.parametrize("kind", [k for k in KINDS if k.store is StoreKind.HOST_FILES],
                         ids=lambda k: k.name)
def test_the_accelerator_path_stages_every_leaf_in_one_put(kind, store_dir, monkeypatch):
  """Off CPU, host files read each leaf's ``pinned_host`` copy, all leaves
  dispatched in one ``device_put`` (CPU devices have ``pinned_host`` memory:
  the path runs here when told the devices are not CPUs)."""
  from snapstore._backends.hostfiles import capture
  monkeypatch.setattr(capture, "_on_cpu", lambda sharding: False)
  state = awkward_state(jax.devices(), 1)
  puts = []
  real_put = jax.device_put

  def put(x, *args, **kw):  # (jax.device_put itself: this test's only puts)
    puts.append(len(x) if isinstance(x, list) else 1)
    return real_put(x, *args, **kw)
  with kind.manager(store_dir) as mgr:
    monkeypatch.setattr(jax, "device_put", put)
    mgr.save(1, state)
    mgr.wait_until_finished()
    monkeypatch.undo()
    assert puts == [sum(isinstance(x, jax.Array) for x in jax.tree.leaves(state))]
    got = mgr.restore(abstract(awkward_state(jax.devices(), 0)))
  assert_bitwise_equal(host_copy(state), got.state)


@pytest.mark.parametrize("kind", [k for k in KINDS if k.store is StoreKind.HOST_FILES],
                         ids=lambda k: k.name)
def test_a_committed_manifest_is_what_its_file_decodes_to(kind, store_dir):
  # A store keeps the manifest it commits instead of decoding its file again.
  with kind.manager(store_dir) as mgr:
    save_steps(mgr, [1, 2])
    for store in mgr._backend.stores.values():
      kept = store.manifests()
      store._decoded.clear()
      assert [m.step for m in kept] == [1, 2]
      assert store.manifests() == kept


def test_the_extra_restored_is_what_was_saved_not_the_callers_object(kind, store_dir):
  meta = {"data": [1, "it"]}
  with kind.manager(store_dir) as mgr:
    mgr.save(1, awkward_state(jax.devices(), 1), extra=meta)
    mgr.wait_until_finished()
    meta["data"].append("changed after save")
    got = mgr.restore(abstract(awkward_state(jax.devices(), 0)))
    got.extra["data"].append("changed by the caller")
    again = mgr.restore(abstract(awkward_state(jax.devices(), 0)))
  assert got.extra is not meta and again.extra == {"data": [1, "it"]}


def test_keep_holds_the_newest_and_a_too_small_budget_stores_nothing(kind, store_dir):
  with kind.manager(store_dir, keep=2) as mgr:
    save_steps(mgr, range(1, 6))
    assert mgr.snapshot_steps() == [4, 5]
    assert all(len(st.manifests()) <= 2 for st in mgr._backend.stores.values())
    with pytest.raises(StepNotFoundError):
      mgr.restore(abstract(awkward_state(jax.devices(), 0)), step=3)
  with kind.manager(store_dir / "small", budget_bytes=64) as mgr:
    with pytest.raises(BudgetExceededError, match="raise budget_bytes"):
      mgr.save(1, awkward_state(jax.devices(), 1))
    assert mgr.snapshot_steps() == []


@pytest.mark.parametrize("policy", [BusyPolicy.WAIT, BusyPolicy.SKIP])
def test_busy_policy_waits_or_skips_and_counts(kind, store_dir, policy):
  with kind.manager(store_dir, busy_policy=policy) as mgr:
    gate = threading.Event()
    real_drain = mgr._backend.drain

    def gated_drain(pending):
      gate.wait(60)
      return real_drain(pending)
    mgr._backend.drain = gated_drain
    mgr.save(1, awkward_state(jax.devices(), 1))
    if policy is BusyPolicy.SKIP:
      assert not mgr.save(2, awkward_state(jax.devices(), 2))
      gate.set()
    else:
      threading.Timer(0.2, gate.set).start()
      assert mgr.save(2, awkward_state(jax.devices(), 2))
    mgr.wait_until_finished()
    m = mgr.metrics
    assert (m.skipped_busy, m.waited_busy) == ((1, 0) if policy is BusyPolicy.SKIP else (0, 1))
    assert mgr.snapshot_steps() == ([1] if policy is BusyPolicy.SKIP else [1, 2])


def test_deleting_the_state_while_it_drains_keeps_the_snapshot(kind, store_dir):
  """A caller may free the old state (``x.delete()``) as soon as ``save``
  returns: the snapshot keeps its bytes (a DLPack hold on a shard made
  XLA abort the process instead)."""
  with kind.manager(store_dir) as mgr:
    gate = threading.Event()
    real_drain = mgr._backend.drain
    mgr._backend.drain = lambda pending: (gate.wait(60), real_drain(pending))[1]
    state = awkward_state(jax.devices(), 1)
    ref = host_copy(state)
    mgr.save(1, state)
    for x in jax.tree.leaves(state):
      if isinstance(x, jax.Array):
        x.delete()
    gate.set()
    mgr.wait_until_finished()
    assert_bitwise_equal(ref, mgr.restore(abstract(awkward_state(jax.devices(), 0))).state)


def test_flipped_byte_uses_the_other_copy_or_an_older_step(kind, store_dir):
  with kind.manager(store_dir) as mgr:
    refs = save_steps(mgr, [1, 2])
    kind.flip_byte(mgr, 0, 2, "tp")
    r = mgr.restore(abstract(awkward_state(jax.devices(), 0)))
  # With two domains the replica in the other domain is used; alone, step 1.
  want = 2 if kind.slices else 1
  assert r.step == want
  assert_bitwise_equal(refs[want], r.state)
  assert any("step 2" in n and "tp" in n for n in r.notes), r.notes


def test_a_flipped_byte_in_a_big_piece_is_caught(kind, store_dir):
  """Pieces of 512 KiB in 2 chunks, copied and checked on the pool (small
  ones go on the calling thread, see ``_checksum.SMALL_BYTES``; the test
  above flips one of those), beside small ones, at save and at restore."""
  leaf = "big"
  def state(step):
    out = awkward_state(jax.devices(), step)
    mesh = out["tp"].sharding.mesh
    out["big"] = jax.device_put(jnp.arange(64 * 8192, dtype=jnp.float32).reshape(64, 8192)
                                * step, NamedSharding(mesh, P(None, "model")))
    return out
  with kind.manager(store_dir, chunk_bytes=256 << 10) as mgr:
    refs = {}
    for s in (1, 2):
      refs[s] = host_copy(state(s))
      mgr.save(s, state(s))
    mgr.wait_until_finished()
    assert_bitwise_equal(refs[2], mgr.restore(abstract(state(0))).state)
    kind.flip_byte(mgr, 0, 2, leaf)
    r = mgr.restore(abstract(state(0)))
  want = 2 if kind.slices else 1
  assert r.step == want
  assert_bitwise_equal(refs[want], r.state)
  assert any("step 2" in n and leaf in n for n in r.notes), r.notes


def test_a_flipped_byte_in_the_middle_of_a_run_is_caught(kind, store_dir, monkeypatch):
  """Many small leaves lie back to back in a slot and are fetched as runs
  (one copy, then each piece's crc32c): a flipped byte in one piece in the
  middle of a run rejects that piece alone; the others of its run are still
  taken from it, and the restore is bitwise."""
  from snapstore import _assemble

  def state(step):
    out = awkward_state(jax.devices(), step)
    mesh = out["tp"].sharding.mesh
    for i in range(12):
      out[f"m{i:02d}"] = jax.device_put(
          jnp.arange(32 * 64, dtype=jnp.float32).reshape(32, 64) * step + i,
          NamedSharding(mesh, P(None, "model")))
    return out
  runs: list[int] = []
  real = _assemble.Assembler._fetch_item

  def counted(self, item, out):
    if isinstance(item, list):
      runs.append(len(item))
    return real(self, item, out)
  monkeypatch.setattr(_assemble.Assembler, "_fetch_item", counted)
  with kind.manager(store_dir) as mgr:
    refs = {}
    for s in (1, 2):
      refs[s] = host_copy(state(s))
      mgr.save(s, state(s))
    mgr.wait_until_finished()
    kind.flip_byte(mgr, 0, 2, "m05")
    r = mgr.restore(abstract(state(0)))
  want = 2 if kind.slices else 1
  assert r.step == want
  assert_bitwise_equal(refs[want], r.state)
  assert any("step 2" in n and "m05" in n for n in r.notes), r.notes
  if mgr._backend.runs:  # host files: pieces went in runs of several
    assert max(runs) > 4, runs
  else:
    assert not runs


def test_restore_timings_name_the_parts_of_its_read(kind, store_dir):
  with kind.manager(store_dir) as mgr:
    save_steps(mgr, [1])
    t = mgr.restore(abstract(awkward_state(jax.devices(), 0))).timings
  assert {"scan", "plan", "read", "read_verify", "read_place", "total"} <= set(t), t
  assert 0 < t["read_verify"] + t["read_place"] <= t["read"] <= t["total"], t


def test_both_copies_bad_falls_back_to_an_older_step(sliced, store_dir):
  with sliced.manager(store_dir) as mgr:
    refs = save_steps(mgr, [1, 2])
    m = next(m for m in mgr._backend.stores[0].manifests() if m.step == 2)
    tp = next(i for i, s in enumerate(m.leaves) if s.path == "tp")
    index = next(p.index for p in m.pieces if p.leaf == tp and p.owner == 0)
    sliced.flip_byte(mgr, 0, 2, "tp")
    # the same piece's replica in domain 1
    store1 = mgr._backend.stores[1]
    m1 = next(m for m in store1.manifests() if m.step == 2)
    rec = next(p for p in m1.pieces if p.leaf == tp and p.index == index)
    _flip(sliced, store1, m1, rec)
    r = mgr.restore(abstract(awkward_state(jax.devices(), 0)))
  assert r.step == 1
  assert_bitwise_equal(refs[1], r.state)


def _flip(kind, store, m, p):
  if kind.store is StoreKind.HOST_FILES:
    with open(store.root / f"slot-{m.slot}.bin", "r+b") as f:
      f.seek(p.offset + 1)
      b = f.read(1)
      f.seek(p.offset + 1)
      f.write(bytes([b[0] ^ 0x01]))
  else:
    arr = store.array(m.slot, p.offset)
    ctypes.c_uint8.from_address(arr.unsafe_buffer_pointer() + 1).value ^= 0x01


def test_a_forgotten_domain_is_not_written_to(sliced, store_dir):
  devs = jax.devices()
  with sliced.manager(store_dir) as mgr:
    save_steps(mgr, [1])
    mgr.forget_domains([1], "slice lost")
    assert mgr._backend.stores[1].manifests() == []
    with pytest.raises(ValueError, match="no slice that is up"):
      mgr.save(2, awkward_state(devs, 2))  # leaves on slice 1's devices
    refs = save_steps(mgr, [3], devices=devs[:4])
    assert mgr._backend.stores[1].manifests() == []
    if sliced.store is StoreKind.HOST_FILES:
      assert list(mgr._backend.stores[1].root.iterdir()) == []  # not even progress
    r = mgr.restore(abstract(awkward_state(devs[:4], 0)))
    assert r.step == 3
    assert_bitwise_equal(refs[3], r.state)
    mgr.set_active_domains([0, 1])
    save_steps(mgr, [4])
    assert [m.step for m in mgr._backend.stores[1].manifests()] == [4]


def test_other_runs_and_older_incarnations_are_fenced(kind, store_dir):
  with kind.manager(store_dir, incarnation=5) as mgr:
    refs = save_steps(mgr, [1, 2])
    sid = mgr._backend.store_ids()[0]
    store = mgr._backend.stores[sid]
    m2 = next(m for m in store.manifests() if m.step == 2)
    store.commit(dataclasses.replace(m2, run_id="another-run", step=8))
    store.commit(dataclasses.replace(m2, incarnation=4, step=9))
    r = mgr.restore(abstract(awkward_state(jax.devices(), 0)))
  assert r.step == 2
  assert_bitwise_equal(refs[2], r.state)


def test_restoring_an_older_step_abandons_the_newer_ones(kind, store_dir):
  """restore(step=1), then save(2) with new data: a later restore returns the
  new step 2 or later, never the abandoned branch's step 3."""
  with kind.manager(store_dir, keep=4) as mgr:
    save_steps(mgr, [1, 2, 3])
    r = mgr.restore(abstract(awkward_state(jax.devices(), 0)), step=1)
    assert r.step == 1
    new = awkward_state(jax.devices(), 7)  # different data at step 2
    mgr.save(2, new)
    mgr.wait_until_finished()
    again = mgr.restore(abstract(awkward_state(jax.devices(), 0)))
  assert again.step == 2
  assert_bitwise_equal(host_copy(new), again.state)


def test_replicas_every_other_snapshot_rewind_to_the_last_that_had_them(sliced, store_dir):
  """replica_interval=2: replicas travel with the even steps' snapshots
  (decided from the step, so every process, a replacement too, agrees);
  step 3's snapshot kept no cross-domain copies, so losing domain 1 restores
  step 2, the newest whose every piece survives."""
  devs = jax.devices()
  with sliced.manager(store_dir, replica_interval=2, keep=3) as mgr:
    refs = save_steps(mgr, [2, 3])
    held = {m.step: len(m.pieces) for m in mgr._backend.stores[0].manifests()}
    assert held[2] > held[3]  # step 2 carries domain 1's pieces too
    mgr.forget_domains([1], "slice lost")
    r = mgr.restore(abstract(awkward_state(devs[:4], 0)))
  assert (r.step, r.rewind_steps) == (2, 1)
  assert_bitwise_equal(refs[2], r.state)


def test_retention_keeps_the_snapshot_with_replicas_before_the_newest(sliced, store_dir):
  """replica_interval=2, keep=2: after step 4 the store keeps steps 4 and 2
  (both carry replicas) and lets step 3 (none) go, so when step 4's
  replicas are lost (a peer died during their transfer while this store's
  copy committed) step 2 still restores; keeping 3 and 4 would leave no
  step whose every piece survives."""
  devs = jax.devices()
  with sliced.manager(store_dir, replica_interval=2, keep=2) as mgr:
    refs = save_steps(mgr, [2, 3, 4])
    store = mgr._backend.stores[0]
    assert sorted(m.step for m in store.manifests()) == [2, 4]
    four = next(m for m in store.manifests() if m.step == 4)
    store.delete(four, "test: its replicas never arrived")
    mgr.forget_domains([1], "slice lost")
    r = mgr.restore(abstract(awkward_state(devs[:4], 0)))
  assert r.step == 2
  assert_bitwise_equal(refs[2], r.state)
