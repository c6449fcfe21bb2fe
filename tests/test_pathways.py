"""Pathways single-controller path on CPU: 8 devices as 2 virtual slices of 4.

What cannot run here is mocked with pathwaysutils' own tools: its
``DeviceLossSimulator`` makes a lost slice's arrays raise ``DATA_LOSS``, and
its slice health check (a pmap per slice) is replaced by one that reports
the simulator's lost slices. Everything else is real: ``Manager.elastic_retry``,
the snapshot stores, Orbax, the restore onto the surviving mesh.
"""

import dataclasses
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P
from pathwaysutils.elastic import elastic as pw_elastic
from pathwaysutils.elastic.manager import Manager
from pathwaysutils.test.mock_fault_injection import DeviceLossSimulator

from snapstore import (
    Auto,
    BusyPolicy,
    Every,
    HostFiles,
    Parity,
    PinnedChecksum,
    PinnedHost,
    PinnedMemory,
    Replicas,
    SnapshotOptions,
)
from snapstore._jax_compat import is_single_device_sharding
from snapstore.integrations.pathways import ElasticOptions, ElasticTrainer, Snapshotter
from tests.helpers import (
  assert_bitwise_equal,
  host_copy,
  slice_abstract as abstract,
  slice_state as make_state,
)


@pytest.fixture
def slices(monkeypatch, request):
  """2 virtual slices (or ``request.param``) and a simulator; the health
  check reports lost slices.

  ``lose(k, back_after=n)``: slice k is lost; with ``back_after``, a new slice
  replaces it once ``n`` health checks have seen it down (deterministic, no
  timers)."""
  devs = jax.devices()
  count = getattr(request, "param", 2)
  per = len(devs) // count
  s2d = {k: devs[k * per:(k + 1) * per] for k in range(count)}
  lost: dict[int, int | None] = {}  # slice -> health checks left until it is back
  sim = DeviceLossSimulator()

  def health(slice_to_devices=None, checker=None):
    up = set()
    for k in (slice_to_devices or s2d):
      if k in lost and lost[k] is not None and lost[k] <= 0:
        del lost[k]
        sim.mark_slice_connected(k, s2d)
      if k in lost:
        if lost[k] is not None:
          lost[k] -= 1
      else:
        up.add(k)
    return frozenset(up)
  monkeypatch.setattr(pw_elastic, "get_slice_to_devices",
                      lambda devices: {k: list(v) for k, v in s2d.items()})
  monkeypatch.setattr(pw_elastic, "get_active_slice_indices", health)

  def lose(k, back_after=None):
    sim.start()  # from here on: the simulator's patches are active
    lost[k] = back_after
    sim.mark_slice_lost(k, s2d)

  def reconnect(k):
    lost.pop(k, None)
    sim.mark_slice_connected(k, s2d)
  yield s2d, lose, reconnect
  sim.stop()


#: the stores a CPU device's slice can keep: AUTO (PROCESS here), and what
#: Pathways uses (SLICE_HOSTS: staged pieces in each slice's host memory)
MEMORIES = {"process": Auto, "slice_hosts": lambda dir: PinnedHost(
    memory=PinnedMemory.SLICE_HOSTS, checksum=PinnedChecksum.DEVICE)}


