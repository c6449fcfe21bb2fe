"""A job's first saves into host files, against a warm one.

``python -m benchmarks.first_saves --mb 1024 --gaps 4 0``: in one process, on
8 CPU devices, a host-files manager (``keep=2``: three slots) saves a state
of ``--mb`` MiB ``keep + 1 + --warm`` times, ``gap`` seconds apart (a train
step), each save waited for before the gap. The first ``keep + 1`` saves each
use a slot for the first time (its ``fallocate`` and first touch); the rest
reuse them. Reported per gap: each save's return (``save_s``) and its drain
(``drain_s``: ``wait_until_finished``), ``first_over_warm`` (the slowest of
the first saves' returns over the median warm return) and the same of save
plus drain, and the manager's ``first_touch_seconds`` / ``ahead_seconds``.

On a TPU host, ``device_check --sections stores`` reports the same ratio
(``first_saves_vs_warm``) for every store.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from typing import Any

from ._common import cleanup, emit, make_state, ram_dir, setup_cpu_devices

KEEP = 2


def run(mb: int, gap_s: float, warm: int) -> dict[str, Any]:
  import jax

  import snapstore
  state, _ = make_state(mb << 20)
  jax.block_until_ready(state)  # (else the first save waits for it)
  d = ram_dir("snapstore-first-")
  try:
    opts = snapstore.SnapshotOptions(store=snapstore.HostFiles(dir=str(d)), keep=KEEP,
                                     run_id="first")
    save_s, drain_s = [], []
    with snapstore.SnapshotManager(opts) as mgr:
      for step in range(KEEP + 1 + warm):
        t = time.perf_counter()
        mgr.save(step, state, force=True)
        save_s.append(time.perf_counter() - t)
        t = time.perf_counter()
        mgr.wait_until_finished()
        drain_s.append(time.perf_counter() - t)
        time.sleep(gap_s)
      metrics = mgr.metrics
  finally:
    cleanup(d)
  both = [a + b for a, b in zip(save_s, drain_s, strict=True)]
  first, rest = slice(0, KEEP + 1), slice(KEEP + 1, None)
  return {
      "gap_s": gap_s,
      "save_s": [round(x, 4) for x in save_s],
      "drain_s": [round(x, 4) for x in drain_s],
      "first_over_warm": round(max(save_s[first]) / statistics.median(save_s[rest]), 2),
      "first_with_drain_over_warm": round(max(both[first]) / statistics.median(both[rest]), 2),
      "first_touch_seconds": round(metrics.first_touch_seconds, 4),
      "ahead_seconds": round(getattr(metrics, "ahead_seconds", 0.0), 4),
  }


def main(argv: Sequence[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog="benchmarks.first_saves", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--mb", type=int, default=1024)
  p.add_argument("--gaps", type=float, nargs="+", default=[4.0, 0.0],
                 help="seconds between saves (a train step); each a run of its own")
  p.add_argument("--warm", type=int, default=5, help="saves after the first keep + 1")
  p.add_argument("--out", default="bench-results/first_saves.json")
  a = p.parse_args(argv)
  setup_cpu_devices(8)
  import jax
  emit("first_saves", {"state_mb": a.mb, "keep": KEEP, "jax": jax.__version__,
                       "runs": [run(a.mb, gap, a.warm) for gap in a.gaps]}, a.out)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
