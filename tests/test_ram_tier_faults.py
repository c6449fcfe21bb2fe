"""A RAM tier that fails never ends training (unless asked), never leaves a
file whose pages may not exist, and never rewrites a file someone else
links to (one host, 8 CPU devices; allocation failures injected where the
kernel would report them: ``posix_fallocate``)."""

import errno
import os
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import snapstore
from snapstore._backends.hostfiles import store as store_mod
from tests.helpers import assert_bitwise_equal, host_copy, only_store, opts


def state_at(step, rows=16):
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("d",))
  return {"w": jax.device_put(jnp.arange(rows * 8, dtype=jnp.float32).reshape(rows, 8) + step,
                              NamedSharding(mesh, P("d")))}


def abstract(rows=16):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                      state_at(0, rows))


@pytest.fixture
def no_room(monkeypatch):
  """posix_fallocate fails as on a full RAM disk, once armed."""
  real = os.posix_fallocate
  armed = []

  def fallocate(fd, offset, length):
    if armed:
      raise OSError(errno.ENOSPC, "No space left on device")
    return real(fd, offset, length)
  monkeypatch.setattr(store_mod.os, "posix_fallocate", fallocate)
  return armed


def test_a_full_ram_disk_later_in_the_run_is_counted_and_training_goes_on(store_dir, no_room):
  with snapstore.SnapshotManager(opts(store_dir)) as mgr:
    assert mgr.save(1, state_at(1))
    mgr.wait_until_finished()
    no_room.append(1)  # the disk fills, and the state grows (a new slot size)
    only_store(mgr)._ahead.discard()  # (and the slot made ahead is not there)
    assert mgr.save(2, state_at(2, rows=64))  # (its slot is made in the drain)
    assert mgr.wait_until_finished() is False
    assert mgr.metrics.store_failures == 1
    assert "no room for a slot" in mgr.metrics.last_store_failure
    assert not [p for p in only_store(mgr).root.glob("slot-*.bin")
                if os.stat(p).st_blocks * 512 < os.stat(p).st_size]  # no sparse file left
    no_room.clear()
    assert mgr.save(3, state_at(3, rows=64))  # room again: snapshots resume
    mgr.wait_until_finished()
    r = mgr.restore(abstract(64))
  assert r.step == 3
  assert_bitwise_equal(host_copy(state_at(3, rows=64)), r.state)


def test_the_raising_policy_raises_the_first_failure_naming_the_space(store_dir, no_room):
  o = opts(store_dir, failure_policy=snapstore.FailurePolicy.RAISE)
  with snapstore.SnapshotManager(o) as mgr:
    mgr.save(1, state_at(1))
    mgr.wait_until_finished()
    no_room.append(1)
    only_store(mgr)._ahead.discard()
    mgr.save(2, state_at(2, rows=64))
    with pytest.raises(snapstore.DrainFailedError, match="no room for a slot of") as e:
      mgr.wait_until_finished()
    assert isinstance(e.value.__cause__, snapstore.BudgetExceededError)
    no_room.clear()
    assert mgr.restore(abstract()).step == 1


@pytest.mark.parametrize("policy", list(snapstore.FailurePolicy))
def test_a_first_save_that_cannot_fit_raises_under_either_policy(store_dir, monkeypatch,
                                                                   policy):
  """A state bigger than the RAM disk's free room: a misconfiguration, raised
  by the save that finds it (before any file is made)."""
  monkeypatch.setattr(store_mod.shutil, "disk_usage",
                      lambda path: shutil._ntuple_diskusage(1 << 30, 1 << 30, 4096))
  with snapstore.SnapshotManager(opts(store_dir, failure_policy=policy)) as mgr:
    with pytest.raises(snapstore.BudgetExceededError, match="does not fit in the 4096 free"):
      mgr.save(1, state_at(1))
    assert list(only_store(mgr).root.glob("slot-*.bin")) == []


def test_a_first_slot_the_disk_refuses_after_all_fails_its_drain(store_dir, no_room):
  """Room reported, yet none when the drain makes the slot (the disk filled
  meanwhile): that snapshot fails like any drain (counted under CONTINUE),
  no file is left, and the next save, with room again, commits."""
  with snapstore.SnapshotManager(opts(store_dir)) as mgr:
    no_room.append(1)
    assert mgr.save(1, state_at(1))
    assert mgr.wait_until_finished() is False
    assert "no room for a slot" in mgr.metrics.last_store_failure
    assert list(only_store(mgr).root.glob("slot-*.bin")) == []
    no_room.clear()
    assert mgr.save(2, state_at(2))
    assert mgr.wait_until_finished()