def run_elastic(store_dir, lose, options, *, fail_at=5, total=8,
                persistent=None, come_back=True, memory="process"):
  elastic = Manager()
  snapshots = dataclasses.replace(options.snapshots, store=MEMORIES[memory](dir=store_dir),
                                  run_id="pw", persistent_interval=2 if persistent else 0)
  trainer = ElasticTrainer(elastic, options=dataclasses.replace(options, snapshots=snapshots),
                           persistent=persistent)
  # CPU devices have pinned_host memory: the slices' snapshots are pinned arrays.
  assert isinstance(trainer.snapshots.store, PinnedHost)
  assert trainer.snapshots._backend.memory is PinnedMemory[memory.upper()]
  saved: dict[int, object] = {}
  meshes = []
  # DeviceLossSimulator tracks arrays by id(): keep every array alive so no
  # new array inherits a dead corrupted one's id.
  alive = []

  def loop(restored, devices):
    meshes.append(len(devices))
    start = restored.step + 1 if restored else 1
    state = restored.state if restored else None
    alive.append(state)
    for step in range(start, total + 1):
      state = make_state(devices, step)  # the "train step": a function of the step
      alive.append(state)
      saved[step] = host_copy(state)
      trainer.snapshots.save(step, state)
      if step == fail_at and len(meshes) == 1:
        trainer.snapshots.wait_until_finished()
        # The slice is replaced after two health checks (the elastic event's
        # and the first wait), or never.
        lose(1, back_after=2 if come_back else None)
        jax.block_until_ready(jax.jit(lambda s: s["tp"] * 2)(state))  # raises DATA_LOSS
    trainer.snapshots.wait_until_finished()
    return state

  try:
    final = trainer.run(loop, abstract)
  finally:
    trainer.close()
  return trainer, saved, meshes, final


FAST = dict(elastic_poll_seconds=0.05, elastic_timeout_seconds=20, elastic_max_retries=2)


@pytest.mark.parametrize("memory", sorted(MEMORIES))
def test_pause_resume_restores_the_lost_step_from_the_cross_slice_copy(slices, store_dir,
                                                                       memory):
  _, lose, _ = slices
  trainer, saved, meshes, final = run_elastic(store_dir, lose,
                                              ElasticOptions(**FAST), memory=memory)
  (event,) = trainer.events
  assert event.lost_slices == (1,) and event.active_slices == (0, 1)
  assert event.source == "snapshot" and event.restored_step == 5 and event.rewind_steps == 0
  assert meshes == [8, 8]
  assert_bitwise_equal(saved[8], final)


@pytest.mark.parametrize("slices", [4], indirect=True)
def test_parity_rebuilds_a_lost_slice_from_the_other_three(slices, store_dir):
  """4 virtual slices of 2 devices, parity k=3: slice 1 is lost (its store
  with it); its shards of the leaf without data-parallel twins are rebuilt
  from the others' parity blocks and pieces, bitwise."""
  _, lose, _ = slices
  trainer, saved, meshes, final = run_elastic(
      store_dir, lose, ElasticOptions(snapshots=SnapshotOptions(redundancy=Parity(3)), **FAST))
  (event,) = trainer.events
  assert event.lost_slices == (1,) and event.source == "snapshot"
  assert event.restored_step == 5 and event.bytes_read["rebuilt"] > 0
  assert meshes == [8, 8]
  assert_bitwise_equal(saved[8], final)


def test_parity_keeps_at_most_0_4x_the_extra_bytes_of_a_replica(store_dir):
  """Measured from the stores' own arrays: 4 slices, a state whose big leaf
  has no data-parallel twin; extra = held - held without redundancy."""
  from snapstore import SnapshotManager
  devs = jax.devices()
  s2d = {k: devs[2 * k:2 * k + 2] for k in range(4)}
  mesh = jax.sharding.Mesh(np.array(devs).reshape(2, 4), ("replica", "model"))
  state = {  # 64 KiB without a twin (a shard per device), 1 KiB data-parallel
      "tp": jax.device_put(jnp.arange(64 * 256, dtype=jnp.float32).reshape(64, 256),
                           NamedSharding(mesh, P(("replica", "model")))),
      "dp": jax.device_put(jnp.ones((4, 64), jnp.float32), NamedSharding(mesh, P())),
  }
  abstract_state = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
  held = {}
  for name, redundancy in {"none": Replicas(0), "replica": Replicas(1),
                           "parity": Parity(3)}.items():
    with SnapshotManager(SnapshotOptions(store=Auto(dir=store_dir), run_id=name, keep=1,
                                         redundancy=redundancy),
                         slices=s2d) as mgr:
      mgr.save(1, state)
      mgr.wait_until_finished()
      held[name] = [mgr._backend.stores[k].held_bytes() for k in sorted(s2d)]
      restored = mgr.restore(abstract_state)
      assert_bitwise_equal(host_copy(state), restored.state)
  for k in range(4):
    extra_replica = held["replica"][k] - held["none"][k]
    extra_parity = held["parity"][k] - held["none"][k]
    assert 0 < extra_parity <= 0.4 * extra_replica, (k, held)


