"""The staged accelerator capture, run on CPU devices (``Staging.ALWAYS``),
for both stores that land the bytes in this process's memory: host files,
and the pinned-host store under ``slices=`` (``PinnedMemory.PROCESS``).
Shards copied in device memory and cut into pieces, a budget for what stays
staged, the rest copied before ``save`` returns; every restore bitwise."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import snapstore
from snapstore._backends import staging
from snapstore._backends.pinned.slices import HostParts
from tests.helpers import assert_bitwise_equal, host_copy, only_store, opts

CHUNK = 64 << 10  # small chunks and pieces: several pieces a chunk, chunks a shard
PIECE = 16 << 10


def make_state(seed: int = 0) -> dict:
  """~3.6 MiB over 8 devices: sharded on either axis, replicated (twins),
  bf16, a key, an empty leaf and a scalar."""
  mesh = jax.make_mesh((8,), ("d",))
  k = jax.random.split(jax.random.key(seed), 4)

  def put(x, spec):
    return jax.device_put(x, NamedSharding(mesh, spec))
  return {
      "w": put(jax.random.normal(k[0], (1024, 512), jnp.float32), P("d")),  # 256 KiB shards
      "cols": put(jax.random.normal(k[1], (96, 1024), jnp.float32), P(None, "d")),
      "rep": put(jax.random.normal(k[2], (300, 7), jnp.float32), P()),
      "half": put(jax.random.normal(k[3], (4096, 100), jnp.bfloat16), P("d")),
      "key": put(jax.random.key(seed + 1), P()),
      "empty": put(jnp.zeros((0, 4), jnp.int32), P()),
      "step": seed,
  }


def abstract(state: dict) -> dict:
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                      if isinstance(x, jax.Array) else x, state)


def stored_bytes(state: dict) -> int:
  """Bytes of the distinct addressable shards: what a snapshot stores."""
  total = 0
  for x in jax.tree.leaves(state):
    if isinstance(x, jax.Array):
      x = jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x
      # (slices are hashable from Python 3.12 only)
      total += sum({tuple((i.start, i.stop) for i in s.index): s.data.nbytes
                    for s in x.addressable_shards}.values())
  return total


def staged_opts(store_dir, **kw) -> snapstore.SnapshotOptions:
  return opts(store_dir, staging=snapstore.Staging.ALWAYS, chunk_bytes=CHUNK,
              staging_piece_bytes=PIECE, **kw)


#: the pinned-host store as Pathways keeps it: each slice's copies in its
#: devices' host memory, checked on device (:mod:`snapstore._backends.pinned.slices`)
SLICE_HOSTS = snapstore.PinnedHost(memory=snapstore.PinnedMemory.SLICE_HOSTS,
                                   checksum=snapstore.PinnedChecksum.DEVICE)


@pytest.fixture(params=["files", "pinned", "slices"])
def staged_manager(request, store_dir):
  """``staged_manager(**options)``: host files of this process, or the
  pinned-host store of two slices of 4 devices (its memory: this process's;
  ``slices``: each slice's devices' host memory)."""
  def make(**kw) -> snapstore.SnapshotManager:
    devices = jax.devices()
    slices = {0: devices[:4], 1: devices[4:]} if request.param != "files" else None
    if request.param == "slices":
      kw["store"] = SLICE_HOSTS
    mgr = snapstore.SnapshotManager(staged_opts(store_dir, **kw), slices=slices)
    assert isinstance(mgr.store, snapstore.PinnedHost) == (request.param != "files")
    return mgr
  make.kind = request.param
  return make


def stageable_bytes(state: dict, kind: str) -> int:
  """What a save stages: every stored shard, or (SLICE_HOSTS) those of the
  leaves split over every device (a leaf with twins in a slice is put to
  host memory as it is)."""
  if kind != "slices":
    return stored_bytes(state)
  return sum(x.nbytes for x in jax.tree.leaves(state) if isinstance(x, jax.Array)
             and x.size and any(axis is not None for axis in x.sharding.spec))


@functools.cache
def _donating_step():
  def step(s):
    return {k: (v * 2 + 1 if v.dtype in (jnp.float32, jnp.bfloat16) else v)
            for k, v in s.items()}
  return jax.jit(step, donate_argnums=0)


def donating_step():
  """A jitted step that donates every array leaf of the state."""
  def step(state: dict) -> dict:
    arrays = {k: v for k, v in state.items() if isinstance(v, jax.Array)}
    return {**state, **_donating_step()(arrays), "step": state["step"] + 1}
  return step


def test_a_budget_for_everything_stages_every_shard_and_restores_bitwise(staged_manager):
  state = make_state()
  with staged_manager() as mgr:  # CPU: no limit
    mgr.save(1, state)
    m = mgr.metrics
    assert m.staged_bytes == stageable_bytes(state, staged_manager.kind)
    assert m.copied_before_return_bytes == 0
    assert m.stall_seconds == 0.0
    mgr.wait_until_finished()
    got = mgr.restore(abstract(state))
  assert got.step == 1
  assert_bitwise_equal(state, got.state)


def test_a_partial_budget_copies_the_rest_before_save_returns(staged_manager):
  state = make_state()
  budget = 64 << 10
  with staged_manager(staging_budget_bytes=budget) as mgr:
    mgr.save(1, state)
    m = mgr.metrics
    assert 0 < m.staged_bytes <= budget * 8  # per device
    assert m.copied_before_return_bytes > 0
    assert (m.staged_bytes + m.copied_before_return_bytes
            == stageable_bytes(state, staged_manager.kind))
    assert m.stall_seconds > 0 and m.stall_seconds_total == m.stall_seconds
    mgr.wait_until_finished()
    got = mgr.restore(abstract(state))
  assert_bitwise_equal(state, got.state)


def test_no_budget_copies_every_shard_whole_before_save_returns(staged_manager):
  state = make_state()
  with staged_manager(staging_budget_bytes=0) as mgr:
    mgr.save(1, state)
    assert mgr.metrics.staged_bytes == 0
    # (SLICE_HOSTS: every leaf put to pinned_host as it is, while training runs)
    assert mgr.metrics.copied_before_return_bytes == (
        0 if staged_manager.kind == "slices" else stored_bytes(state))
    mgr.wait_until_finished()
    got = mgr.restore(abstract(state))
  assert_bitwise_equal(state, got.state)


@pytest.mark.parametrize("budget", [None, 64 << 10, 0])
def test_a_step_that_donates_the_state_right_after_save_changes_no_snapshot(staged_manager,
                                                                             budget):
  state = make_state()
  expected = host_copy(state)
  step = donating_step()
  with staged_manager(keep=1, staging_budget_bytes=budget) as mgr:
    saved = state
    mgr.save(1, state)
    for _ in range(3):  # donates the saved buffers while the drain reads the pieces
      state = step(state)
    # (copied whole on CPU, a shard's host copy is a view of its buffer: jax
    # <= 0.12.0 then skips the donation, 0.12.1 donates the handle and keeps
    # the buffer alive for the view; the restore below is the property)
    if budget != 0:
      assert saved["w"].is_deleted()
    mgr.wait_until_finished()
    got = mgr.restore(abstract(make_state()), step=1)
  assert_bitwise_equal(expected, got.state)
  assert not np.array_equal(np.asarray(state["w"]), expected["w"])


def test_saves_reuse_the_slots_and_the_compiled_cut_and_restore_bitwise(store_dir):
  step = donating_step()
  state = make_state()
  template = abstract(make_state())
  with snapstore.SnapshotManager(staged_opts(store_dir, keep=2,
                                             staging_budget_bytes=64 << 10)) as mgr:
    slots, compiled = None, None
    for s in range(1, 7):
      expected = host_copy(state)
      mgr.save(s, state)
      state = step(state)
      mgr.wait_until_finished()
      got = mgr.restore(template)
      assert got.step == s
      assert_bitwise_equal(expected, got.state)
      files = {p.name: p.stat().st_ino for p in only_store(mgr).root.glob("slot-*")}
      if s == 3:  # keep=2: two complete and the one being written
        slots, compiled = files, staging._cutter.cache_info().currsize
      elif s > 3:
        assert files == slots  # the same slot files, written again
        assert staging._cutter.cache_info().currsize == compiled  # nothing new to compile
    assert mgr.metrics.snapshots_committed == 6
    assert mgr.metrics.stall_seconds_total > mgr.metrics.stall_seconds > 0


def test_auto_on_cpu_devices_keeps_the_zero_copy_views(store_dir):
  state = make_state()
  with snapstore.SnapshotManager(opts(store_dir)) as mgr:
    mgr.save(1, state)
    assert mgr.metrics.staged_bytes == 0 and mgr.metrics.copied_before_return_bytes == 0
    mgr.wait_until_finished()
    assert_bitwise_equal(state, mgr.restore(abstract(state)).state)


def test_single_controller_stores_stage_each_piece_once(store_dir):
  devices = jax.devices()
  state = make_state()
  with snapstore.SnapshotManager(staged_opts(store_dir, store=snapstore.HostFiles(dir=store_dir)),
                                 slices={0: devices[:4], 1: devices[4:]}) as mgr:
    mgr.save(1, state)
    assert mgr.metrics.staged_bytes == stored_bytes(state)
    mgr.wait_until_finished()
    got = mgr.restore(abstract(state))
  assert_bitwise_equal(state, got.state)


@pytest.mark.parametrize("nbytes,itemsize", [(1, 1), (4096, 4), (CHUNK, 2), (CHUNK + 8, 8),
                                             (5 * CHUNK - 4, 4), (PIECE * 3 + 2, 2)])
def test_parts_tile_a_shard_on_elements_and_end_on_every_chunk(nbytes, itemsize):
  bounds = staging.part_bounds(nbytes, itemsize, PIECE, CHUNK)
  assert bounds[0] == 0 and bounds[-1] == nbytes
  sizes = np.diff(bounds)
  assert (sizes > 0).all() and (sizes <= PIECE).all()
  assert all(b % itemsize == 0 for b in bounds)
  assert set(range(0, nbytes, CHUNK)) <= set(bounds)


def test_the_budget_is_the_free_memory_at_the_peak_less_a_headroom_capped():
  gib = 1 << 30
  stats = {"bytes_limit": 16 * gib, "bytes_in_use": 2 * gib, "peak_bytes_in_use": 5 * gib}
  room, need = staging.budget(stats, None)
  assert need == 5 * gib and room == 11 * gib - int(16 * gib * staging.HEADROOM_FRACTION)
  assert staging.budget(stats, 64 << 20)[0] == 64 << 20  # capped
  # a later peak reached while 3 GiB were staged is the program's 5 GiB again
  later = {**stats, "peak_bytes_in_use": 8 * gib}
  assert staging.budget(later, None, held=3 * gib, need=need) == (room, 5 * gib)
  # ...and one the staging cannot explain is the program's own
  assert staging.budget(later, None, held=1 * gib, need=need)[1] == 7 * gib
  full = {**stats, "bytes_in_use": 16 * gib - (100 << 20)}
  assert staging.budget(full, None)[0] == 0  # never below 0
  assert staging.budget(None, None) == (None, None)  # CPU: no limit
  assert staging.budget(None, 123) == (123, None)


@pytest.mark.parametrize("kw", [{"staging": "always"}, {"staging_budget_bytes": -1},
                                {"staging_budget_bytes": 1.5}, {"staging_piece_bytes": 100},
                                {"staging_piece_bytes": 2 << 30}])
def test_bad_staging_options_are_refused_by_name(kw):
  with pytest.raises((TypeError, ValueError), match=next(iter(kw))):
    snapstore.SnapshotOptions(**kw)


def test_the_pinned_store_stages_into_reused_slot_memory_and_restores_bitwise(
    store_dir, monkeypatch):
  """PinnedMemory.PROCESS: each slot's memory is made once and written again
  by later saves (a TPU's pinned arena is never given back), the cut is
  compiled once, and a donating step right after each save changes no
  snapshot."""
  from snapstore import _arena
  made: list[int] = []
  fresh = _arena._mapping
  monkeypatch.setattr(_arena, "_mapping", lambda n: made.append(n) or fresh(n))
  devices = jax.devices()
  step = donating_step()
  state, template = make_state(), abstract(make_state())
  with snapstore.SnapshotManager(staged_opts(store_dir, keep=1, prefault_restore=False,
                                             staging_budget_bytes=64 << 10),
                                 slices={0: devices[:4], 1: devices[4:]}) as mgr:
    assert mgr._backend.memory is snapstore.PinnedMemory.PROCESS
    compiled = None
    for s in range(1, 7):
      expected = host_copy(state)
      mgr.save(s, state)
      state = step(state)
      mgr.wait_until_finished()
      if s == 2:  # two slots in each of two slices
        assert len(made) == 4, made
        compiled = staging._cutter.cache_info().currsize
      elif s > 2:
        assert staging._cutter.cache_info().currsize == compiled
    assert len(made) == 4, made
    got = mgr.restore(template)
  assert got.step == 6
  assert_bitwise_equal(expected, got.state)


def test_the_pinned_store_stages_parity_and_rebuilds_a_lost_slice_bitwise():
  """4 slices of 2 devices, parity k=3, staged: slice 1 is lost and its
  pieces are rebuilt from the parity blocks the drain copied."""
  from snapstore.testing.backend_suite import abstract as suite_abstract, awkward_state, save_steps
  devs = jax.devices()
  s4 = {k: devs[2 * k:2 * k + 2] for k in range(4)}
  options = snapstore.SnapshotOptions(store=snapstore.PinnedHost(), redundancy=snapstore.Parity(3),
                                      staging=snapstore.Staging.ALWAYS, chunk_bytes=CHUNK,
                                      staging_piece_bytes=PIECE)
  with snapstore.SnapshotManager(options, slices=s4) as mgr:
    refs = save_steps(mgr, [1, 2])
    assert mgr.metrics.staged_bytes > 0
    mgr.forget_domains([1], "slice lost")
    r = mgr.restore(suite_abstract(awkward_state(devs, 0)))
  assert r.step == 2 and r.bytes_read["rebuilt"] > 0
  assert_bitwise_equal(refs[2], r.state)


def test_the_pinned_store_keeps_the_bytes_where_its_memory_option_says():
  """AUTO: this process's memory for CPU devices or one process's chips; the
  slices' own hosts for a Pathways client (JAX's platforms name ``proxy``)
  or when the device's checksum is asked for; PROCESS cannot take it."""
  from snapstore._backends.pinned.backend import memory_for
  PM, PC = snapstore.PinnedMemory, snapstore.PinnedChecksum

  class Chip:  # a local accelerator as memory_for sees one
    platform, process_index = "tpu", 0
  cpu, tpu = jax.devices()[:2], [Chip(), Chip()]
  assert memory_for(cpu, snapstore.PinnedHost()) is PM.PROCESS
  assert memory_for(tpu, snapstore.PinnedHost()) is PM.PROCESS
  assert memory_for(cpu, snapstore.PinnedHost(checksum=PC.DEVICE)) is PM.SLICE_HOSTS
  assert memory_for(tpu, snapstore.PinnedHost(memory=PM.SLICE_HOSTS)) is PM.SLICE_HOSTS
  old = jax.config.jax_platforms
  try:
    jax.config.update("jax_platforms", "proxy")
    assert memory_for(tpu, snapstore.PinnedHost()) is PM.SLICE_HOSTS
    assert memory_for(cpu, snapstore.PinnedHost()) is PM.PROCESS  # (CPU devices: here)
  finally:
    jax.config.update("jax_platforms", old)
  with pytest.raises(snapstore.InvalidOptionError, match="PROCESS"):
    snapstore.PinnedHost(memory=PM.PROCESS, checksum=PC.DEVICE)
  with pytest.raises(snapstore.InvalidOptionError, match="memory"):
    snapstore.PinnedHost(memory="process")


