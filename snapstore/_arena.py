"""Host memory that restores copy into, reused from one restore to the next.

A restore copies every verified piece into one arena of anonymous memory,
and the restored arrays adopt parts of it (``device_put`` on CPU aliases a
page-aligned host buffer). Fresh memory costs a page fault and the kernel's
zeroing per page on first touch, which can double a restore's copy time. So
the last arena is kept
and the next restore reuses it once nothing uses it any more: no array, view
or buffer of it is alive (each holds a reference to the mapping, so the
mapping's reference count says so, once jaxlib's deferred releases have
run). An idle arena is handed to the kernel
with ``MADV_FREE`` (:meth:`ArenaCache.trim`, after every snapshot): the
kernel takes its pages back only when it needs memory, else the next
restore finds them in place.

The first restore of a process would still fault a whole arena in, on the
recovery's path (slower still where the kernel compacts memory for huge
pages). So the manager has one made
ahead, in the background (:meth:`ArenaCache.prefault`): once the store
holds a snapshot, at start or after the first one commits.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import mmap
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

__all__ = ["SPARE_SECONDS", "ArenaCache", "expire_spares", "host_arena", "spare_bytes"]


def _huge_pages_without_stall() -> bool:
  """Whether asking for huge pages (``MADV_HUGEPAGE``) is free of stalls:
  only where the kernel's defrag policy for such memory is ``defer`` or
  ``never``. Under ``always``, ``madvise`` or ``defer+madvise`` (the usual
  default is ``madvise``) the faulting thread compacts memory for each huge
  page: measured on a 2-core VM, fresh memory then took 0.17 s a 256 MB to
  fault in, against 0.03 s in small pages (two threads), and copies into
  either run alike once faulted in (19-20 ms a 256 MB)."""
  try:
    text = open("/sys/kernel/mm/transparent_hugepage/defrag").read()
  except OSError:
    return False
  chosen = text[text.find("[") + 1:text.find("]")]
  return chosen in ("defer", "never")


_HUGE = hasattr(mmap, "MADV_HUGEPAGE") and _huge_pages_without_stall()


def _mapping(nbytes: int) -> mmap.mmap:
  m = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
  if _HUGE:
    try:
      m.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # a kernel without transparent huge pages
      pass
  return m


#: madvise advice that faults every page of a range in, writable, in one call
#: (Linux 5.14+; the constant is missing from Python's mmap before 3.13).
_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23 if sys.platform == "linux" else None)

#: A prefault goes this many bytes at a time (found by red-teaming): each
#: call releases the GIL (``mmap.madvise`` holds it, and a prefault of a
#: large state stopped the training thread for seconds), the other threads
#: run between calls
#: even where the fallback (a write a page, with the GIL) is used, and the
#: kernel holds the process's memory-map lock for one chunk at a time (with
#: huge pages it may compact memory meanwhile, and any thread that maps or
#: unmaps memory waits: XLA's allocator does). Smaller chunks keep such a
#: wait short; bigger ones lengthen it in proportion.
POPULATE_CHUNK = 4 << 20


def _libc_madvise() -> Any:
  try:
    fn = ctypes.CDLL(None, use_errno=True).madvise  # (a CDLL call releases the GIL)
  except (OSError, AttributeError):
    return None
  fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
  fn.restype = ctypes.c_int
  return fn


_MADVISE = _libc_madvise() if _POPULATE_WRITE is not None else None


def _populate(m: mmap.mmap, stop: Callable[[], bool] = lambda: False, start: int = 0) -> int:
  """Faults in every page of ``m`` from ``start`` (a multiple of
  :data:`POPULATE_CHUNK`), a chunk at a time, the GIL released (a kernel
  without MADV_POPULATE_WRITE: one write a page), until ``stop()``.
  Returns where it stopped (``len(m)``: done), for a later call to go on."""
  pages = np.frombuffer(m, np.uint8)
  base = pages.ctypes.data  # page aligned: a mapping
  for at in range(start, pages.size, POPULATE_CHUNK):
    if stop():
      return at
    n = min(POPULATE_CHUNK, pages.size - at)
    if _MADVISE is None or _MADVISE(base + at, n, _POPULATE_WRITE) != 0:
      pages[at:at + n:mmap.PAGESIZE] = 0
    time.sleep(0)  # (the fallback holds the GIL: let the others have it)
  return pages.size


#: threads that fault a fresh arena in (page zeroing runs on every core)
POPULATE_THREADS = max(1, min(4, os.cpu_count() or 1))


_faulting = threading.local()


def faulting_seconds() -> float:
  """Seconds the calling thread has spent faulting fresh memory in
  (:func:`_populate_now`): a first-use cost, which the steady state does
  not pay. Per thread, so that a manager counts its own: it reports the
  part of each restore (its thread) and snapshot (capture, and its drain
  thread)."""
  return float(getattr(_faulting, "seconds", 0.0))


@contextlib.contextmanager
def faulting() -> Iterator[None]:
  """Counts the time inside as the calling thread's :func:`faulting_seconds`."""
  t = time.perf_counter()
  try:
    yield
  finally:
    _faulting.seconds = faulting_seconds() + time.perf_counter() - t


