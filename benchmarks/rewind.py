"""Steps lost per failure, with and without snapshots, over real runs.

``python -m benchmarks.rewind --intervals 10 50 100 --kills 4``: for each
Orbax checkpoint interval, the example transformer trains in a real process
(``snapstore launch``, 1 host x 2 CPU devices, Orbax on a local dir) and is
SIGKILLed ``--kills`` times at seeded random steps, once with snapshots every
step and once without (GCS-only style). Each restart restores and reports its
rewind (newest step saved minus restored step). Kill steps are stratified:
one per checkpoint period, at offsets ``(r + j / kills) * interval`` with ``r``
uniform, so each kill step is uniformly distributed and the mean converges
with few kills.

Each case also records what the goodput simulator needs to predict it: the
median step time, the snapshot commit time (capture + drain, from the
manager's metrics) and the checkpoint commit lag in steps (steps completed
between a save's return and its Orbax directory appearing, watched from
outside); ``benchmarks.goodput --check`` compares.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks._common import cleanup, demo_job, emit, ram_dir, step_intervals


def _kill_steps(interval: int, kills: int, rng: random.Random) -> list[int]:
  r = rng.random()
  return [interval * (j + 1) + 1 + int(((r + j / kills) % 1.0) * interval)
          for j in range(kills)]


def _run(work: Path, name: str, interval: int, kill_steps: list[int], snapshots: bool,
         env: dict[str, str], step_s: float) -> dict:
  from snapstore.testing import Kill
  steps = kill_steps[-1] + 3
  ckpt = work / f"ckpt-{name}"
  seen: dict[str, float] = {}  # checkpoint step -> when its directory became final
  done = threading.Event()

  def watch() -> None:
    while not done.wait(0.001):
      if ckpt.is_dir():
        for d in os.listdir(ckpt):
          if d.isdigit() and d not in seen:
            seen[d] = time.time()
  watcher = threading.Thread(target=watch, daemon=True)
  watcher.start()
  try:
    incs, out = demo_job(
        work, name, steps,
        ["--persistent", str(ckpt), "--checkpoint-every", str(interval),
         "--snapshots", str(int(snapshots)), "--no-digest-restore", "--min-step-s", str(step_s)],
        num_hosts=1, kills=[Kill(0, s, incarnation=i) for i, s in enumerate(kill_steps)],
        timeout_s=900, env=env)
  finally:
    done.set()
    watcher.join()
  rewinds = [inc.restore["rewind_steps"] for inc in incs[1:]]
  reports = [json.loads((out / f"inc{inc.number}-host0.json").read_text()) for inc in incs]
  # Step time: consecutive steps of every incarnation, past its first two
  # (compilation).
  diffs = []
  for rep in reports:
    diffs += step_intervals(rep, skip=2)
  step_s = statistics.median(diffs)
  # Snapshot commit time (capture + drain), pooled over the incarnations.
  ms = [rep["save_metrics"] for rep in reports if "save_metrics" in rep]
  n = max(sum(m["snapshots_committed"] for m in ms), 1)
  snap_commit = sum(m["capture_seconds_total"] + m["drain_seconds_total"] for m in ms) / n
  # Commit lag in steps: steps that completed (in the incarnation that saved
  # the checkpoint) after its save returned and before its directory was
  # final. Counted, not divided by a median step: steps slow down while
  # Orbax writes, so seconds / median step would overstate it.
  lag_steps = {}
  for step, t_final in seen.items():
    for rep in reports:
      t_saved = rep["times"].get(step)
      if t_saved is not None and t_saved <= t_final:
        lag_steps[step] = sum(1 for k, t in rep["times"].items()
                              if int(k) > int(step) and t <= t_final) + 0.5
  ckpt_lag = statistics.mean(lag_steps.values())
  return {"rewinds": rewinds, "mean": statistics.mean(rewinds), "max": max(rewinds),
          "restored": [inc.restore["step"] for inc in incs[1:]],
          "sources": [inc.restore["source"] for inc in incs[1:]],
          "step_s": step_s, "snapshot_commit_s": snap_commit,
          "ckpt_commit_steps": ckpt_lag, "ckpt_commit_steps_each": lag_steps}


def run(intervals: Sequence[int], kills: int, seed: int, step_s: float,
        kills_with: int | None = None) -> dict:
  work = ram_dir("snapstore-rewind-")
  env = {"JAX_COMPILATION_CACHE_DIR": str(work / "jax-cache"),
         "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
  rng = random.Random(seed)
  cases = []
  try:
    for c in intervals:
      ks = _kill_steps(c, kills, rng)
      case = {"checkpoint_interval": c, "kill_steps": ks}
      for mode, snaps in (("with", True), ("without", False)):
        mine = ks[:kills_with] if snaps and kills_with else ks
        case[mode] = dict(_run(work, f"c{c}-{mode}", c, mine, snaps, env, step_s),
                          kill_steps=mine)
      case["mean_ratio_without_vs_with"] = (case["without"]["mean"] /
                                            max(case["with"]["mean"], 1.0))
      cases.append(case)
  finally:
    cleanup(work)
  return {"seed": seed, "kills_per_case": kills, "min_step_s": step_s, "cases": cases}


def main(argv: Sequence[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog="benchmarks.rewind", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--intervals", type=int, nargs="+", default=[10, 50, 100])
  p.add_argument("--kills", type=int, default=4)
  p.add_argument("--kills-with", type=int, default=None,
                 help="with snapshots, only the first this many kills (the rewind is "
                      "0 or 1 at any step; the GCS-only mean needs every kill)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--step-s", type=float, default=0.1,
                 help="pad each step to this long: real steps outlast a small "
                      "checkpoint's commit; the tiny model's 15 ms steps do not")
  p.add_argument("--out", default="bench-results/rewind.json")
  args = p.parse_args(argv)
  emit("rewind", run(args.intervals, args.kills, args.seed, args.step_s, args.kills_with),
       args.out)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