def test_a_leaf_already_in_pinned_host_memory_is_copied_not_read_in_place(monkeypatch):
  """Off CPU a leaf held in pinned_host memory (host-offloaded optimizer
  state) is read from a copy of its own: the drain never reads a buffer
  that the next step may donate or the caller delete (CPU devices told
  they are not CPUs, as the capture sees an accelerator)."""
  from snapstore._tree import flatten
  monkeypatch.setattr(staging, "_on_cpu", lambda sharding: False)
  mesh = jax.make_mesh((8,), ("d",))
  leaf = jax.device_put(jnp.arange(1024, dtype=jnp.float32),
                        NamedSharding(mesh, P("d"), memory_kind="pinned_host"))
  specs, leaves, _ = flatten({"off": leaf})
  (_, read, how), = staging.staged(specs, leaves, snapstore.Staging.AUTO).values()
  assert how is staging.Read.PINNED
  ours = {s.device: s.data.unsafe_buffer_pointer() for s in leaf.addressable_shards}
  assert all(s.data.unsafe_buffer_pointer() != ours[s.device] for s in read.addressable_shards)
  expected = np.asarray(leaf)
  leaf.delete()
  np.testing.assert_array_equal(np.asarray(read), expected)


def test_a_failed_staging_evicts_nothing(store_dir, monkeypatch):
  """The pinned store stages before it reserves a slot (which may evict):
  staging that raises leaves every snapshot the store held."""
  devices = jax.devices()
  state = make_state()
  with snapstore.SnapshotManager(staged_opts(store_dir, keep=1),
                                 slices={0: devices[:4], 1: devices[4:]}) as mgr:
    for s in (1, 2):
      mgr.save(s, make_state(s))
      mgr.wait_until_finished()
    held = mgr.snapshot_steps()

    def fail(self, shards):
      raise RuntimeError("staging failed")
    monkeypatch.setattr(staging.Stager, "stage", fail)
    with pytest.raises(Exception, match="staging failed"):
      mgr.save(3, state)
      mgr.wait_until_finished()
    assert mgr.snapshot_steps() == held


