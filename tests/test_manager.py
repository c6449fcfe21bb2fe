"""SnapshotManager on one host (8 CPU devices): round trips, donation, resume."""

import gc
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import snapstore
from tests.helpers import assert_bitwise_equal, host_copy, opts, shardings


def mixed_state(trainer):
  state = trainer.init_state()
  state["single"] = jax.device_put(jnp.arange(10, dtype=jnp.bfloat16), jax.devices()[5])
  state["keys"] = jax.random.split(jax.random.key(7), 3)
  state["np"] = np.arange(6, dtype=np.int16).reshape(2, 3)
  state["np_scalar"] = np.float32(1.5)
  state["count"] = 17
  state["lr"] = 0.25
  state["flag"] = True
  state["name"] = "run"
  return state


def test_round_trip_is_bitwise_for_every_leaf_kind(trainer, store_dir):
  state = mixed_state(trainer)
  extra = {"data": {"epoch": 1, "position": 12345}, "blob": b"\x00\x01"}
  with snapstore.SnapshotManager(opts(store_dir)) as mgr:
    assert mgr.save(3, state, extra=extra)
    mgr.wait_until_finished()
    result = mgr.restore(state)
  assert result.step == 3 and result.source is snapstore.Source.SNAPSHOT
  assert result.rewind_steps == 0
  assert result.extra == extra
  assert_bitwise_equal(state, result.state)
  assert shardings(result.state) == shardings(state)
  assert isinstance(result.state["np"], np.ndarray)
  assert isinstance(result.state["np_scalar"], np.float32)


