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
``--scenario elastic``: Orbax's own Snapshotter benchmark
(``snapshotter_benchmark.py``) with a fixed shape, in each fresh process:
save on 2 slices, load onto 1 (``load_scale_down``); a new Snapshotter saves
the 1-slice state (``save_new_layout``) and loads it onto 2
(``load_scale_up``); twice, the first round cold (``cold_*``), the second
with new Snapshotters (``warm_*``).

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


ELASTIC_PHASES = ("save", "load_scale_down", "save_new_layout", "load_scale_up")


def child_elastic(system: str, mb: int, leaves: int | None, rounds: int = 2
                  ) -> dict[str, Any]:
  """Orbax's own Snapshotter benchmark (``snapshotter_benchmark.py``), with a
  fixed shape: a Snapshotter saves the state of 2 slices and loads it onto 1
  (scale down); a new one saves the 1-slice state and loads it onto 2 (scale
  up). ``rounds`` times in this fresh process, a new Snapshotter each: the
  first round is the cold path. Every load is checked bitwise."""
  import jax
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

  from benchmarks.vs_orbax import make_state, systems
  mesh, full, abstract_full = make_state(mb, leaves)
  down_mesh = Mesh(mesh.devices[:1], mesh.axis_names)  # slice 0's devices
  down = NamedSharding(down_mesh, P(None, "model"))
  abstract_down = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=down),
                               abstract_full)
  state_down = jax.block_until_ready(jax.device_put(full, down))
  expected = {k: np.asarray(v) for k, v in full.items()}
  work = ram_dir("snapstore-cold-elastic-")
  out: dict[str, Any] = {}
  try:
    for r in range(rounds):
      times = {}
      (a,) = systems(work / f"a{r}", mesh, abstract_full, only=(system,))
      for name, step, snap, state, target in (
          ("save", 1, a, full, None), ("load_scale_down", 1, a, None, abstract_down),
          ("save_new_layout", 2, None, state_down, None),
          ("load_scale_up", 2, None, None, abstract_full)):
        if name == "save_new_layout":
          a.close()
          (b,) = systems(work / f"b{r}", mesh, abstract_full, only=(system,))
        sys_ = a if snap is not None else b
        t = time.perf_counter()
        if state is not None:
          sys_.save(step, state)
          sys_.complete()
          times[name] = time.perf_counter() - t
        else:
          got = jax.block_until_ready(sys_.restore(step, target))
          times[name] = time.perf_counter() - t
          for k in expected:
            if not np.array_equal(np.asarray(got[k]), expected[k]):
              raise AssertionError(f"{system} restored a different {k} ({name})")
          del got
      b.close()
      out.update({f"{'cold' if r == 0 else 'warm'}_{k}_s": v for k, v in times.items()})
  finally:
    cleanup(work)
  return out


def _spawn(system: str, mb: int, leaves: int | None, warm: int,
           scenario: str = "vs_orbax") -> dict[str, Any]:
  cmd = [sys.executable, "-m", "benchmarks.cold", "--child", system, "--mb", str(mb),
         "--warm", str(warm), "--leaves", str(leaves or 0), "--scenario", scenario]
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
  if proc.returncode != 0:
    raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
  return json.loads(proc.stdout.strip().splitlines()[-1])


def run(mb: int, runs: int, leaves: Sequence[int | None], warm: int,
        scenario: str = "vs_orbax") -> dict[str, Any]:
  rows: dict[str, dict[str, dict[str, list[float]]]] = {}
  for r in range(runs):
    for i in range(len(SYSTEMS)):
      system = SYSTEMS[(i + r) % len(SYSTEMS)]  # who goes first moves run to run
      for n in leaves:
        got = _spawn(system, mb, n, warm, scenario)
        by = rows.setdefault(str(n or "16MB-leaves"), {}).setdefault(system, {})
        for k, v in got.items():
          if v is not None:
            by.setdefault(k, []).append(v)
  out: dict[str, Any] = {}
  for n, by in rows.items():
    med = {s: {k: statistics.median(v) for k, v in t.items()} for s, t in by.items()}
    orbax = med["orbax_snapshotter"]
    phases = (("save", "load") if scenario == "vs_orbax" else ELASTIC_PHASES)
    out[n] = {
        "systems": med,
        "spread": {s: {k: [round(min(v), 4), round(max(v), 4)] for k, v in t.items()}
                   for s, t in by.items()},
        "cold_over_warm": {s: {p: m[f"cold_{p}_s"] / m[f"warm_{p}_s"] for p in phases
                               if m.get(f"warm_{p}_s")} for s, m in med.items()},
        "over_orbax": {s: {k: med[s][k] / orbax[k] for k in med[s] if k in orbax}
                       for s in med if s != "orbax_snapshotter"}}
  return {"mb": mb, "runs": runs, "warm_rounds": warm, "scenario": scenario,
          "by_leaves": out}


def main(argv: Sequence[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog="benchmarks.cold", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--mb", type=int, default=256)
  p.add_argument("--runs", type=int, default=5)
  p.add_argument("--leaves", type=int, nargs="*", default=[0, 500],
                 help="leaf counts (0: 16 MB leaves)")
  p.add_argument("--warm", type=int, default=3, help="rounds after the first, per process")
  p.add_argument("--scenario", choices=("vs_orbax", "elastic"), default="vs_orbax",
                 help="elastic: Orbax's Snapshotter benchmark (save on 2 slices, load onto 1; "
                      "a new one saves on 1, loads onto 2), two rounds a process")
  p.add_argument("--child", choices=SYSTEMS, help=argparse.SUPPRESS)
  p.add_argument("--out", default=None, help="default bench-results/cold[-elastic].json")
  a = p.parse_args(argv)
  if a.child:
    setup_cpu_devices(8)
    leaves = a.leaves[0] or None
    print(json.dumps(child(a.child, a.mb, leaves, a.warm) if a.scenario == "vs_orbax"
                     else child_elastic(a.child, a.mb, leaves)))
    return 0
  out = a.out or f"bench-results/cold{'' if a.scenario == 'vs_orbax' else '-elastic'}.json"
  emit("cold", run(a.mb, a.runs, [n or None for n in a.leaves], a.warm, a.scenario), out)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
