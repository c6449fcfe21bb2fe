"""A host store's next slot file, made ahead of the save that needs it.

A slot's first use costs its pages' allocation and zeroing: 1-3 s a GiB on
this project's 2-core VM, 2.2 s a GiB on a TPU v5e host's RAM disk, paid once
by each of a job's first ``keep + 1`` snapshots, on the training thread
until this module. Now a save only reserves a slot's number; the drain makes
the file (:meth:`.store.HostStore.slot_buffer`), and after each drain that
leaves the store fewer slot files of the current size than it will use, a
:class:`SlotMaker` makes the next one on a thread of its own, between saves:
a file under a temporary name of this process (a store's open removes it if
the process died), allocated and faulted in a chunk at a time, the GIL
released, one slot at a time in a process (one core at most). The drain that
needs a new slot takes it: the maker stops after its chunk, the drain
finishes the rest (on every core, counted as its first-touch time) and links
it into place (never over a file there). With snapshots far enough apart,
no save and no drain pays a first use but the first; at one snapshot a step,
the drains of the first saves still pay what the maker had no time for.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path

from ... import _arena

logger = logging.getLogger(__name__)

#: Bytes allocated a call (each ``posix_fallocate`` releases the GIL; a stop
#: waits for one at most).
ALLOCATE_CHUNK = 64 << 20

_CREATE = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC

#: One maker at a time in a process (stores of several failure domains).
_ONE_AT_A_TIME = threading.Lock()
_MAKERS: weakref.WeakSet[SlotMaker] = weakref.WeakSet()


def ahead_name(pid: int) -> str:
  """The file a slot is made in: a name no slot, manifest or PROGRESS file
  has (".tmp." marks it for removal at the store's next open)."""
  return f"slot-ahead.tmp.{pid}.bin"


class SlotMaker:
  """Makes one store's next slot file ahead (see the module doc). The store's
  own thread calls :meth:`start`, :meth:`take` and :meth:`discard`, never two
  at once; the making runs on a thread of its own, or in :meth:`take`."""

  def __init__(self, root: Path) -> None:
    self.root = root
    self.seconds = 0.0  # spent making slots on the maker's thread, in all
    self.refused = 0  # a size the filesystem refused: not tried again ahead
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None
    self._reset()
    _MAKERS.add(self)

  def _reset(self) -> None:
    self.size = 0  # bytes of the slot made or being made (0: none)
    self.path = self.root / ahead_name(os.getpid())
    self._ino = -1  # the inode this maker made (only that one is ever deleted)
    self._fd = -1
    self._mm: mmap.mmap | None = None
    self.allocated = 0  # bytes allocated so far
    self._populated = 0

  def start(self, size: int) -> None:
    """Starts making a slot of ``size`` bytes, unless one is made or being
    made (one of another size is deleted first). Raises RuntimeError if no
    thread can be started."""
    if self.size == size:
      return
    self.discard()
    self.size = size
    self._stop.clear()
    self._thread = threading.Thread(target=self._run, name="snapstore-slot-ahead",
                                    daemon=True)
    self._thread.start()

  def _run(self) -> None:
    stop = self._stop.is_set
    while not _ONE_AT_A_TIME.acquire(timeout=0.05):
      if stop():
        return
    t = time.perf_counter()
    try:
      self._make(stop)
    except OSError as e:  # (a thread's end: the drain makes its slot as before)
      logger.info("%s: a slot of %d bytes was not made ahead (%s); the save that needs "
                  "it makes it", self.root, self.size, e)
      self.refused = self.size
      self._drop()
    finally:
      self.seconds += time.perf_counter() - t
      _ONE_AT_A_TIME.release()

  def _make(self, stop: Callable[[], bool], chunk: int = 0, populate: bool = True) -> None:
    """Makes the slot, each part from where the last call stopped: the file,
    its pages allocated (``chunk`` bytes a call, else :data:`ALLOCATE_CHUNK`), mapped, and with
    ``populate`` faulted in on this thread; until ``stop()``."""
    if self._ino < 0:
      self._fd = os.open(self.path, _CREATE, 0o600)
      self._ino = os.fstat(self._fd).st_ino
      os.ftruncate(self._fd, self.size)
    while self.allocated < self.size:
      if stop():
        return
      n = min(chunk or ALLOCATE_CHUNK, self.size - self.allocated)
      os.posix_fallocate(self._fd, self.allocated, n)
      self.allocated += n
    if self._mm is None:
      self._mm = mmap.mmap(self._fd, self.size, flags=mmap.MAP_SHARED)
      os.close(self._fd)
      self._fd = -1
    if populate:
      self._populated = _arena._populate(self._mm, stop, self._populated)

  def take(self, size: int, dest: Path) -> mmap.mmap | None:
    """The slot made ahead, linked to ``dest``, if it is of ``size`` bytes:
    the maker stops after its chunk and what it left is made here, on every
    core (counted in this thread's :func:`.._arena.faulting_seconds`). None
    if there is none of that size (one of another size is deleted), it
    cannot be finished, or ``dest`` exists: the caller makes its slot."""
    self._join()
    if self.size != size or self._ino < 0:  # (none, another size, or the maker failed)
      self._drop()
      return None
    try:
      if self._populated < self.size:  # (the maker stopped before the end)
        with _arena.faulting():
          self._make(lambda: False, chunk=self.size, populate=False)  # the rest, at once
          assert self._mm is not None
          _arena._populate_now_timed(self._mm, _arena.POPULATE_THREADS, self._populated)
      os.link(self.path, dest)  # (never over a file there: FileExistsError)
    except OSError as e:
      logger.info("%s: the slot made ahead is not used (%s)", self.root, e)
      self._drop()
      return None
    mm = self._mm
    self._mm = None
    self._drop()  # (the temporary name)
    return mm

  def discard(self) -> None:
    """Stops the maker and deletes what it made."""
    if self.size:
      self._join()
      self._drop()

  def wait(self) -> None:
    """Waits for the maker to finish (for tests and benchmarks)."""
    if self._thread is not None:
      self._thread.join()

  def _join(self) -> None:
    self._stop.set()
    self.wait()
    self._thread = None

  def _drop(self) -> None:
    """Closes what it holds and unlinks its file, if the name still is it."""
    if self._fd >= 0:
      os.close(self._fd)
    if self._mm is not None:
      self._mm.close()
    try:
      if self._ino >= 0 and os.lstat(self.path).st_ino == self._ino:
        os.unlink(self.path)
    except FileNotFoundError:
      pass
    except OSError as e:
      logger.info("cannot remove %s (%s)", self.path, e)
    self._reset()

  def _forget(self) -> None:
    """In a forked child: lets go of the parent's maker without touching its
    file (the parent makes and takes it)."""
    if self._mm is not None:
      try:
        self._mm.close()
      except (BufferError, ValueError):
        pass
    if self._fd >= 0:
      os.close(self._fd)
    self._thread = None
    self._reset()


def _forget_in_child() -> None:
  global _ONE_AT_A_TIME
  _ONE_AT_A_TIME = threading.Lock()  # (a maker's thread may have held it at the fork)
  for maker in list(_MAKERS):
    maker._forget()


os.register_at_fork(after_in_child=_forget_in_child)
