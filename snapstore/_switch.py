"""The interpreter's thread switch interval, lowered while snapshots drain.

A drain runs Python (manifests, checksums' bookkeeping) on a background
thread beside the training loop. CPython hands the GIL to a waiting thread
only after the holder has run for the switch interval (5 ms by default), so
every time the loop wants the GIL back (to dispatch the next step, to enter
a collective or a barrier) it may wait up to 5 ms. Measured on the demo's
4-process in-place job (``benchmarks.demo_overhead``): per-step overhead
+9.5..10.2% at 5 ms, +6.5% at 0.5 ms. :func:`lowered` sets the interval for
as long as any drain runs and puts back the caller's value after the last.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_active = 0
_saved: float | None = None


@contextlib.contextmanager
def lowered(seconds: float | None) -> Iterator[None]:
  """While the block runs, the switch interval is at most ``seconds``
  (None: left alone). Nested and concurrent blocks share one change."""
  global _active, _saved
  if seconds is None:
    yield
    return
  with _lock:
    if _active == 0:
      _saved = sys.getswitchinterval()
      if seconds < _saved:
        sys.setswitchinterval(seconds)
    _active += 1
  try:
    yield
  finally:
    with _lock:
      _active -= 1
      if _active == 0 and _saved is not None:
        sys.setswitchinterval(_saved)
        _saved = None