def test_replicated_shards_are_stored_once(trainer, store_dir):
  mesh = trainer.mesh
  rep = jax.device_put(jnp.ones((1024,), jnp.float32),
                       jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
  with snapstore.SnapshotManager(opts(store_dir)) as mgr:
    mgr.save(0, {"rep": rep})
    mgr.wait_until_finished()
    assert mgr.metrics.bytes_snapshotted == 4096


def test_abstract_state_restores_onto_its_sharding(trainer, store_dir):
  state = trainer.init_state()
  with snapstore.SnapshotManager(opts(store_dir)) as mgr:
    mgr.save(1, state)
    result = mgr.restore(trainer.abstract_state())
  assert_bitwise_equal(state, result.state)
  assert shardings(result.state) == shardings(state)


def test_donating_step_after_save_does_not_change_the_snapshot(trainer, store_dir):
  state = trainer.init_state()
  state, _ = trainer.step(state, 0)
  expected = host_copy(state)
  with snapstore.SnapshotManager(opts(store_dir, keep=1)) as mgr:
    mgr.save(1, state)
    for s in range(2, 5):  # donates `state`'s buffers right away
      state, _ = trainer.step(state, s)
    result = mgr.restore(trainer.abstract_state(), step=1)
  assert_bitwise_equal(expected, result.state)
  assert not np.array_equal(expected["rng"], host_copy(state)["rng"])


def test_restores_share_no_memory_with_a_state_still_alive(trainer, store_dir):
  """Restored arrays may adopt the restore's host memory, which the next
  restore reuses once nothing uses it (._arena): restoring again while an
  earlier restored state is alive leaves that state bitwise as it was."""
  state = trainer.init_state()
  states = {}
  with snapstore.SnapshotManager(opts(store_dir, keep=3)) as mgr:
    for s in (1, 2, 3):
      state, _ = trainer.step(state, s)
      states[s] = host_copy(state)
      mgr.save(s, state)
    mgr.wait_until_finished()
    first = mgr.restore(trainer.abstract_state(), step=1).state
    second = mgr.restore(trainer.abstract_state(), step=2).state
    third = mgr.restore(trainer.abstract_state(), step=3).state
    for s, got in zip((1, 2, 3), (first, second, third), strict=True):
      assert_bitwise_equal(states[s], got)
    del first, second, third, got
    gc.collect()  # jaxlib's deferred releases of the adopted buffers
    mgr.save(4, state)
    mgr.wait_until_finished()
    # prefault_restore (the default): kept in place, the next restore faults nothing in
    again = mgr.restore(trainer.abstract_state(), step=4)
    assert again.timings["first_touch"] == 0, again.timings
    assert_bitwise_equal(states[3], again.state)


def test_without_prefault_idle_restore_memory_is_given_to_the_kernel(trainer, store_dir):
  """``prefault_restore=False``: once nothing uses the last restore's
  memory, the next snapshot hands it to the kernel (MADV_FREE): it may
  take the pages back, and the next restore faults them in again."""
  state = trainer.init_state()
  with snapstore.SnapshotManager(opts(store_dir, prefault_restore=False)) as mgr:
    mgr.save(1, state)
    mgr.wait_until_finished()
    del_me = mgr.restore(trainer.abstract_state()).state
    del del_me
    gc.collect()
    assert not mgr._arenas._lazy
    mgr.save(2, state)
    mgr.wait_until_finished()
    assert mgr._arenas._lazy
    r = mgr.restore(trainer.abstract_state())
  assert_bitwise_equal(host_copy(state), r.state)


def _arenas_made(monkeypatch) -> list[int]:
  from snapstore import _arena
  made: list[int] = []
  fresh = _arena._mapping
  monkeypatch.setattr(_arena, "_mapping", lambda n: made.append(n) or fresh(n))
  return made


def test_restore_memory_is_faulted_in_ahead_once_a_snapshot_commits(trainer, store_dir,
                                                                    monkeypatch):
  """The first restore of a process copies into memory faulted in ahead, on
  a background thread, after the first snapshot committed (no fresh memory
  on the recovery's path); the second snapshot makes none."""
  state = trainer.init_state()
  made = _arenas_made(monkeypatch)
  with snapstore.SnapshotManager(opts(store_dir, keep=1)) as mgr:
    assert mgr._saver.prefaulting is None  # an empty store: nothing to restore yet
    mgr.save(1, state)
    mgr.wait_until_finished()
    mgr._saver.prefaulting.join()
    (ahead,) = made
    own = snapstore._planner.own_bytes(mgr._backend.manifests())
    shards = {(i, str(sh.index)): sh.data.nbytes  # each distinct shard: a piece
              for i, x in enumerate(jax.tree.leaves(state)) for sh in x.addressable_shards}
    assert ahead == own == sum(-(-n // 4096) * 4096 for n in shards.values())
    mgr.save(2, state)
    mgr.wait_until_finished()
    r = mgr.restore(trainer.abstract_state())
    assert made == [ahead]  # the restore took the memory made ahead
  assert_bitwise_equal(host_copy(state), r.state)


def test_a_manager_on_a_store_with_a_snapshot_faults_restore_memory_in_at_start(
    trainer, store_dir, monkeypatch):
  """A restarted process: its manager starts on a store that holds a
  snapshot, so a restore is coming; its memory is faulted in meanwhile.
  ``prefault_restore=False``: none until the restore takes it. (A restarted
  process has no memory of an earlier manager to reuse: none is kept here.)"""
  from snapstore import _arena
  monkeypatch.setattr(_arena, "SPARE_SECONDS", 0)
  state = trainer.init_state()
  with snapstore.SnapshotManager(opts(store_dir)) as mgr:
    mgr.save(1, state)
  made = _arenas_made(monkeypatch)
  with snapstore.SnapshotManager(opts(store_dir, prefault_restore=False)) as mgr:
    assert mgr._saver.prefaulting is None and made == []
  with snapstore.SnapshotManager(opts(store_dir)) as mgr:
    mgr._saver.prefaulting.join()
    assert len(made) == 1
    r = mgr.restore(trainer.abstract_state())
    assert len(made) == 1
  assert_bitwise_equal(host_copy(state), r.state)


def test_restore_and_save_metrics_split_the_first_touch_of_fresh_memory(
    trainer, store_dir):
  """What a recovery paid for first use: a restore into fresh memory reports
  the time spent faulting it in (``timings["first_touch"]``, part of the
  total); the next restore, into the memory the first one left, reports
  none. A manager's first snapshot faults its slot in, in its drain
  (counted in ``metrics.first_touch_seconds``); the next slot is made ahead
  between saves (tests/test_slots.py), so the second drain adds at most what
  the maker had no time for; later ones, into the same slots, add nothing."""
  state = trainer.init_state()
  with snapstore.SnapshotManager(opts(store_dir, keep=1, prefault_restore=False)) as mgr:
    touched = []
    for step in (1, 2, 3, 4):
      mgr.save(step, state)
      mgr.wait_until_finished()
      touched.append(mgr.metrics.first_touch_seconds)
    assert 0 < touched[0] <= touched[1] == touched[2] == touched[3], touched
    first = mgr.restore(trainer.abstract_state())
    assert 0 < first.timings["first_touch"] <= first.timings["total"], first.timings
    assert_bitwise_equal(host_copy(state), first.state)
    del first
    gc.collect()
    second = mgr.restore(trainer.abstract_state())
    assert second.timings["first_touch"] == 0, second.timings
    assert_bitwise_equal(host_copy(state), second.state)


def test_a_prefault_runs_in_chunks_through_calls_that_release_the_gil(monkeypatch):
  """A prefault runs on a background thread while the training loop runs:
  each chunk goes through libc's madvise by ctypes (which lets go of the
  GIL; ``mmap.madvise`` does not), and a kernel without the advice gets a
  write a page instead."""
  import ctypes

  from snapstore import _arena
  if sys.platform == "linux":
    assert not _arena._MADVISE._flags_ & ctypes._FUNCFLAG_PYTHONAPI  # a CDLL call
  calls = []
  monkeypatch.setattr(_arena, "_MADVISE", lambda at, n, advice: calls.append((at, n)) or 0)
  chunk = _arena.POPULATE_CHUNK
  cache = _arena.ArenaCache()
  assert cache.prefault(3 * chunk + 4096)
  base = calls[0][0]
  assert [(at - base, n) for at, n in calls] == [(0, chunk), (chunk, chunk),
                                                 (2 * chunk, chunk), (3 * chunk, 4096)]
  assert cache.kept_bytes == 3 * chunk + 4096
  assert not cache.prefault(4096)  # one is kept already


def _resident_pages(arr: np.ndarray) -> int:
  """Pages of ``arr`` in RAM now (mincore(2))."""
  import ctypes
  import mmap
  libc = ctypes.CDLL(None, use_errno=True)
  count = -(-arr.nbytes // mmap.PAGESIZE)
  vec = (ctypes.c_ubyte * count)()
  assert libc.mincore(ctypes.c_void_p(arr.ctypes.data), ctypes.c_size_t(arr.nbytes), vec) == 0
  return sum(v & 1 for v in vec)


@pytest.mark.skipif(sys.platform != "linux", reason="mincore and MADV_POPULATE_WRITE: Linux")
@pytest.mark.parametrize("kernel", ["populate", "old"])
def test_a_prefault_leaves_every_page_of_the_arena_resident(kernel, monkeypatch):
  """What a restore then takes is in RAM already: with MADV_POPULATE_WRITE,
  and on a kernel without it (the advice fails: a write a page). Fresh
  memory is not (the control)."""
  import mmap

  from snapstore import _arena
  if kernel == "old":
    monkeypatch.setattr(_arena, "_MADVISE", lambda at, n, advice: -1)  # EINVAL
  nbytes = 2 * _arena.POPULATE_CHUNK + 3 * mmap.PAGESIZE
  assert _resident_pages(_arena.host_arena(nbytes)) == 0
  cache = _arena.ArenaCache()
  assert cache.prefault(nbytes)
  assert _resident_pages(cache.take(nbytes)) == nbytes // mmap.PAGESIZE


def test_a_restore_does_not_wait_for_a_whole_prefault(monkeypatch):
  """A take (a restore) that comes while a prefault runs stops it after the
  chunk under way and gets that arena, however much of it was faulted in;
  the take faults in the whole arena itself (every core at once)."""
  from snapstore import _arena
  cache = _arena.ArenaCache()
  got = {}

  def taker() -> None:
    got["arena"] = cache.take(4 * _arena.POPULATE_CHUNK)
  calls, taken = [], []

  main = threading.current_thread()

  def madvise(at, n, advice):  # the first chunk: a restore arrives meanwhile
    if threading.current_thread() is not main:
      taken.append((at, n))
      return 0
    calls.append(at)
    if len(calls) == 1:
      got["thread"] = threading.Thread(target=taker)
      got["thread"].start()
      while not cache._wanted.is_set():
        time.sleep(0.001)
    return 0
  monkeypatch.setattr(_arena, "_MADVISE", madvise)
  made = _arenas_made(monkeypatch)
  assert cache.prefault(4 * _arena.POPULATE_CHUNK)
  got["thread"].join()
  assert len(calls) == 1 and len(made) == 1  # stopped; the same arena taken
  assert got["arena"].ctypes.data == calls[0]
  base = calls[0]
  assert sorted((at - base, n) for at, n in taken) == [
      (k * _arena.POPULATE_CHUNK, _arena.POPULATE_CHUNK) for k in range(4)]


def test_trimming_and_closing_do_not_wait_for_a_prefault(monkeypatch):
  """A drain trims the arena after every snapshot and must not wait for a
  prefault under way (the next save would wait for that drain); closing
  stops a prefault after the chunk under way."""
  from snapstore import _arena
  started, go = threading.Event(), threading.Event()
  calls = []

  def madvise(at, n, advice):  # a slow chunk: the kernel compacting memory
    calls.append(at)
    started.set()
    go.wait()
    return 0
  monkeypatch.setattr(_arena, "_MADVISE", madvise)
  cache = _arena.ArenaCache()
  worker = threading.Thread(target=cache.prefault, args=(3 * _arena.POPULATE_CHUNK,))
  worker.start()
  started.wait()
  cache.trim()  # returns at once (else this test hangs: pytest-timeout)
  cache.interrupt()
  go.set()
  worker.join()
  assert len(calls) == 1 and cache.kept_bytes == 3 * _arena.POPULATE_CHUNK


def test_an_arena_is_reused_only_once_nothing_uses_it():
  """An array that adopted part of an arena keeps it from reuse: the next
  arena is other memory, and writing it leaves the array as it was; once
  nothing uses an arena, the next take is that same memory."""
  from snapstore._arena import ArenaCache
  cache = ArenaCache()
  a = cache.take(1 << 20)
  a[:] = 7
  adopted = jax.device_put(a[4096:8192].view(np.float32), jax.devices()[0], may_alias=True)
  aliased = np.asarray(adopted).ctypes.data == a.ctypes.data + 4096
  del a
  b = cache.take(1 << 20)
  b[:] = 9
  assert (np.asarray(adopted).view(np.uint8) == 7).all()
  assert aliased  # else this test shows nothing: device_put copied
  where = b.ctypes.data
  del adopted, b
  c = cache.take(1 << 19)  # idle, large enough: the same memory
  assert c.ctypes.data == where
  del c
  cache.release()
  assert cache.kept_bytes == 0


def test_resume_from_step_7_matches_uninterrupted_run(trainer, store_dir):
  state = trainer.init_state()
  losses = {}
  with snapstore.SnapshotManager(opts(store_dir, keep=4)) as mgr:
    for s in range(1, 11):
      state, loss = trainer.step(state, s)
      losses[s] = float(loss)
      mgr.save(s, state)
    final = host_copy(state)
    result = mgr.restore(trainer.abstract_state(), step=7)
  assert result.step == 7 and result.rewind_steps == 3
  state = result.state
  for s in range(8, 11):
    state, loss = trainer.step(state, s)
    assert float(loss) == losses[s], s
  assert_bitwise_equal(final, state)


def test_interval_and_non_snapshot_steps(trainer, store_dir):
  state = trainer.init_state()
  with snapstore.SnapshotManager(opts(store_dir, interval=snapstore.Every(3), keep=5)) as mgr:
    took = [mgr.save(s, state) for s in range(7)]
    mgr.wait_until_finished()
    assert took == [True, False, False, True, False, False, True]
    assert mgr.snapshot_steps() == [0, 3, 6]
    assert mgr.latest_step() == 6


def test_bad_arguments_raise_clear_errors(trainer, store_dir):
  with pytest.raises(ValueError, match=r"Every\.steps"):
    snapstore.SnapshotOptions(interval=snapstore.Every(0))
  with pytest.raises(ValueError, match="run_id"):
    snapstore.SnapshotOptions(run_id="../etc")
  with snapstore.SnapshotManager(opts(store_dir)) as mgr:
    with pytest.raises(ValueError, match="step"):
      mgr.save(-1, {"a": np.zeros(2)})
    with pytest.raises(snapstore.UnsupportedExtraError, match="msgpack"):
      mgr.save(0, {"a": np.zeros(2)}, extra={"x": object()})
    with pytest.raises(TypeError, match="unsupported type"):
      mgr.save(0, {"a": object()})
    with pytest.raises(snapstore.NothingToRestoreError, match="Nothing was deleted"):
      mgr.restore({"a": np.zeros(2)})


def test_extra_and_strings_too_big_for_a_manifest_are_refused_and_lose_nothing(store_dir):
  """A manifest over the 64 MiB every reader accepts would be committed by
  its writer and refused by every restore; retention would then delete the
  steps that can be read. ``save`` refuses it first, the steps kept stay."""
  state = {"a": np.arange(4.0)}
  with snapstore.SnapshotManager(opts(store_dir, keep=1)) as mgr:
    mgr.save(1, state, extra={"it": 1})
    mgr.wait_until_finished()
    with pytest.raises(snapstore.UnsupportedExtraError, match=r"extra \(\d+ bytes\)"):
      mgr.save(2, state, extra={"blob": b"x" * (33 << 20)})
    strings = {f"s{i}": "y" * (1 << 20) for i in range(33)}  # each within a leaf's 1 MiB
    with pytest.raises(snapstore.UnsupportedExtraError, match="strings"):
      mgr.save(3, {**state, **strings})
    mgr.wait_until_finished()
    assert mgr.snapshot_steps() == [1]
  with snapstore.SnapshotManager(opts(store_dir, keep=1)) as fresh:  # what a restart reads
    r = fresh.restore(state)
  assert r.step == 1 and r.extra == {"it": 1}


def test_a_manifest_over_the_limit_is_never_written():
  from snapstore import _manifest
  m = _manifest.Manifest(
      run_id="r", incarnation=0, step=7, store=0, num_hosts=1, tree_digest="d", slot=0,
      chunk_bytes=1 << 20, leaves=(), pieces=(), scalars={},
      extra={"blob": b"z" * (_manifest.MAX_MANIFEST_BYTES + 1)})
  with pytest.raises(snapstore.UnsupportedExtraError, match="step 7: a manifest of"):
    _manifest.encode(m)


@pytest.mark.parametrize("interval", [0.0005, None])
def test_a_drain_lowers_the_switch_interval_and_puts_it_back(trainer, store_dir, interval):
  """The drain's Python must not hold the training loop for CPython's 5 ms
  at a time: while a drain runs the switch interval is the option's."""
  import sys

  before = sys.getswitchinterval()
  seen = []
  with snapstore.SnapshotManager(opts(store_dir, drain_switch_interval_s=interval)) as mgr:
    drain = mgr._backend.drain
    mgr._backend.drain = lambda p: (seen.append(sys.getswitchinterval()), drain(p))[1]
    mgr.save(1, trainer.init_state())
    mgr.wait_until_finished()
    assert sys.getswitchinterval() == before
  assert seen == [pytest.approx(before if interval is None else interval)]


@pytest.mark.parametrize("pause", [True, False])
@pytest.mark.parametrize("enabled", [True, False])
def test_capture_and_drain_pause_the_collector_and_put_it_back(trainer, store_dir, pause,
                                                                enabled):
  """While a save captures and its drain runs, the cyclic collector is off
  (``pause_gc``); afterwards it is as the program had it."""
  import gc

  seen = []
  was = gc.isenabled()
  try:
    (gc.enable if enabled else gc.disable)()
    with snapstore.SnapshotManager(opts(store_dir, pause_gc=pause)) as mgr:
      capture, drain = mgr._backend.capture, mgr._backend.drain
      mgr._backend.capture = lambda *a, **k: (seen.append(gc.isenabled()), capture(*a, **k))[1]
      mgr._backend.drain = lambda p: (seen.append(gc.isenabled()), drain(p))[1]
      mgr.save(1, trainer.init_state())
      mgr.wait_until_finished()
      assert gc.isenabled() == enabled
    assert seen == [enabled and not pause] * 2
  finally:
    (gc.enable if was else gc.disable)()


@pytest.mark.parametrize("pause", [True, False])
@pytest.mark.parametrize("enabled", [True, False])
def test_restore_pauses_the_collector_while_it_reads_and_puts_it_back(trainer, store_dir,
                                                                       pause, enabled):
  """While a restore assembles a snapshot, the cyclic collector is off
  (``pause_gc``); afterwards, restored or not, it is as the program had it."""
  import gc

  seen = []
  was = gc.isenabled()
  try:
    (gc.enable if enabled else gc.disable)()
    with snapstore.SnapshotManager(opts(store_dir, pause_gc=pause)) as mgr:
      state = trainer.init_state()
      mgr.save(1, state)
      mgr.wait_until_finished()
      assemble = mgr._peers.assemble
      mgr._peers.assemble = lambda *a: (seen.append(gc.isenabled()), assemble(*a))[1]
      got = mgr.restore(trainer.abstract_state())
      assert gc.isenabled() == enabled
      assert_bitwise_equal(state, got.state)
      with pytest.raises(snapstore.StepNotFoundError):
        mgr.restore(trainer.abstract_state(), step=7)
      assert gc.isenabled() == enabled
    assert seen == [enabled and not pause]
  finally:
    (gc.enable if was else gc.disable)()


def test_the_collector_pause_is_shared_and_never_undoes_another_change():
  import gc

  from snapstore import _switch

  was = gc.isenabled()
  try:
    gc.enable()
    with _switch.collections_paused():
      with _switch.collections_paused():  # the drain of a save meanwhile
        assert not gc.isenabled()
      assert not gc.isenabled()  # the first still runs
    assert gc.isenabled()
    with _switch.collections_paused():
      gc.enable()  # the program's own choice, made meanwhile
    assert gc.isenabled()
    gc.disable()
    with _switch.collections_paused():
      pass
    assert not gc.isenabled()  # off before: left off
  finally:
    (gc.enable if was else gc.disable)()


def test_the_switch_interval_is_shared_by_drains_and_never_undoes_another_change():
  import sys

  from snapstore import _switch

  before = sys.getswitchinterval()
  try:
    with _switch.lowered(0.0005):
      with _switch.lowered(0.0005):  # a second manager's drain meanwhile
        assert sys.getswitchinterval() == pytest.approx(0.0005)
      assert sys.getswitchinterval() == pytest.approx(0.0005)  # the first still runs
    assert sys.getswitchinterval() == before
    with _switch.lowered(0.0005):
      sys.setswitchinterval(0.002)  # the program's own choice, made meanwhile
    assert sys.getswitchinterval() == pytest.approx(0.002)
  finally:
    sys.setswitchinterval(before)


def test_memory_let_go_of_is_reused_by_a_new_arena_and_only_when_idle(monkeypatch):
  """A closed manager's idle memory is kept a while (MADV_FREE) and a new
  arena in the process takes it: the same memory, faulted in already. An
  arena still in use when let go of is never handed out again (its user's
  bytes stay as they were); with SPARE_SECONDS 0, or once it expired,
  nothing is kept."""
  from snapstore import _arena
  first = _arena.ArenaCache()
  a = first.take(1 << 20)
  where = a.ctypes.data
  del a
  first.release()
  assert _arena.spare_bytes() >= 1 << 20
  second = _arena.ArenaCache()
  b = second.take(1 << 20)
  assert b.ctypes.data == where and _arena.spare_bytes() == 0
  b[:] = 5
  second.release()  # b still uses it: not kept
  assert _arena.spare_bytes() == 0
  third = _arena.ArenaCache()
  c = third.take(1 << 20)
  c[:] = 6
  assert c.ctypes.data != where and (b == 5).all()
  del c
  third.release()
  assert _arena.spare_bytes() >= 1 << 20
  _arena.expire_spares(now=time.monotonic() + _arena.SPARE_SECONDS)
  assert _arena.spare_bytes() == 0
  monkeypatch.setattr(_arena, "SPARE_SECONDS", 0)
  fourth = _arena.ArenaCache()
  d = fourth.take(1 << 20)
  del d
  fourth.release()
  assert _arena.spare_bytes() == 0


def test_memory_a_closed_pinned_manager_lets_go_of_never_holds_a_live_state():
  """A restored state adopts restore memory; closing its manager (and
  wiping its slices' stores) gives the idle memory to the spare pool but
  not what the state uses: new arenas that take every spare and write it
  leave the state bitwise as restored."""
  from snapstore import _arena
  from tests.helpers import slice_abstract as abstract, slice_state as make_state
  devs = jax.devices()
  state = make_state(devs, 3)
  expected = host_copy(state)
  with snapstore.SnapshotManager(snapstore.SnapshotOptions(keep=1, run_id="spares"),
                                 slices={0: devs[:4], 1: devs[4:]}) as mgr:
    assert mgr.store == snapstore.PinnedHost()
    mgr.save(3, state)
    mgr.wait_until_finished()
    restored = mgr.restore(abstract(devs)).state
  assert _arena.spare_bytes() > 0  # the slots' memory
  taken = []
  while _arena._spares:
    n = len(_arena._spares[0][1])
    arena = _arena.ArenaCache()
    got = arena.take(n)
    got[:] = 0xFF
    taken.append((arena, got))
  assert_bitwise_equal(expected, restored)


def test_one_thread_reaps_every_spare_and_ends_when_none_is_left(monkeypatch):
  """However many mappings are let go of, one thread unmaps them when their
  time is up, and it ends when none is left (no thread per mapping)."""
  from snapstore import _arena
  monkeypatch.setattr(_arena, "SPARE_SECONDS", 30.0)  # none expires before the checks
  before = threading.active_count()
  caches = [_arena.ArenaCache() for _ in range(8)]
  held = [cache.take(1 << 16) for cache in caches]  # eight distinct mappings
  del held
  for cache in caches:
    cache.release()
  assert _arena.spare_bytes() >= 8 << 16
  assert threading.active_count() <= before + 1
  reaper = _arena._reaper
  assert reaper is not None
  monkeypatch.setattr(_arena, "SPARE_SECONDS", 0.01)  # the reaper re-reads it within 1 s
  reaper.join(timeout=10)
  assert not reaper.is_alive() and _arena.spare_bytes() == 0
