"""Per-step overhead on the demo's own job, by replica interval.

``python -m benchmarks.demo_overhead``: the demo's model (``snapstore.demo``,
107 leaves) on 4 local host processes (``snapstore launch``, 2 CPU devices
each, 2 failure domains), each step padded to ``--step-s`` (what the demo
does), run with snapshots off and then on at each ``--replica-intervals``
value, one job after another in the same process. Reports the median and
mean step of each job and their ratios to the job without snapshots.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Sequence
from pathlib import Path

from benchmarks._common import cleanup, demo_job, emit, ram_dir, step_intervals


def _job(work: Path, name: str, steps: int, step_s: float, extra: list[str]) -> dict:
  _, out = demo_job(work, name, steps, ["--hosts-per-domain", "2", "--min-step-s", str(step_s),
                                         "--no-digest-restore", *extra], num_hosts=4)
  steps_s = step_intervals(json.loads((out / "inc0-host0.json").read_text()))
  return {"median_step_s": statistics.median(steps_s), "mean_step_s": statistics.mean(steps_s)}


def run(steps: int, step_s: float, replica_intervals: Sequence[int]) -> dict:
  work = ram_dir("snapstore-demo-overhead-")
  try:
    base = _job(work, "off", steps, step_s, ["--snapshots", "0"])
    rows = {}
    for k in replica_intervals:
      row = _job(work, f"ri{k}", steps, step_s, ["--replica-interval", str(k)])
      row["overhead_median"] = row["median_step_s"] / base["median_step_s"] - 1
      row["overhead_mean"] = row["mean_step_s"] / base["mean_step_s"] - 1
      rows[str(k)] = row
  finally:
    cleanup(work)
  return {"steps": steps, "step_s": step_s, "snapshots_off": base, "replica_interval": rows}


def main(argv: Sequence[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog="benchmarks.demo_overhead", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--steps", type=int, default=40)
  p.add_argument("--step-s", type=float, default=0.3)
  p.add_argument("--replica-intervals", type=int, nargs="+", default=[1, 10])
  p.add_argument("--out", default="bench-results/demo_overhead.json")
  args = p.parse_args(argv)
  emit("demo_overhead", run(args.steps, args.step_s, args.replica_intervals), args.out)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