def _populate_now(m: mmap.mmap, threads: int = POPULATE_THREADS, start: int = 0) -> None:
  with faulting():
    _populate_now_timed(m, threads, start)


def _populate_now_timed(m: mmap.mmap, threads: int, start: int = 0) -> None:
  """Faults in every page of ``m`` (anonymous or a shared file mapping) from
  ``start`` (a multiple of :data:`POPULATE_CHUNK`) before it is written, on
  ``threads`` threads at once, the GIL released: the kernel's zeroing runs
  on every core instead of inside one thread's copy, a fault at a time.
  Measured on a 2-core VM: 256 MB of fresh memory in 0.03 s with two
  threads; pages already in place cost a walk of the page table (3-7 ms a
  256 MB)."""
  if _MADVISE is None or threads <= 1 or len(m) - start < 2 * POPULATE_CHUNK * threads:
    _populate(m, start=start)
    return
  pages = np.frombuffer(m, np.uint8)
  base, size = pages.ctypes.data, pages.size
  per = -(-(size - start) // threads // POPULATE_CHUNK) * POPULATE_CHUNK  # whole chunks a thread

  def run(lo: int, hi: int) -> None:
    for at in range(lo, hi, POPULATE_CHUNK):
      if _MADVISE(base + at, min(POPULATE_CHUNK, hi - at), _POPULATE_WRITE) != 0:
        pages[at:hi:mmap.PAGESIZE] = 0  # (a kernel without the advice): a write a page
        return
  workers = [threading.Thread(target=run, args=(lo, min(lo + per, size)),
                              name="snapstore-populate", daemon=True)
             for lo in range(start, size, per)]
  for w in workers:
    w.start()
  for w in workers:
    w.join()


#: How long memory that an :class:`ArenaCache` let go of while nothing used
#: it (a manager closed, a slot dropped, a slice lost) is kept for a new
#: arena in this process, so that a new manager (a new ``Snapshotter`` on a
#: scale event) copies into memory already faulted in, as XLA's own
#: allocator reuses what it freed. Meanwhile it is given to the kernel with
#: ``MADV_FREE``: taken back under memory pressure, counted in the process's
#: resident size until then. 0: unmapped at once.
SPARE_SECONDS = 30.0

_spares: list[tuple[float, mmap.mmap]] = []  # (given back at, mapping), oldest first
_spares_lock = threading.Lock()


def _give_back(m: mmap.mmap) -> None:
  """Keeps an idle mapping for :data:`SPARE_SECONDS` (see there)."""
  if SPARE_SECONDS <= 0:
    return
  advice = getattr(mmap, "MADV_FREE", getattr(mmap, "MADV_DONTNEED", None))
  if advice is not None:
    try:
      m.madvise(advice)
    except OSError:
      pass
  global _reaper
  with _spares_lock:
    _spares.append((time.monotonic(), m))
    if _reaper is None or not _reaper.is_alive():
      _reaper = threading.Thread(target=_reap, name="snapstore-spares", daemon=True)
      _reaper.start()


_reaper: threading.Thread | None = None


def _reap() -> None:
  """One thread a process, while spares are kept: unmaps each when its
  time is up (:func:`expire_spares`), then ends when none is left."""
  global _reaper
  while True:
    with _spares_lock:
      if not _spares:
        _reaper = None  # (under the lock: the next give-back starts another)
        return
      wait = _spares[0][0] + SPARE_SECONDS - time.monotonic()
    if wait > 0:
      time.sleep(min(wait, 1.0))
    else:
      expire_spares()


def expire_spares(now: float | None = None) -> None:
  """Unmaps the spare memory kept longer than :data:`SPARE_SECONDS` (at
  ``now``, ``time.monotonic()`` by default; 0 seconds: all of it)."""
  now = time.monotonic() if now is None else now
  with _spares_lock:
    old = [m for t, m in _spares if now - t >= SPARE_SECONDS]
    _spares[:] = [(t, m) for t, m in _spares if now - t < SPARE_SECONDS]
  for m in old:
    try:
      m.close()
    except BufferError:  # (a view appeared: it keeps the memory until it goes)
      pass


def _reuse(nbytes: int) -> mmap.mmap | None:
  """The smallest spare mapping of at least ``nbytes`` and at most twice
  that, taken from the spares; or None."""
  expire_spares()
  with _spares_lock:
    fits = [(len(m), i) for i, (_, m) in enumerate(_spares) if nbytes <= len(m) <= 2 * nbytes]
    if not fits:
      return None
    return _spares.pop(min(fits)[1])[1]


def spare_bytes() -> int:
  """Bytes of spare memory kept now (:data:`SPARE_SECONDS`)."""
  with _spares_lock:
    return sum(len(m) for _, m in _spares)


def host_arena(nbytes: int) -> np.ndarray:
  """Fresh, page-aligned anonymous memory (huge pages where the kernel
  allows), as a uint8 array; unmapped when the last view of it is gone."""
  return np.frombuffer(_mapping(nbytes), np.uint8)[:nbytes]


def _baseline() -> int:
  held = [object()]  # one reference from a list, as the cache holds its mapping
  return sys.getrefcount(held[0])


class ArenaCache:
  """At most one arena kept for reuse (see the module doc); one per
  manager. Thread-safe."""

  def __init__(self) -> None:
    self._lock = threading.Lock()
    self._kept: list[mmap.mmap] = []  # zero or one mapping
    self._lazy = False  # the kept mapping was given MADV_FREE
    self._resident = False  # every page of the kept mapping was faulted in
    self._idle_refs = _baseline()
    self._wanted = threading.Event()  # a take() waits: a prefault stops where it is

  def _idle(self, flush: bool) -> bool:
    if not self._kept:
      return False
    if flush and sys.getrefcount(self._kept[0]) > self._idle_refs:
      # jaxlib hands the host buffers that arrays adopted back to Python
      # from its own threads and drops them only in a garbage-collector
      # callback: run one (the youngest generation: cheap). Once a restore,
      # not every snapshot: each explicit collection brings the older
      # generations' (full, slow) collections closer.
      gc.collect(0)
    return sys.getrefcount(self._kept[0]) <= self._idle_refs

  def take(self, nbytes: int) -> np.ndarray:
    """``nbytes`` of page-aligned memory, private to the caller until every
    array and view of it is gone: the kept arena if it is idle and large
    enough, else a fresh one (then kept instead)."""
    self._wanted.set()
    with self._lock:
      self._wanted.clear()
      idle = self._idle(flush=True)
      if idle and len(self._kept[0]) >= nbytes:
        m = self._kept[0]  # writing cancels a MADV_FREE: pages not taken stay
      else:
        if idle:  # too small for this one: another arena may take it
          _give_back(self._kept[0])
        m = _reuse(nbytes) or _mapping(nbytes)
        self._kept = [m]  # a busy one lives on with its users, unmapped after them
        self._resident = False
      if not self._resident:  # fresh, given back, or a prefault cut short:
        _populate_now(m)  # on every core, before the copies (_populate_now)
        self._resident = True
      self._lazy = False
    return np.frombuffer(m, np.uint8)[:nbytes]

  def prefault(self, nbytes: int) -> bool:
    """Makes a resident arena of ``nbytes`` the kept one, its pages faulted
    in now (on the calling thread, off a restore's path), unless an arena
    is kept already (idle or in use). A :meth:`take` meanwhile stops it
    where it is (the chunk under way) and gets the arena: the restore's own
    copies fault in the rest, on every copy thread. Returns True if it made
    one."""
    with self._lock:
      if self._kept:
        return False
      m = _reuse(nbytes) or _mapping(nbytes)
      _populate(m, self._wanted.is_set)
      self._kept = [m]
      self._lazy = False
      self._resident = not self._wanted.is_set()  # else a take() finishes it
    return True

  def trim(self) -> None:
    """Lets the kernel take the kept arena's pages when it needs memory,
    if nothing uses them (once per idle period). Skipped while a prefault
    or a take holds the arena (a snapshot's drain calls this: it must not
    wait for a prefault)."""
    if not self._lock.acquire(blocking=False):
      return
    try:
      if self._lazy or not self._idle(flush=False):
        return
      advice = getattr(mmap, "MADV_FREE", getattr(mmap, "MADV_DONTNEED", None))
      if advice is not None:
        try:
          self._kept[0].madvise(advice)
        except OSError:
          pass
      self._lazy = True
      self._resident = False  # the kernel may take pages back
    finally:
      self._lock.release()

  def interrupt(self) -> None:
    """Stops a prefault under way after its current chunk (it keeps what it
    made); for a manager closing."""
    self._wanted.set()

  def release(self) -> None:
    """Lets go of the kept arena: kept a while for a new arena in this
    process if nothing uses it (:data:`SPARE_SECONDS`), else its users keep
    it and it is unmapped after them."""
    with self._lock:
      if self._kept and self._idle(flush=True):
        _give_back(self._kept[0])
      self._kept = []
      self._lazy = False
      self._resident = False

  @property
  def kept_bytes(self) -> int:
    with self._lock:
      return len(self._kept[0]) if self._kept else 0

