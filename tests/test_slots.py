"""Host files' slots made ahead (snapstore/_backends/hostfiles/slots.py): a
save never makes a slot file; the drain makes the first, and the next ones
are made between saves on a thread of their own and taken whole."""

from __future__ import annotations

import errno
import os
import shutil
import threading

import numpy as np
import pytest

import snapstore
from snapstore import _arena
from snapstore._backends.hostfiles import slots
from snapstore._backends.hostfiles.slots import SlotMaker, ahead_name
from snapstore._backends.hostfiles.store import HostStore, host_dir
from tests.helpers import assert_bitwise_equal, host_copy, only_store, opts

AHEAD_NAME = ahead_name(os.getpid())


def _allocated(path: os.PathLike[str]) -> bool:
  st = os.stat(path)
  return st.st_blocks * 512 >= st.st_size > 0


def test_a_slot_made_ahead_is_taken_whole_and_renamed(tmp_path):
  maker = SlotMaker(tmp_path)
  maker.start(3 << 20)
  maker.wait()
  made = os.stat(tmp_path / AHEAD_NAME)
  assert _allocated(tmp_path / AHEAD_NAME) and maker.seconds > 0
  before = _arena.faulting_seconds()
  mm = maker.take(3 << 20, tmp_path / "slot-0.bin")
  assert _arena.faulting_seconds() == before  # nothing left to make
  assert mm is not None and len(mm) == 3 << 20
  assert os.stat(tmp_path / "slot-0.bin").st_ino == made.st_ino
  assert not (tmp_path / AHEAD_NAME).exists() and maker.size == 0


def test_a_slot_of_another_size_is_deleted_not_taken(tmp_path):
  maker = SlotMaker(tmp_path)
  maker.start(2 << 20)
  maker.wait()
  assert maker.take(4 << 20, tmp_path / "slot-0.bin") is None
  assert os.listdir(tmp_path) == []


def test_a_take_stops_the_maker_and_finishes_what_it_left(tmp_path, monkeypatch):
  """The maker stops after the chunk under way when a save needs the slot;
  the taker allocates and faults in the rest (its own first-touch time)."""
  monkeypatch.setattr(slots, "ALLOCATE_CHUNK", 1 << 20)
  maker = SlotMaker(tmp_path)
  calls: list[str] = []
  real = os.posix_fallocate
  entered = threading.Event()

  def fallocate(fd: int, at: int, n: int) -> None:
    calls.append(threading.current_thread().name)
    if len(calls) == 1:
      entered.set()
      assert maker._stop.wait(60)  # the first chunk finishes after take() asked it to stop
    real(fd, at, n)
  monkeypatch.setattr(slots.os, "posix_fallocate", fallocate)
  maker.start(8 << 20)
  entered.wait(60)
  before = _arena.faulting_seconds()
  mm = maker.take(8 << 20, tmp_path / "slot-0.bin")
  assert mm is not None
  assert calls[0] == "snapstore-slot-ahead"
  assert calls[1:] == [threading.current_thread().name]  # the rest, here, in one call
  assert _arena.faulting_seconds() > before
  assert _allocated(tmp_path / "slot-0.bin")
  np.frombuffer(mm, np.uint8)[:] = 7  # every page mapped writable
  mm.close()


def test_a_take_faults_in_what_the_maker_left_from_where_it_stopped(tmp_path, monkeypatch):
  """Pages the maker faulted in are not walked again: the take goes on from
  the maker's offset (on every core)."""
  monkeypatch.setattr(_arena, "POPULATE_CHUNK", 1 << 20)
  real, resumed = _arena._populate, []

  def three_chunks(m, stop, start):  # the maker stops after three chunks
    seen: list[int] = []
    return real(m, lambda: len(seen) > 2 or bool(seen.append(1)) or stop(), start)
  monkeypatch.setattr(_arena, "_populate", three_chunks)
  monkeypatch.setattr(_arena, "_populate_now_timed",
                      lambda m, threads, start=0: resumed.append(start))
  maker = SlotMaker(tmp_path)
  maker.start(8 << 20)
  maker.wait()
  assert maker.take(8 << 20, tmp_path / "slot-0.bin") is not None
  assert resumed == [3 << 20]


def test_a_maker_that_fails_leaves_nothing_and_the_taker_makes_its_own(tmp_path, monkeypatch):
  def full(fd: int, at: int, n: int) -> None:
    raise OSError(errno.ENOSPC, "no space")
  monkeypatch.setattr(slots.os, "posix_fallocate", full)
  fds = len(os.listdir("/proc/self/fd"))
  maker = SlotMaker(tmp_path)
  maker.start(1 << 20)
  maker.wait()
  assert maker.refused == 1 << 20
  assert maker.take(1 << 20, tmp_path / "slot-0.bin") is None
  assert os.listdir(tmp_path) == [] and len(os.listdir("/proc/self/fd")) == fds


def test_a_take_never_replaces_a_file_already_there(tmp_path):
  (tmp_path / "slot-0.bin").write_bytes(b"another writer's")
  maker = SlotMaker(tmp_path)
  maker.start(1 << 20)
  assert maker.take(1 << 20, tmp_path / "slot-0.bin") is None
  assert (tmp_path / "slot-0.bin").read_bytes() == b"another writer's"
  assert os.listdir(tmp_path) == ["slot-0.bin"]


def _store(store_dir, keep=2, host=0) -> HostStore:
  return HostStore(host_dir(store_dir, "r", host), run_id="r", host=host, keep=keep,
                   budget_bytes=None)


