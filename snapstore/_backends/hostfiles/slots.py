"""A host store's next slot file, made ahead of the save that needs it.

A slot's first use costs its pages' allocation and zeroing: about 0.1 s a GiB
on a 2-core VM, 2.2 s a GiB on a TPU v5e host's RAM disk (gVisor), paid once
by each of a job's first ``keep + 1`` snapshots, on the training thread
until this module. Now a save only reserves a slot's number; the drain makes
the file (:meth:`.store.HostStore.slot_buffer`), and after each drain that
leaves the store fewer slot files of the current size than it will use, a
:class:`SlotMaker` makes the next one on a thread of its own, between saves:
a file under a temporary name (a store's open removes it if the process
died), allocated and faulted in a chunk at a time, the GIL released, one
core at most. The drain that needs a new slot takes it: the maker stops
after its chunk, the drain finishes the rest (counted as its first-touch
time) and renames it into place. With snapshots far enough apart, no save
and no drain pays a first use but the first; every ``interval`` steps at 1,
the drain of each of the first saves still pays what the maker had no time
for.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from ... import _arena

logger = logging.getLogger(__name__)

#: The file a slot is made in; a name no slot, manifest or PROGRESS file has
#: (".tmp." marks it for removal at the store's next open).
AHEAD_NAME = "slot-ahead.tmp.bin"

#: Bytes allocated a call (each ``posix_fallocate`` releases the GIL; a stop
#: waits for one at most).
ALLOCATE_CHUNK = 64 << 20

_CREATE = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class SlotMaker:
  """Makes one store's next slot file ahead (see the module doc). The store's
  own thread calls :meth:`start`, :meth:`take` and :meth:`discard`, never two
  at once; the making runs on a thread of its own, or in :meth:`take`."""

  def __init__(self, root: Path) -> None:
    self.path = root / AHEAD_NAME
    self.seconds = 0.0  # spent making slots on the maker's thread, in all
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None
    self._reset()

  def _reset(self) -> None:
    self.size = 0  # bytes of the slot made or being made (0: none)
    self._fd = -1
    self._mm: mmap.mmap | None = None
    self._allocated = 0
    self._populated = 0

  def start(self, size: int) -> None:
    """Starts making a slot of ``size`` bytes, unless one is made or being
    made (one of another size is deleted first)."""
    if self.size == size:
      return
    self.discard()
    self.size = size
    self._stop.clear()
    self._thread = threading.Thread(target=self._run, name="snapstore-slot-ahead",
                                    daemon=True)
    self._thread.start()

  def _run(self) -> None:
    t = time.perf_counter()
    try:
      self._make(self._stop.is_set)
    except OSError as e:  # (a thread's end: the drain makes its slot as before)
      logger.info("%s: a slot of %d bytes was not made ahead (%s); the save that needs "
                  "it makes it", self.path.parent, self.size, e)
      self._drop()
    finally:
      self.seconds += time.perf_counter() - t

  def _make(self, stop: Callable[[], bool]) -> None:
    """Makes the slot, each part from where the last call stopped: the file,
    its pages allocated, mapped, faulted in; until ``stop()``."""
    if self._fd < 0 and self._mm is None:
      self._fd = os.open(self.path, _CREATE, 0o600)
      os.ftruncate(self._fd, self.size)
    while self._allocated < self.size:
      if stop():
        return
      n = min(ALLOCATE_CHUNK, self.size - self._allocated)
      os.posix_fallocate(self._fd, self._allocated, n)
      self._allocated += n
    if self._mm is None:
      self._mm = mmap.mmap(self._fd, self.size, flags=mmap.MAP_SHARED)
      os.close(self._fd)
      self._fd = -1
    self._populated = _arena._populate(self._mm, stop, self._populated)

  def take(self, size: int, dest: Path) -> mmap.mmap | None:
    """The slot made ahead, renamed to ``dest``, if it is of ``size`` bytes:
    the maker stops after its chunk and what it left is made here (counted
    in this thread's :func:`.._arena.faulting_seconds`). None if there is
    none of that size (one of another size is deleted) or it cannot be
    finished: the caller makes its slot itself."""
    self._join()
    if self.size != size:  # (none, another size, or the maker failed)
      self._drop()
      return None
    try:
      if self._populated < self.size:  # (the maker stopped before the end)
        with _arena.faulting():
          self._make(lambda: False)
      os.rename(self.path, dest)  # (dest: a name with no file; the store is ours)
    except OSError as e:
      logger.info("%s: the slot made ahead is not used (%s)", self.path.parent, e)
      self._drop()
      return None
    mm = self._mm
    self._reset()
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
    if self._fd >= 0:
      os.close(self._fd)
    if self._mm is not None:
      self._mm.close()
    try:
      os.unlink(self.path)
    except FileNotFoundError:
      pass
    except OSError as e:
      logger.info("cannot remove %s (%s)", self.path, e)
    self._reset()