@pytest.mark.parametrize("memory", sorted(MEMORIES))
def test_replica_resize_continues_on_the_surviving_slice(slices, store_dir, memory):
  _, lose, _ = slices
  trainer, saved, meshes, final = run_elastic(
      store_dir, lose, ElasticOptions(elastic_min_slice_count=1, **FAST),
      come_back=False, memory=memory)
  (event,) = trainer.events
  assert event.active_slices == (0,) and event.restored_step == 5
  assert meshes == [8, 4]  # the restored state lives on slice 0's 4 devices
  assert_bitwise_equal(saved[8], final)


def test_without_the_cross_slice_copy_the_handler_falls_back_to_orbax(
    slices, store_dir, tmp_path):
  _, lose, _ = slices
  trainer, saved, _, final = run_elastic(
      store_dir, lose, ElasticOptions(snapshots=SnapshotOptions(redundancy=Replicas(0)), **FAST),
      persistent=str(tmp_path / "orbax"))
  (event,) = trainer.events
  assert event.source == "persistent" and event.restored_step == 4
  assert any("leaf 'tp'" in n for n in event.notes), event.notes
  assert_bitwise_equal(saved[8], final)


def test_snapshotter_keeps_single_device_leaves_and_keys(slices, store_dir):
  from orbax.checkpoint.experimental.v1.training.pathways import Snapshotter as Orbax
  single = make_state(jax.devices(), 3)["single"]
  with pytest.raises(AttributeError, match="mesh"):  # Orbax's own cannot save it
    Orbax().save(3, {"single": single})
  s2d, _, _ = slices
  snap = Snapshotter(options=SnapshotOptions(store=Auto(dir=store_dir), keep=1), slices=s2d)
  state = make_state(jax.devices(), 3)
  expected = host_copy(state)
  snap.save(3, state)
  snap.join()
  assert snap.latest.step == 3
  restored = snap.load(abstract(jax.devices()))
  assert_bitwise_equal(expected, restored)
  assert is_single_device_sharding(restored["single"].sharding)
  snap.close()


def test_a_load_into_numpy_leaves_every_slice_active(slices, store_dir):
  """A state loaded into numpy arrays lives on no slice: the next save of a
  state on both slices still works (it raised: no slice was left active)."""
  s2d, _, _ = slices
  snap = Snapshotter(options=SnapshotOptions(store=Auto(dir=store_dir), keep=2), slices=s2d)
  mesh = jax.make_mesh((2, 4), ("r", "m"))
  state = {"w": jax.device_put(jnp.arange(64, dtype=jnp.float32).reshape(8, 8),
                               NamedSharding(mesh, P("r", "m")))}
  snap.save(1, state)
  snap.join()
  got = snap.load({"w": np.zeros((8, 8), np.float32)})
  assert_bitwise_equal(host_copy(state), got)
  state = {"w": state["w"] + 1}
  snap.save(2, state)
  snap.join()
  assert snap.latest.step == 2
  assert_bitwise_equal(host_copy(state), snap.load(jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)))
  snap.close()