def test_a_failed_drain_is_counted_at_the_next_save_which_still_snapshots(store_dir):
  with snapstore.SnapshotManager(opts(store_dir)) as mgr:
    mgr.save(1, state_at(1))
    mgr.wait_until_finished()
    drain = mgr._backend.drain

    def fail(pending):
      raise OSError("the RAM disk went away")
    mgr._backend.drain = fail
    mgr.save(2, state_at(2))
    mgr._saver.inflight.exception()  # (the drain has failed)
    mgr._backend.drain = drain
    assert mgr.save(3, state_at(3))  # the failure is counted, step 3 is snapshotted
    assert mgr.metrics.store_failures == 1 and "went away" in mgr.metrics.last_store_failure
    mgr.wait_until_finished()
    r = mgr.restore(abstract())
  assert r.step == 3
  assert_bitwise_equal(host_copy(state_at(3)), r.state)


def test_a_sparse_slot_left_by_a_cut_allocation_is_allocated_before_it_is_written(
    store_dir, no_room):
  with snapstore.SnapshotManager(opts(store_dir, keep=1)) as m:
    m.save(1, state_at(1))
    m.save(2, state_at(2))
    m.wait_until_finished()
    root = only_store(m).root
  for p in root.glob("slot-*.bin"):  # a full-size file with no pages (SIGKILL in fallocate)
    size = p.stat().st_size
    os.truncate(p, 0)
    os.truncate(p, size)
  with snapstore.SnapshotManager(opts(store_dir, keep=1)) as m:
    no_room.append(1)  # and no room to allocate it: an error, not a SIGBUS
    assert m.save(3, state_at(3)) is True  # (the capture reserves; the drain writes)
    assert m.wait_until_finished() is False  # failed, counted (FailurePolicy.CONTINUE)
    assert "no room for a slot" in m.metrics.last_store_failure
    no_room.clear()
    m.save(4, state_at(4))
    m.wait_until_finished()
    r = m.restore(abstract())
  assert r.step == 4
  assert_bitwise_equal(host_copy(state_at(4)), r.state)


def test_a_slot_file_with_another_link_is_replaced_never_rewritten(store_dir):
  with snapstore.SnapshotManager(opts(store_dir, keep=1)) as m:
    m.save(1, state_at(1))
    m.save(2, state_at(2))
    m.wait_until_finished()
    root = only_store(m).root
  backups = {}
  for p in root.glob("slot-*.bin"):  # a `cp -al` backup of the store, on the same disk
    link = p.with_name(p.name + ".backup")
    os.link(p, link)
    backups[link] = link.read_bytes()
  with snapstore.SnapshotManager(opts(store_dir, keep=1)) as m:
    for s in (3, 4, 5):
      m.save(s, state_at(s))
    m.wait_until_finished()
    r = m.restore(abstract())
  assert r.step == 5
  assert all(link.read_bytes() == data for link, data in backups.items())


def _worker(mode, where, **env):
  import subprocess
  import sys
  return subprocess.run([sys.executable, "-m", "tests._orbax_kill_worker", mode, str(where)],
                        env=dict(os.environ, **env), capture_output=True, timeout=300,
                        cwd=Path(__file__).parent.parent)


@pytest.mark.parametrize("wipe", [False, True], ids=["snapshot-wins", "older-orbax-wins"])
def test_a_kill_during_an_in_flight_orbax_save_never_restores_it(tmp_path, wipe):
  """A real SIGKILL right after step 10's async Orbax save of a 64 MB state
  is dispatched: that checkpoint is never committed (Orbax may or may not
  have made its temporary folder yet). The restore
  takes the RAM snapshot of step 9, or with the store wiped (a replaced
  machine) Orbax's committed step 5: bitwise the state saved there, never
  the torn step 10."""
  import json
  import shutil
  import signal
  killed = _worker("save", tmp_path, SNAPSTORE_FAULT="persistent@10")
  assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()[-2000:]
  assert "SIGKILL at persistent of step 10" in killed.stderr.decode()
  ckpt = tmp_path / "ckpt"
  assert not (ckpt / "10").is_dir(), "the save committed before the kill: state too small?"
  if wipe:
    shutil.rmtree(tmp_path / "store")
  done = _worker("restore", tmp_path)
  assert done.returncode == 0, done.stderr.decode()[-2000:]
  got = json.loads((tmp_path / "restored.json").read_text())
  assert got == ({"step": 5, "source": "persistent", "equal": True} if wipe else
                 {"step": 9, "source": "snapshot", "equal": True}), got