@pytest.mark.parametrize("how", ["process_pinned_put", "slice_hosts_crc32c"])
def test_the_pinned_stores_other_reads_restore_bitwise(store_dir, monkeypatch, how):
  """PROCESS with ``Staging.NEVER`` off CPU (each leaf's pinned_host copy,
  read by the drain into slot memory), and SLICE_HOSTS checked by crc32c:
  a donating step right after save changes no snapshot."""
  devices = jax.devices()
  memory = snapstore.PinnedMemory.SLICE_HOSTS
  extra = {}
  if how == "process_pinned_put":
    monkeypatch.setattr(staging, "_on_cpu", lambda sharding: False)
    memory, extra = snapstore.PinnedMemory.PROCESS, {"staging": snapstore.Staging.NEVER}
  store = snapstore.PinnedHost(memory=memory, checksum=snapstore.PinnedChecksum.HOST)
  state = make_state()
  expected = host_copy(state)
  with snapstore.SnapshotManager(snapstore.SnapshotOptions(store=store, keep=1, **extra),
                                 slices={0: devices[:4], 1: devices[4:]}) as mgr:
    assert mgr._backend.memory is memory
    mgr.save(1, state)
    state = donating_step()(state)
    assert mgr.metrics.staged_bytes == 0
    mgr.wait_until_finished()
    got = mgr.restore(abstract(make_state()))
  assert got.step == 1
  assert_bitwise_equal(expected, got.state)