@pytest.mark.parametrize("store", ["pinned_host", "host_files"])
def test_save_never_drops_a_step_silently(store, store_dir, monkeypatch):
  from snapstore._backends import _copy
  from snapstore._backends.pinned import capture as _pinned_capture
  slow = threading.Event()
  real_drain, real_wait = _copy.drain, _pinned_capture.PinnedCapture.wait

  def slow_drain(*a, **k):
    slow.wait(2)
    return real_drain(*a, **k)

  def slow_wait(self):
    slow.wait(2)
    return real_wait(self)
  monkeypatch.setattr(_copy, "drain", slow_drain)
  monkeypatch.setattr(_pinned_capture.PinnedCapture, "wait", slow_wait)
  devs = jax.devices()
  for policy in (BusyPolicy.SKIP, BusyPolicy.WAIT):
    value = PinnedHost() if store == "pinned_host" else HostFiles(dir=store_dir)
    snap = Snapshotter(options=SnapshotOptions(store=value, run_id=policy.value,
                                               keep=2, busy_policy=policy),
                       slices={0: devs[:4], 1: devs[4:]})
    snap.save(1, make_state(devs, 1))
    snap.save(2, make_state(devs, 2))  # the first is still draining
    slow.set()
    snap.join()
    m = snap.manager.metrics
    if policy is BusyPolicy.SKIP:
      assert (m.skipped_busy, m.snapshots_committed, snap.latest.step) == (1, 1, 1)
    else:
      assert (m.waited_busy, m.snapshots_committed, snap.latest.step) == (1, 2, 2)
    snap.close()
    slow.clear()


def test_pathwaysutils_workload_runs_with_snapstore_snapshotter(slices, store_dir):
  from pathwaysutils.extras.simple_model import config, workload
  s2d, lose, reconnect = slices
  snap = Snapshotter(options=SnapshotOptions(store=Auto(dir=store_dir), keep=1), slices=s2d)
  cfg = config.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_heads=2,
                           head_dim=16, num_layers=1, per_device_batch_size=1, seq_len=8)
  w = workload.Workload(config=cfg, devices=jax.devices(), devices_per_slice=4,
                        total_steps=3, snapshot_interval=1, snapshotter=snap)
  w.run()
  expected = host_copy(w.params)
  lose(1)
  with pytest.raises(jax.errors.JaxRuntimeError, match="DATA_LOSS"):
    np.asarray(jax.tree.leaves(w.params)[0])
  snap.manager.forget_domains([1], "slice lost")
  reconnect(1)
  w.restore_from_snapshot()
  assert snap.last_restore.step == 3
  assert_bitwise_equal(expected, w.params)
  w.close()
  snap.close()


def test_maxtext_config_mapping_and_hook(store_dir, tmp_path):
  from snapstore.integrations.maxtext import SnapshotHook, options_from_config
  config = {"run_name": "mt", "snapshot_interval": 2, "snapshot_keep": 3,
            "snapshot_store_dir": str(store_dir), "checkpoint_period": 4,
            "enable_checkpointing": True, "base_output_directory": str(tmp_path),
            "elastic_min_slice_count": 1, "elastic_max_retries": 5}
  snap, elastic, persistent = options_from_config(config)
  assert (snap.interval, snap.keep, snap.run_id, snap.persistent_interval) == (
      Every(2), 3, "mt", 4)
  assert (elastic.elastic_min_slice_count, elastic.elastic_max_retries) == (1, 5)
  assert elastic.snapshots == snap
  assert persistent == f"{tmp_path}/mt/checkpoints"
  devs = jax.devices()
  hook = SnapshotHook.from_config(config)
  state, start = hook.restore_or(lambda: make_state(devs, 0), abstract(devs))
  assert start == 0
  for step in range(1, 6):
    state = make_state(devs, step)
    hook.on_step(step, state)
  hook.close()
  hook = SnapshotHook.from_config(config)  # a restart
  state, start = hook.restore_or(lambda: None, abstract(devs))
  assert start == 5 and hook.last_restore.source.value == "snapshot"  # step 4
  assert_bitwise_equal(host_copy(make_state(devs, 4)), state)
  hook.close()


