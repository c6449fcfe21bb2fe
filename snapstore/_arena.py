"""Host memory that restores copy into, reused from one restore to the next.

A restore copies every verified piece into one arena of anonymous memory,
and the restored arrays adopt parts of it (``device_put`` on CPU aliases a
page-aligned host buffer). Fresh memory costs a page fault and the kernel's
zeroing per page on first touch: measured here, 256 MB restored into fresh
pages took 46 ms, into pages touched before 22 ms. So the last arena is kept
and the next restore reuses it once nothing uses it any more: no array, view
or buffer of it is alive (each holds a reference to the mapping, so the
mapping's reference count says so, once jaxlib's deferred releases have
run). An idle arena is handed to the kernel
with ``MADV_FREE`` (:meth:`ArenaCache.trim`, after every snapshot): the
kernel takes its pages back only when it needs memory, else the next
restore finds them in place.
"""

from __future__ import annotations

import gc
import mmap
import sys
import threading

import numpy as np

__all__ = ["ArenaCache", "host_arena"]


def _mapping(nbytes: int) -> mmap.mmap:
  m = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
  if hasattr(mmap, "MADV_HUGEPAGE"):
    try:
      m.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # a kernel without transparent huge pages
      pass
  return m


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
    self._idle_refs = _baseline()

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
    with self._lock:
      if self._idle(flush=True) and len(self._kept[0]) >= nbytes:
        m = self._kept[0]  # writing cancels a MADV_FREE: pages not taken stay
      else:
        m = _mapping(nbytes)
        self._kept = [m]  # a busy one lives on with its users, unmapped after them
      self._lazy = False
    return np.frombuffer(m, np.uint8)[:nbytes]

  def trim(self) -> None:
    """Lets the kernel take the kept arena's pages when it needs memory,
    if nothing uses them (once per idle period)."""
    with self._lock:
      if self._lazy or not self._idle(flush=False):
        return
      advice = getattr(mmap, "MADV_FREE", getattr(mmap, "MADV_DONTNEED", None))
      if advice is not None:
        try:
          self._kept[0].madvise(advice)
        except OSError:
          pass
      self._lazy = True

  def release(self) -> None:
    """Unmaps the kept arena if nothing uses it (else its users keep it)."""
    with self._lock:
      self._kept = []
      self._lazy = False

  @property
  def kept_bytes(self) -> int:
    with self._lock:
      return len(self._kept[0]) if self._kept else 0

