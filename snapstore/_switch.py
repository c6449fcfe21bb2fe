"""Interpreter settings held while snapshots are taken: the thread switch
interval, lowered while they drain (:func:`lowered`); and Python's cyclic
garbage collector, paused while they are captured and drained
(:func:`collections_paused`).

A drain runs Python (manifests, checksums' bookkeeping) on a background
thread beside the training loop. CPython hands the GIL to a waiting thread
only after the holder has run for the switch interval (5 ms by default), so
every time the loop wants the GIL back (to dispatch the next step, to enter
a collective or a barrier) it may wait up to 5 ms. Measured on the demo's
4-process in-place job (``python -m benchmarks.demo_overhead
--replica-intervals 2 --live-every 1``): per-step overhead +10.2% with the
default interval, +7.4% with 0.5 ms while drains run. :func:`lowered` sets
the interval for as long as any drain runs and puts back the value it
found after the last, unless someone else changed it meanwhile.
"""

from __future__ import annotations

import contextlib
import gc
import sys
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_active = 0
_saved: float | None = None  # the value found, while ours is set
_ours: float | None = None


@contextlib.contextmanager
def lowered(seconds: float | None) -> Iterator[None]:
  """While the block runs, the switch interval is at most ``seconds``
  (None: left alone). Nested and concurrent blocks share one change."""
  global _active, _saved, _ours
  if seconds is None:
    yield
    return
  with _lock:
    if _active == 0 and seconds < sys.getswitchinterval():
      _saved = sys.getswitchinterval()
      sys.setswitchinterval(seconds)
      _ours = sys.getswitchinterval()
    _active += 1
  try:
    yield
  finally:
    with _lock:
      _active -= 1
      if _active == 0 and _saved is not None:
        if sys.getswitchinterval() == _ours:  # not changed by someone else meanwhile
          sys.setswitchinterval(_saved)
        _saved = _ours = None


_gc_lock = threading.Lock()
_gc_active = 0
_gc_paused = False  # we turned it off (it was on when the first block began)


@contextlib.contextmanager
def collections_paused(pause: bool = True) -> Iterator[None]:
  """While the block runs, Python's cyclic garbage collector is off (with
  ``pause``). A save makes a numpy view of every shard, each with a
  memoryview and a managed buffer the collector tracks, and they live until
  the drain has copied them: thousands of them at many leaves. Collections
  during that time promote them to the oldest generation, and full
  collections (slow in a JAX process, which holds many objects; run on
  whichever thread allocates, often the training loop's) follow every few
  saves (``python -m benchmarks.capture`` counts them:
  ``gc_full_collections``). Memory is
  still freed by reference counts meanwhile; cycles wait for the end of the
  block. Nested and concurrent blocks share one pause; the collector is
  turned back on after the last, if it was on before the first and is
  still off."""
  global _gc_active, _gc_paused
  if not pause:
    yield
    return
  with _gc_lock:
    if _gc_active == 0 and gc.isenabled():
      gc.disable()
      _gc_paused = True
    _gc_active += 1
  try:
    yield
  finally:
    with _gc_lock:
      _gc_active -= 1
      if _gc_active == 0 and _gc_paused:
        _gc_paused = False
        if not gc.isenabled():
          gc.enable()