def test_a_store_that_raises_on_read_is_a_lost_domain(store_dir, monkeypatch):
  """On Pathways, reading a lost slice's pinned arrays raises DATA_LOSS.
  A restore that meets that from one slice's store forgets the slice (as an
  elastic event would) and plans again from the other: the step restores
  bitwise from the cross-slice copies, and the raising store is read no more.
  Slice 0's store raises: the planner reads it first."""
  from snapstore import SnapshotManager
  from snapstore._backends.pinned.store import PinnedHostStore
  devs = jax.devices()
  s2d = {0: devs[:4], 1: devs[4:]}
  with SnapshotManager(SnapshotOptions(store=Auto(dir=store_dir), run_id="raising", keep=2),
                       slices=s2d) as mgr:
    for step in (1, 2):
      state = make_state(devs, step)
      mgr.save(step, state)
    mgr.wait_until_finished()
    expected = host_copy(state)
    dead = mgr._backend.stores[0]
    reads = []
    real_part = PinnedHostStore.part

    def part(self, slot, position):
      if self is dead:
        reads.append((slot, position))
        raise jax.errors.JaxRuntimeError("DATA_LOSS: Simulated device loss error")
      return real_part(self, slot, position)
    monkeypatch.setattr(PinnedHostStore, "part", part)
    r = mgr.restore(abstract(devs))
    assert reads, "the test must make the restore read slice 0's store"
    assert r.step == 2 and r.source.value == "snapshot" and r.rewind_steps == 0
    assert_bitwise_equal(expected, r.state)
    assert any("domains [0] raised on read" in n for n in r.notes), r.notes
    assert dead.manifests() == []  # forgotten: a later plan never reads it
    n = len(reads)
    again = mgr.restore(abstract(devs))
    assert again.step == 2 and len(reads) == n
    assert_bitwise_equal(expected, again.state)
    # Slice 0 is still in the mesh (up or not is the elastic manager's to
    # say): the next snapshot goes to it again, and restores from it.
    monkeypatch.setattr(PinnedHostStore, "part", real_part)
    state = make_state(devs, 3)
    assert mgr.save(3, state)
    mgr.wait_until_finished()
    assert {m.step for m in dead.manifests()} == {3}
    third = mgr.restore(abstract(devs))
    assert third.step == 3
    assert_bitwise_equal(host_copy(state), third.state)


def test_an_elastic_retry_deletes_no_snapshot(slices, store_dir, monkeypatch):
  """pathwaysutils 0.1.5-0.1.11 deleted every live jax.Array on each elastic
  event, pinned_host snapshots included, and 0.1.13 keeps an uncalled
  ``Manager._cleanup_on_retry`` that would do the same. A pinned_host array
  made before a real retry of the installed pathwaysutils is still alive
  after it, and that method was never called; called, it deletes the array
  (so this check is one a future pathwaysutils can fail)."""
  _, lose, _ = slices
  devs = jax.devices()
  pinned = NamedSharding(jax.sharding.Mesh(np.array(devs), ("d",)), P("d"),
                         memory_kind="pinned_host")
  sentinel = jax.device_put(jnp.arange(len(devs) * 4, dtype=jnp.float32), pinned)
  calls = []
  real = Manager._cleanup_on_retry
  monkeypatch.setattr(Manager, "_cleanup_on_retry",
                      lambda self: (calls.append(1), real(self))[1])
  trainer, saved, _, final = run_elastic(store_dir, lose, ElasticOptions(**FAST))
  assert trainer.events and trainer.events[0].source == "snapshot"
  assert calls == [] and not sentinel.is_deleted()
  assert_bitwise_equal(saved[8], final)
  # Called, it deletes the live arrays: here only the sentinel (every live
  # array of the test process would take other tests' arrays with it).
  monkeypatch.setattr(jax, "live_arrays", lambda: [sentinel])
  monkeypatch.setattr(jax, "clear_caches", lambda: None)
  Manager._cleanup_on_retry(trainer.elastic)
  assert calls == [1] and sentinel.is_deleted()


def test_a_pathwaysutils_that_deletes_snapshots_is_refused(monkeypatch):
  from importlib import metadata

  from snapstore.integrations import pathways
  monkeypatch.setattr(metadata, "version", lambda name: "0.1.11")
  with pytest.raises(RuntimeError, match=r"pathwaysutils 0.1.11 deletes every live "
                                         r"jax.Array.*>= 0.1.13"):
    pathways.check_pathwaysutils()
