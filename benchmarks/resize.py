"""No spare host: what a lost host costs with GCS only, with snapstore
waiting for a replacement, and with snapstore going on without it.

``python -m benchmarks.resize``: the demo's job (``snapstore launch``: 4
hosts x 2 CPU devices, ``jax.distributed`` with gloo, 2 failure domains,
global batch 24) loses host 1 to a SIGKILL at ``--kill-step``; its
replacement (an empty host) can start only ``--delay`` seconds later. Three
runs, side by side:

- ``gcs-only``: Orbax checkpoints (GCS emulator, every ``--checkpoint-every``
  steps) only; the whole job restarts when the capacity is back and
  resumes from the last checkpoint;
- ``snapstore-wait``: per-step RAM snapshots, in place; the survivors wait
  for the replacement, which heals from their RAM;
- ``snapstore-resize``: the same with ``--min-hosts 3``: the survivors go on
  at once on 3 hosts (6 devices) from the lost host's replicas, and grow
  back to 4 when the replacement joins.

Each step is padded to ``--step-s`` on 8 devices, and proportionally
longer on fewer (the same global batch, fewer devices to share it: what an
accelerator job sees). Keys, per run: ``time_lost_s``, the wall time from
the kill to the last step minus what the job would have taken for the steps
left at the full pre-kill step time; ``steps_lost``, steps computed twice
(the kill step minus the step restored, plus any rewind at a grow);
``first_step_after_kill_s``; ``full_size_after_kill_s`` (back on 8
devices); and for the resize run, ``steps_while_short`` and
``throughput_while_short`` (samples per second on 3 hosts over those on 4
before the kill). ``time_lost_vs_gcs_only`` compares the runs.
``final_states_equal``: gcs-only and snapstore-wait end with bitwise equal
states (the same mesh all along); the resize run trains some steps on 6
devices, whose reductions add in another order, so its final loss is
compared instead (``final_loss_rel_diff``).
All four processes share this machine's cores: the ratios are the result.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks._common import cleanup, emit, ram_dir

HOSTS, DEVICES_PER_HOST, KILLED_HOST = 4, 2, 1
RUNS = {  # name -> (snapshots, in place, min_hosts)
    "gcs-only": (False, False, None),
    "snapstore-wait": (True, True, None),
    "snapstore-resize": (True, True, 3),
}


def run_one(name: str, *, work: Path, persistent: str, kill_step: int, steps: int,
            checkpoint_every: int, step_s: float, delay_s: float,
            env: dict[str, str]) -> dict[str, Any]:
  from snapstore.testing import Kill, launch
  snapshots, in_place, min_hosts = RUNS[name]
  out = work / name
  out.mkdir()
  store = work / f"store-{name}"
  incs = launch(
      "snapstore.demo.worker",
      ["--steps", str(steps), "--out", str(out), "--store", str(store), "--run-id", "rz",
       "--persistent", persistent, "--checkpoint-every", str(checkpoint_every),
       "--hosts-per-domain", "2", "--snapshots", "1" if snapshots else "0",
       "--no-digest-restore", "--min-step-s", str(step_s), "--batch", "24"],
      num_hosts=HOSTS, devices_per_host=DEVICES_PER_HOST, store_dir=store, run_id="rz",
      kills=[Kill(KILLED_HOST, kill_step, lose_store=True)], timeout_s=900, log_dir=out,
      env=env, in_place=in_place, min_hosts=min_hosts, replacement_delay_s=delay_s,
      max_incarnations=2)
  if not incs[-1].ok or (in_place and (len(incs) != 1 or incs[0].fallback)):
    raise RuntimeError(f"{name}: expected one recovery, got {[i.as_dict() for i in incs]}; "
                       f"logs in {out}")
  kill_t = incs[0].kill_time
  if kill_t is None:
    raise RuntimeError(f"{name}: the kill did not fire; logs in {out}")
  reports = [json.loads((out / f"inc{i.number}-host0.json").read_text()) for i in incs]
  cleanup(store)
  return summarize(reports, kill_t, kill_step, steps)


def summarize(reports: list[dict[str, Any]], kill_t: float, kill_step: int,
              steps: int) -> dict[str, Any]:
  """Host 0's view (host 0 survives in every run): its reports, one per
  incarnation, oldest first."""
  before = sorted(t for s, t in reports[0]["times"].items() if t < kill_t and int(s) >= 3)
  step_s = statistics.median(b - a for a, b in itertools.pairwise(before))
  after: dict[int, float] = {}  # the last pass over each step
  for r in reports:
    after.update({int(s): t for s, t in r["times"].items() if t >= kill_t})
  restores = [x for r in reports for x in r["restores"] if x["started"] >= kill_t]
  first, later = restores[0], restores[1:]
  full = [x for x in restores if x["devices"] == HOSTS * DEVICES_PER_HOST]
  back = (min(t for s, t in after.items() if s > full[-1]["step"])  # first full-size step
          if full else None)  # (the job ended short)
  out = {
      "restored_step": first["step"], "source": first["source"],
      "steps_lost": max(0, kill_step - first["step"]) + sum(x["rewind_steps"] for x in later),
      "time_lost_s": after[steps] - kill_t - (steps - kill_step) * step_s,
      "first_step_after_kill_s": min(t for s, t in after.items() if s > first["step"]) - kill_t,
      "full_size_after_kill_s": None if back is None else back - kill_t,
      "step_s": step_s,
      "restores": [{k: x[k] for k in ("step", "source", "rewind_steps", "devices")}
                   for x in restores],
      "final_digest": reports[-1]["trained"][str(steps)],
      "final_loss": reports[-1]["losses"][str(steps)],
  }
  short = [x for x in restores if x["devices"] < HOSTS * DEVICES_PER_HOST]
  if short:  # steps on the smaller mesh: after its restore, before the grow's
    lo, hi = short[0]["ended"], full[-1]["started"] if full else float("inf")
    ts = sorted(t for t in after.values() if lo < t < hi)
    out["steps_while_short"] = len(ts)
    out["devices_while_short"] = short[0]["devices"]
    if len(ts) > 2:
      short_s = statistics.median(b - a for a, b in itertools.pairwise(ts[1:]))
      out["step_s_while_short"] = short_s
      out["throughput_while_short"] = step_s / short_s  # the same global batch
  return out


def run(*, kill_step: int, steps: int, checkpoint_every: int, step_s: float,
        delay_s: float, only: Sequence[str] = tuple(RUNS)) -> dict[str, Any]:
  from snapstore.demo.gcs_emulator import GcsEmulator
  work = ram_dir("snapstore-resize-bench-")
  root = str(Path(__file__).resolve().parents[1])
  env = {"JAX_COMPILATION_CACHE_DIR": str(work / "jax-cache"),
         "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
         "PYTHONPATH": os.pathsep.join(
             [root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
  with GcsEmulator(bucket="resize") as gcs:  # (a failed run leaves its logs in work)
    runs = {name: run_one(name, work=work, persistent=gcs.url(f"rz-{name}"),
                          kill_step=kill_step, steps=steps,
                          checkpoint_every=checkpoint_every, step_s=step_s,
                          delay_s=delay_s, env=dict(env, **gcs.env()))
            for name in only}
  cleanup(work)
  out: dict[str, Any] = {
      "hosts": HOSTS, "devices_per_host": DEVICES_PER_HOST, "killed_host": KILLED_HOST,
      "kill_step": kill_step, "steps": steps, "checkpoint_every": checkpoint_every,
      "min_step_s": step_s, "replacement_delay_s": delay_s, "runs": runs}
  if "gcs-only" in runs:
    base = runs["gcs-only"]["time_lost_s"]
    out["time_lost_vs_gcs_only"] = {n: r["time_lost_s"] / base for n, r in runs.items()}
  if {"gcs-only", "snapstore-wait"} <= runs.keys():
    out["final_states_equal"] = (runs["gcs-only"]["final_digest"]
                                 == runs["snapstore-wait"]["final_digest"])
  if len(runs) > 1 and "snapstore-resize" in runs:
    ref = next(r["final_loss"] for n, r in runs.items() if n != "snapstore-resize")
    out["final_loss_rel_diff"] = abs(runs["snapstore-resize"]["final_loss"] - ref) / abs(ref)
  return out


def main(argv: Sequence[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog="benchmarks.resize", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--kill-step", type=int, default=14)
  p.add_argument("--checkpoint-every", type=int, default=10)
  p.add_argument("--step-s", type=float, default=0.5)
  p.add_argument("--delay", type=float, default=20.0,
                 help="seconds from the kill until the replacement host can start")
  p.add_argument("--steps", type=int, default=None,
                 help="last step (default: the kill step, then enough steps to outlast "
                      "the delay on 3 hosts, then 10)")
  p.add_argument("--runs", nargs="+", choices=tuple(RUNS), default=list(RUNS))
  p.add_argument("--out", default="bench-results/resize.json")
  a = p.parse_args(argv)
  if a.kill_step % a.checkpoint_every == 0:
    p.error(f"--kill-step {a.kill_step} is a checkpoint step; pick another")
  steps = a.steps or a.kill_step + int(a.delay / (a.step_s * 4 / 3)) + 10
  emit("resize", run(kill_step=a.kill_step, steps=steps, checkpoint_every=a.checkpoint_every,
                     step_s=a.step_s, delay_s=a.delay, only=a.runs), a.out)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
