"""Per-step overhead on the demo's own job, by replica interval.

``python -m benchmarks.demo_overhead``: the demo's model (``snapstore.demo``,
107 leaves) on 4 local host processes (``snapstore launch``, 2 CPU devices
each, 2 failure domains), each step padded to ``--step-s`` (what the demo
does), run with snapshots off and then on at each ``--replica-intervals``
value, one job after another in the same process; with ``--live-every``,
also in place (JAX's fault-tolerance mode, ``snapstore.recovery``) with
that many steps per ``live()`` block, and in place with snapshots off (the
mode's own cost, at the first ``--live-every``). Reports the median and mean step of
each job and their ratios to the job without snapshots.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Sequence
from pathlib import Path

from benchmarks._common import cleanup, demo_job, emit, ram_dir, step_intervals


def _job(work: Path, name: str, steps: int, step_s: float, extra: list[str],
         in_place: bool = False) -> dict:
  _, out = demo_job(work, name, steps, ["--hosts-per-domain", "2", "--min-step-s", str(step_s),
                                         "--no-digest-restore", *extra], num_hosts=4,
                    in_place=in_place)
  steps_s = step_intervals(json.loads((out / "inc0-host0.json").read_text()))
  return {"median_step_s": statistics.median(steps_s), "mean_step_s": statistics.mean(steps_s)}


def _vs(row: dict, base: dict) -> dict:
  row["overhead_median"] = row["median_step_s"] / base["median_step_s"] - 1
  row["overhead_mean"] = row["mean_step_s"] / base["mean_step_s"] - 1
  return row


def run(steps: int, step_s: float, replica_intervals: Sequence[int],
        live_every: Sequence[int] = ()) -> dict:
  work = ram_dir("snapstore-demo-overhead-")
  try:
    base = _job(work, "off", steps, step_s, ["--snapshots", "0"])
    rows = {str(k): _vs(_job(work, f"ri{k}", steps, step_s, ["--replica-interval", str(k)]),
                        base) for k in replica_intervals}
    in_place = {str(k): _vs(_job(work, f"live{k}", steps, step_s,
                                 ["--replica-interval", str(replica_intervals[0]),
                                  "--live-every", str(k)], in_place=True), base)
                for k in live_every}
    if live_every:  # the mode's own cost: in place, no snapshots
      in_place_off = _vs(_job(work, "live-off", steps, step_s,
                              ["--snapshots", "0", "--live-every", str(live_every[0])],
                              in_place=True), base)
  finally:
    cleanup(work)
  out = {"steps": steps, "step_s": step_s, "snapshots_off": base, "replica_interval": rows}
  if in_place:
    out["in_place_live_every"] = in_place
    out["in_place_snapshots_off"] = in_place_off
  return out


def main(argv: Sequence[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog="benchmarks.demo_overhead", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--steps", type=int, default=40)
  p.add_argument("--step-s", type=float, default=0.3)
  p.add_argument("--replica-intervals", type=int, nargs="+", default=[1, 10])
  p.add_argument("--live-every", type=int, nargs="*", default=[],
                 help="also run in place (at the first replica interval) with this many "
                      "steps per live() block, each value a job")
  p.add_argument("--out", default="bench-results/demo_overhead.json")
  args = p.parse_args(argv)
  emit("demo_overhead", run(args.steps, args.step_s, args.replica_intervals, args.live_every),
       args.out)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