def test_slice_hosts_keeps_each_copy_as_pieces_in_its_slices_host_memory(store_dir):
  """SLICE_HOSTS: a leaf split over every device is kept as parts of at
  most a piece, in the host memory of a device of the slice that keeps it
  (its own shards and a copy of the other slice's), bytes as the shard's."""
  state = make_state()
  devices = jax.devices()
  s2d = {0: devices[:4], 1: devices[4:]}
  with snapstore.SnapshotManager(staged_opts(store_dir, store=SLICE_HOSTS), slices=s2d) as mgr:
    mgr.save(1, state)
    mgr.wait_until_finished()
    for d, devs in s2d.items():
      store = mgr._backend.stores[d]
      (m,) = store.manifests()
      owners: dict[str, set[int]] = {}
      for rec in m.pieces:
        name = m.leaves[rec.leaf].path.strip("[]'")
        held = store.array(m.slot, rec.offset)
        if name not in ("w", "cols", "half"):
          continue
        assert isinstance(held, HostParts) and held.device in devs
        assert held.memory_kind == "unpinned_host"
        assert len(held.parts) > 1 and all(p.nbytes <= PIECE for p in held.parts)
        got = np.concatenate([np.asarray(p).reshape(-1) for p in held.parts])
        want = np.asarray(state[name])[tuple(slice(a, b) for a, b in rec.index)]
        assert got.dtype == want.dtype and got.tobytes() == want.tobytes()
        owners.setdefault(name, set()).add(rec.owner)
      assert owners == {n: {0, 1} for n in ("w", "cols", "half")}, owners


def test_slice_hosts_stages_only_what_its_program_can_cut():
  """A mesh sharding of device memory over an even split is staged; an
  empty leaf, a leaf in host memory and a single-device leaf go as they
  are (and a leaf that is not split evenly cannot exist as such)."""
  from snapstore._backends.pinned.slices import stageable
  state = make_state()
  assert stageable(state["w"]) and stageable(state["cols"]) and stageable(state["rep"])
  assert not stageable(state["empty"])
  pinned = jax.device_put(state["w"], state["w"].sharding.with_memory_kind("pinned_host"))
  assert not stageable(pinned)
  assert not stageable(jax.device_put(np.ones(4, np.float32), jax.devices()[0]))
