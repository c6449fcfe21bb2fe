"""Host files' slots made ahead (snapstore/_backends/hostfiles/slots.py): a
save never makes a slot file; the drain makes the first, and the next ones
are made between saves on a thread of their own and taken whole."""

from __future__ import annotations

import errno
import os
import threading

import numpy as np

import snapstore
from snapstore import _arena
from snapstore._backends.hostfiles import slots
from snapstore._backends.hostfiles.slots import AHEAD_NAME, SlotMaker
from snapstore._backends.hostfiles.store import HostStore, host_dir
from tests.helpers import assert_bitwise_equal, host_copy, only_store, opts


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
      maker._stop.wait()  # the first chunk finishes after take() asked it to stop
    real(fd, at, n)
  monkeypatch.setattr(slots.os, "posix_fallocate", fallocate)
  maker.start(8 << 20)
  entered.wait(60)
  before = _arena.faulting_seconds()
  mm = maker.take(8 << 20, tmp_path / "slot-0.bin")
  assert mm is not None
  assert calls[0] == "snapstore-slot-ahead"
  assert calls[1:] == [threading.current_thread().name] * 7  # the rest, here
  assert _arena.faulting_seconds() > before
  assert _allocated(tmp_path / "slot-0.bin")
  np.frombuffer(mm, np.uint8)[:] = 7  # every page mapped writable
  mm.close()


def test_a_maker_that_fails_leaves_nothing_and_the_taker_makes_its_own(tmp_path, monkeypatch):
  def full(fd: int, at: int, n: int) -> None:
    raise OSError(errno.ENOSPC, "no space")
  monkeypatch.setattr(slots.os, "posix_fallocate", full)
  maker = SlotMaker(tmp_path)
  maker.start(1 << 20)
  maker.wait()
  assert maker.take(1 << 20, tmp_path / "slot-0.bin") is None
  assert os.listdir(tmp_path) == []


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