def _free(monkeypatch, free: int) -> None:
  from snapstore._backends.hostfiles import store as store_mod
  monkeypatch.setattr(store_mod.shutil, "disk_usage",
                      lambda path: shutil._ntuple_diskusage(1 << 40, 1 << 40, free))


def test_a_slot_made_ahead_for_another_size_is_let_go_at_the_reserve(store_dir):
  """The state grew: the slot made for the old size is deleted before the
  room for the new one is checked (it would stand in its way)."""
  store = _store(store_dir)
  store.slot_buffer(store.reserve(1, 1 << 20))
  store.make_ahead()
  store._ahead.wait()
  assert (store.root / AHEAD_NAME).exists()
  store.reserve(2, 4 << 20)
  assert not (store.root / AHEAD_NAME).exists()


def test_what_is_allocated_ahead_counts_as_room_and_no_slot_is_made_without_room(
    store_dir, monkeypatch):
  store = _store(store_dir, keep=1)
  store.slot_buffer(store.reserve(1, 1 << 20))
  _free(monkeypatch, 0)
  store.make_ahead()  # no room: not even tried
  assert store._ahead.size == 0 and not (store.root / AHEAD_NAME).exists()
  monkeypatch.undo()
  store.make_ahead()
  store._ahead.wait()
  _free(monkeypatch, 0)
  commit_step(store, 1)
  slot = store.reserve(2, 1 << 20)  # the disk is full, but the slot is made already
  assert store.slot_buffer(slot).nbytes == 1 << 20


def commit_step(store: HostStore, step: int) -> None:
  """A manifest for ``step`` in slot 0 (so that the next reserve needs a new slot)."""
  from snapstore._manifest import Manifest
  store.commit(Manifest(run_id="r", incarnation=0, step=step, num_hosts=1, store=0, slot=0,
                        tree_digest="", chunk_bytes=1 << 20, leaves=(), pieces=[],
                        scalars={}))


def test_stores_of_several_domains_need_room_for_all_their_new_slots(store_dir, monkeypatch):
  a, b = _store(store_dir, host=0), _store(store_dir, host=1)
  _free(monkeypatch, 3 << 20)
  a.reserve(1, 2 << 20)
  b.reserve(1, 2 << 20)  # each fits alone
  with pytest.raises(snapstore.BudgetExceededError, match="2 stores need 4194304 bytes"):
    HostStore.check_room_for([a, b])


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded")
@pytest.mark.filterwarnings("ignore:os.fork\\(\\) was called")
def test_a_forked_child_leaves_the_parents_slot_alone(tmp_path):
  maker = SlotMaker(tmp_path)
  maker.start(1 << 20)
  maker.wait()
  pid = os.fork()
  if pid == 0:  # the child: a with-block unwinding would discard
    maker.discard()
    os._exit(0 if maker.size == 0 else 1)
  _, status = os.waitpid(pid, 0)
  assert os.waitstatus_to_exitcode(status) == 0
  assert maker.take(1 << 20, tmp_path / "slot-0.bin") is not None


def test_a_save_reserves_the_number_and_the_drain_makes_the_file(store_dir):
  store = HostStore(host_dir(store_dir, "r", 0), run_id="r", host=0, keep=1,
                    budget_bytes=None)
  before = _arena.faulting_seconds()
  slot = store.reserve(1, 1 << 20)
  assert _arena.faulting_seconds() == before
  assert not (store.root / f"slot-{slot}.bin").exists()
  assert store.slot_buffer(slot).nbytes == 1 << 20
  assert _arena.faulting_seconds() > before
  assert _allocated(store.root / f"slot-{slot}.bin")


def test_the_first_saves_find_their_slots_made_ahead(trainer, store_dir):
  """keep=2: three slots. The first save's drain makes slot 0; slots 1 and 2
  are made between saves and taken whole (the same files, no first touch in
  the drains of saves 2 and 3); with three slots, none more is made; later
  saves reuse them; the restore is bitwise the last state saved; a closed
  manager leaves no slot made ahead behind."""
  state = trainer.init_state()
  with snapstore.SnapshotManager(opts(store_dir, keep=2, prefault_restore=False)) as mgr:
    store = only_store(mgr)
    touched, made = [], []
    for step in range(1, 6):
      mgr.save(step, state)
      mgr.wait_until_finished()
      touched.append(mgr.metrics.first_touch_seconds)
      ahead = store.root / AHEAD_NAME
      store._ahead.wait()
      made.append(os.stat(ahead).st_ino if ahead.exists() else None)
    assert touched[0] > 0 and touched == [touched[0]] * 5, touched
    assert made[0] and made[1] and made[2:] == [None] * 3, made
    slot_inodes = {e.name: e.inode() for e in os.scandir(store.root)
                   if e.name.startswith("slot-")}
    assert len(slot_inodes) == 3 and {made[0], made[1]} <= set(slot_inodes.values())
    assert mgr.metrics.ahead_seconds > 0
    mgr.save(6, state)
    mgr.wait_until_finished()
    store._ahead.start(store._slot_size)  # one under way when the manager closes
    r = mgr.restore(trainer.abstract_state())
    assert r.step == 6
    assert_bitwise_equal(host_copy(state), r.state)
  assert not (store.root / AHEAD_NAME).exists()


def test_a_store_opened_again_removes_a_slot_left_half_made(store_dir):
  root = host_dir(store_dir, "r", 0)
  HostStore(root, run_id="r", host=0, keep=1, budget_bytes=None)
  (root / AHEAD_NAME).write_bytes(b"\0" * 4096)  # a process died while making it
  HostStore(root, run_id="r", host=0, keep=1, budget_bytes=None)
  assert not (root / AHEAD_NAME).exists()
