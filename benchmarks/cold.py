"""The cold path: the first save and the first load in a fresh process, against Orbax's.

``python -m benchmarks.cold --mb 256 --runs 5``: every recovery is a first
restore (a restarted process has never restored), and the other benchmarks
time the steady state. Each run starts one fresh process a system and leaf
count (the order rotated run to run), on 8 CPU devices as 2 slices, the
state of ``benchmarks.vs_orbax``; in it, with nothing of the system made
before:

* ``open_s``: making the system (a ``Snapshotter``);
* ``cold_save_s``: its first ``save`` until complete (``join``), and
  ``cold_load_s``: its first load (verified, placed), then checked bitwise;
* ``warm_save_s``, ``warm_load_s``: the median of ``--warm`` more rounds in
  that process, as ``vs_orbax`` times them.

Systems: ``snapstore`` (its ``Snapshotter``, pinned-host store),
``snapstore_host_files``, ``orbax_snapshotter`` (Orbax v1's). Reported: each
one's medians over the runs, ``cold_over_warm``, and the ratios of snapstore's
stores to Orbax's in the same run (``over_orbax``: <1, snapstore is faster).
Not measured here: a first restore from another process's store (a restart
of the host-file store) and a manager idle for long.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from benchmarks._common import cleanup, emit, ram_dir, setup_cpu_devices

SYSTEMS = ("snapstore", "snapstore_host_files", "orbax_snapshotter")
PHASES = ("open_s", "cold_save_s", "cold_load_s", "warm_save_s", "warm_load_s")


def child(system: str, mb: int, leaves: int | None, warm: int) -> dict[str, Any]:
  """One fresh process's times for ``system`` (runs in that process)."""
  import jax
  import numpy as np

  from benchmarks.vs_orbax import make_state, systems
  mesh, state, abstract = make_state(mb, leaves)
  work = ram_dir("snapstore-cold-")
  try:
    t = time.perf_counter()
    (sys_,) = systems(work, mesh, abstract, only=(system,))
    out: dict[str, Any] = {"open_s": time.perf_counter() - t}
    saves, loads = [], []
    for r in range(1 + warm):
      t = time.perf_counter()
      sys_.save(r + 1, state)
      sys_.complete()
      saves.append(time.perf_counter() - t)
      t = time.perf_counter()
      got = jax.block_until_ready(sys_.restore(r + 1, abstract))
      loads.append(time.perf_counter() - t)
      for k in state:
        if not np.array_equal(np.asarray(got[k]), np.asarray(state[k])):
          raise AssertionError(f"{system} restored a different {k}")
      del got
    sys_.close()
  finally:
    cleanup(work)
  out.update(cold_save_s=saves[0], cold_load_s=loads[0],
             warm_save_s=statistics.median(saves[1:]) if warm else None,
             warm_load_s=statistics.median(loads[1:]) if warm else None)
  return out


def _spawn(system: str, mb: int, leaves: int | None, warm: int) -> dict[str, Any]:
  cmd = [sys.executable, "-m", "benchmarks.cold", "--child", system, "--mb", str(mb),
         "--warm", str(warm), "--leaves", str(leaves or 0)]
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
  if proc.returncode != 0:
    raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
  return json.loads(proc.stdout.strip().splitlines()[-1])


def run(mb: int, runs: int, leaves: Sequence[int | None], warm: int) -> dict[str, Any]:
  rows: dict[str, dict[str, dict[str, list[float]]]] = {}
  for r in range(runs):
    for i in range(len(SYSTEMS)):
      system = SYSTEMS[(i + r) % len(SYSTEMS)]  # who goes first moves run to run
      for n in leaves:
        got = _spawn(system, mb, n, warm)
        by = rows.setdefault(str(n or "16MB-leaves"), {}).setdefault(system, {})
        for k, v in got.items():
          if v is not None:
            by.setdefault(k, []).append(v)
  out: dict[str, Any] = {}
  for n, by in rows.items():
    med = {s: {k: statistics.median(v) for k, v in t.items()} for s, t in by.items()}
    orbax = med["orbax_snapshotter"]
    out[n] = {
        "systems": med,
        "spread": {s: {k: [round(min(v), 4), round(max(v), 4)] for k, v in t.items()}
                   for s, t in by.items()},
        "cold_over_warm": {s: {p: m[f"cold_{p}_s"] / m[f"warm_{p}_s"] for p in ("save", "load")
                               if m.get(f"warm_{p}_s")} for s, m in med.items()},
        "over_orbax": {s: {k: med[s][k] / orbax[k] for k in PHASES if k in med[s]}
                       for s in med if s != "orbax_snapshotter"}}
  return {"mb": mb, "runs": runs, "warm_rounds": warm, "by_leaves": out}


def main(argv: Sequence[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog="benchmarks.cold", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--mb", type=int, default=256)
  p.add_argument("--runs", type=int, default=5)
  p.add_argument("--leaves", type=int, nargs="*", default=[0, 500],
                 help="leaf counts (0: 16 MB leaves)")
  p.add_argument("--warm", type=int, default=3, help="rounds after the first, per process")
  p.add_argument("--child", choices=SYSTEMS, help=argparse.SUPPRESS)
  p.add_argument("--out", default="bench-results/cold.json")
  a = p.parse_args(argv)
  if a.child:
    setup_cpu_devices(8)
    print(json.dumps(child(a.child, a.mb, a.leaves[0] or None, a.warm)))
    return 0
  emit("cold", run(a.mb, a.runs, [n or None for n in a.leaves], a.warm), a.out)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
