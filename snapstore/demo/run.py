"""``snapstore demo``: SIGKILL one host of a 4-process job, three ways, side by side.

The same job (``snapstore launch``: 4 hosts x 2 CPU devices, ``jax.distributed``
with gloo, 2 failure domains) and the same kill, run three times:

- ``gcs-only``: Orbax checkpoints on (emulated) GCS only; the whole job
  restarts and resumes from the last checkpoint (what users have today);
- ``snapstore-restart``: per-step RAM snapshots; the whole job restarts and
  resumes from the freshest snapshot;
- ``snapstore-in-place``: per-step RAM snapshots and JAX's fault-tolerance
  mode; the survivors keep running, the killed host alone is replaced, and
  it heals from its peers' RAM (:mod:`snapstore.recovery`).

The killed host is replaced by an empty one (its RAM store is wiped). All
three continue to the same final step and must end with bitwise equal states.

Each step is padded to ``step_s`` with a sleep: the toy model computes in
a fraction of it, a real one in seconds, and the pad stands for the accelerator
computing while the host's cores are free. Recompute time scales with it;
the steps lost do not.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from .._backends import host_dir, read_progress
from ..testing import Incarnation, Kill, launch

HOSTS, DEVICES_PER_HOST, KILLED_HOST = 4, 2, 1
Progress = Callable[[str, int, int], None]  # (run, step, round)


RUNS = {  # name -> (snapshots, in place)
    "gcs-only": (False, False),
    "snapstore-restart": (True, False),
    "snapstore-in-place": (True, True),
}


def _run(name: str, *, work: Path, persistent: str, snapshots: bool, in_place: bool,
         kill_step: int, checkpoint_every: int, total_steps: int, step_s: float,
         replica_interval: int, env: dict[str, str],
         progress: Callable[[str, int], None]) -> dict[str, Any]:
  out = work / name
  out.mkdir()
  store = work / f"store-{name}"
  done = threading.Event()

  def poll() -> None:  # progress from host 0's store, while the job runs.
    while not done.wait(0.3):
      progress(name, max(read_progress(host_dir(store, "demo", 0))[0], 0))

  watcher = threading.Thread(target=poll, daemon=True)
  watcher.start()
  try:
    incs = launch("snapstore.demo.worker",
                  ["--steps", str(total_steps), "--out", str(out), "--store", str(store),
                   "--run-id", "demo", "--persistent", persistent,
                   "--checkpoint-every", str(checkpoint_every), "--hosts-per-domain", "2",
                   "--snapshots", "1" if snapshots else "0", "--no-digest-restore",
                   "--min-step-s", str(step_s), "--replica-interval", str(replica_interval)],
                  num_hosts=HOSTS, devices_per_host=DEVICES_PER_HOST, store_dir=store,
                  run_id="demo", kills=[Kill(KILLED_HOST, kill_step, lose_store=True)],
                  timeout_s=600, log_dir=out, env=env, in_place=in_place)
  finally:
    done.set()
    watcher.join()
    shutil.rmtree(store, ignore_errors=True)
  progress(name, total_steps)
  return _summarize(incs, out, kill_step, total_steps, in_place)


def _summarize(incs: list[Incarnation], out: Path, kill_step: int, total_steps: int,
               in_place: bool) -> dict[str, Any]:
  """Host 0's view of the recovery (host 0 survives the kill in every run)."""
  expected = 1 if in_place else 2
  if len(incs) != expected or not incs[-1].ok or (in_place and incs[0].fallback):
    want = "one healed incarnation" if in_place else "one failure and one clean restart"
    raise RuntimeError(f"expected {want}, "
                       f"got {[i.as_dict() for i in incs]}; logs in {out}")
  first, last = incs[0], incs[-1]
  before = json.loads((out / "inc0-host0.json").read_text())
  after = json.loads((out / f"inc{last.number}-host0.json").read_text())
  r = after["restores"][-1]
  times = {int(k): v for k, v in after["times"].items()}
  kill_t = first.kill_time
  if kill_t is None:
    raise RuntimeError(f"the kill did not fire; logs in {out}")
  # Every process restores at once (one exchange opens the restore), so it
  # starts when the last of them gets there: host 0, first up, otherwise
  # counts the others' start-up in its own restore call.
  begun = max(rs[-1]["started"] for f in out.glob(f"inc{last.number}-host*.json")
              if (rs := [x for x in json.loads(f.read_text())["restores"]
                         if x["started"] >= kill_t]))
  if in_place:  # one process all along: its marks say when it saw the failure
    failed_at = min(t for n, t in after["phases"] if n.startswith("failed") and t >= kill_t)
    phases = {"detection_s": failed_at - kill_t,
              "restart_s": begun - failed_at}  # waiting for the replacement
    pre_kill = {s: t for s, t in before["times"].items() if t < kill_t}
  else:
    phases = {"detection_s": first.ended - kill_t,  # the supervisor tears the job down
              "restart_s": begun - first.ended}  # processes, jax, model
    pre_kill = before["times"]
  phases.update({
      "restore_s": r["ended"] - begun,
      # The first step after the restore carries the warm-up (compiling for
      # the new mesh or process, first transfers); the rest is pure replay.
      "first_step_s": times[r["step"] + 1] - r["ended"],
      "replay_s": (times[kill_step] - times[r["step"] + 1]
                   if r["step"] < kill_step else 0.0),
      "kill_to_first_new_step_s": times[kill_step + 1] - kill_t,
      "wall_to_final_step_s": times[total_steps] - first.started,
  })
  return {
      "restored_step": r["step"], "source": r["source"], "rewind_steps": r["rewind_steps"],
      **phases,
      "bytes_read_gcs": r["bytes_read"].get("persistent", 0),
      "bytes_read_ram": r["bytes_read"].get("snapshot", 0),
      "bytes_exchanged": r["bytes_read"].get("exchanged", 0),
      "processes_restarted": len(first.replaced) if in_place else HOSTS,
      "restore_timings": r["timings"], "notes": r["notes"],
      "step_s": _median_step(pre_kill, kill_step),
      "final_digest": after["digests"][str(max(int(k) for k in after["digests"]))],
      "timeline": {"start": first.started, "kill": kill_t,
                   "restart": begun,
                   "before": sorted((int(s), t) for s, t in pre_kill.items()),
                   "after": sorted((s, t) for s, t in times.items() if t >= r["ended"])},
  }


def _median_step(times: dict[str, float], kill_step: int) -> float:
  """Median step interval before the failure, past the first (compiling) steps."""
  t = [times[str(s)] for s in range(3, kill_step) if str(s) in times]
  return float(np.median(np.diff(t))) if len(t) > 2 else float("nan")


def run_demo(*, kill_step: int = 58, checkpoint_every: int = 30, total_steps: int = 62,
             step_s: float = 0.3, replica_interval: int = 2,
             persistent_dir: str | None = None,
             report: str = "demo-report.json",
             plot: str = "demo-timeline.png",
             rounds: int = 1,
             progress: Progress = lambda run, s, i: None) -> dict[str, Any]:
  """Runs the three-way demo ``rounds`` times (module doc). Returns the
  first round's report (``runs``: each run's figures; the timeline plot is
  of it), with ``rounds`` (every round's) and ``summary`` (each figure's
  median, min and max over the rounds); writes it to ``report``."""
  if not 0 < kill_step < total_steps:
    raise ValueError(f"need 0 < kill_step ({kill_step}) < total_steps ({total_steps})")
  if kill_step % checkpoint_every == 0:
    raise ValueError(f"kill_step {kill_step} is a checkpoint step; pick another")
  if rounds < 1:
    raise ValueError(f"rounds must be >= 1, got {rounds}")
  from .gcs_emulator import GcsEmulator
  with contextlib.ExitStack() as stack:
    base = Path("/dev/shm") if os.path.isdir("/dev/shm") else Path(tempfile.gettempdir())
    work = Path(tempfile.mkdtemp(prefix="snapstore-demo-", dir=base))
    failed: list[BaseException] = []  # (kept when a run fails: its logs hold the stacks)

    def clean() -> None:
      if not failed:
        shutil.rmtree(work, ignore_errors=True)
    stack.callback(clean)
    env: dict[str, str] = {}
    if persistent_dir is None:
      gcs = stack.enter_context(GcsEmulator(bucket="ckpt"))
      env.update(gcs.env())
      where = lambda run: gcs.url(f"demo-{os.getpid()}-{run}")  # noqa: E731
    else:
      where = lambda run: str(Path(persistent_dir, run).absolute())  # noqa: E731
    done: list[dict[str, Any]] = []
    try:
      for i in range(rounds):
        here = work / f"round-{i}" if rounds > 1 else work
        here.mkdir(exist_ok=True)
        # each round with its own compilation cache: the rounds start alike
        cache = {"JAX_COMPILATION_CACHE_DIR": str(here / "jax-cache"),
                 "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
        runs = {}

        def round_progress(run: str, step: int, i: int = i) -> None:
          progress(run, step, i)
        for name, (snapshots, in_place) in RUNS.items():
          tag = f"{name}-{i}" if rounds > 1 else name
          runs[name] = _run(name, work=here, persistent=where(tag), snapshots=snapshots,
                            in_place=in_place, kill_step=kill_step,
                            checkpoint_every=checkpoint_every, total_steps=total_steps,
                            step_s=step_s, replica_interval=replica_interval,
                            env={**env, **cache},
                            progress=round_progress)
        done.append(_compare(runs))
    except Exception as e:
      failed.append(e)
      raise
  out = {
      "hosts": HOSTS, "devices_per_host": DEVICES_PER_HOST, "killed_host": KILLED_HOST,
      "kill_step": kill_step, "checkpoint_every": checkpoint_every,
      "replica_interval": replica_interval,
      "total_steps": total_steps, "min_step_s": step_s,
      "persistent": "gcs-emulator" if persistent_dir is None else persistent_dir,
      **done[0],
      "final_states_equal": all(r["final_states_equal"] for r in done),
      "rounds": done, "summary": _summary(done),
  }
  Path(report).write_text(json.dumps(out, indent=2))
  _plot(done[0]["runs"], kill_step, plot)
  out["report"], out["plot"] = str(Path(report).absolute()), str(Path(plot).absolute())
  return out


def _compare(runs: dict[str, Any]) -> dict[str, Any]:
  """One round's three runs side by side: ratios to the GCS-only run."""
  plain = runs["gcs-only"]["step_s"]
  snap = float(np.median([runs[n]["step_s"] for n in RUNS if RUNS[n][0]]))
  return {
      "runs": runs,
      "final_states_equal": len({r["final_digest"] for r in runs.values()}) == 1,
      "kill_to_first_new_step_vs_gcs_only": {
          n: r["kill_to_first_new_step_s"] / runs["gcs-only"]["kill_to_first_new_step_s"]
          for n, r in runs.items()},
      "step_s_with_snapshots": snap, "step_s_without": plain,
      "snapshot_overhead": snap / plain - 1.0,
      "snapshot_overhead_by_run": {n: runs[n]["step_s"] / plain - 1.0
                                   for n in RUNS if RUNS[n][0]},
  }


#: the figures summarized over rounds: name -> (where in a round, per run)
SUMMARY = {
    "kill_to_first_new_step_s": lambda r, n: r["runs"][n]["kill_to_first_new_step_s"],
    "kill_to_first_new_step_vs_gcs_only": lambda r, n: r["kill_to_first_new_step_vs_gcs_only"][n],
    "wall_to_final_step_s": lambda r, n: r["runs"][n]["wall_to_final_step_s"],
    "rewind_steps": lambda r, n: r["runs"][n]["rewind_steps"],
    "step_s": lambda r, n: r["runs"][n]["step_s"],
    "step_overhead_vs_gcs_only": lambda r, n: r["runs"][n]["step_s"] / r["step_s_without"] - 1,
}


def _summary(rounds: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
  """Each :data:`SUMMARY` figure of each run: median, min and max over the rounds."""
  out: dict[str, dict[str, dict[str, float]]] = {}
  for key, get in SUMMARY.items():
    out[key] = {}
    for name in RUNS:
      vals = [float(get(r, name)) for r in rounds]
      out[key][name] = {"median": float(np.median(vals)), "min": min(vals), "max": max(vals)}
  return out


def _plot(runs: dict[str, Any], kill_step: int, path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(8, 4))
  colors = ("tab:red", "tab:orange", "tab:green")  # one a run, for up to three runs
  for (name, run), color in zip(runs.items(), colors, strict=False):
    tl = run["timeline"]
    t0 = tl["kill"]  # both runs aligned at their SIGKILL
    for part, style in (("before", "."), ("after", "x")):
      pts = tl[part]
      ax.plot([t - t0 for _, t in pts], [s for s, _ in pts], style, ms=3, color=color,
              label=(f"{name}: restored step {run['restored_step']} ({run['source']}), "
                     f"rewind {run['rewind_steps']}") if part == "after" else None)
    ax.axvline(tl["restart"] - t0, color=color, ls="--", lw=0.8)
  ax.axvline(0, color="black", ls=":", lw=0.8)
  ax.axhline(kill_step, ls="--", color="grey", lw=0.8,
             label=f"SIGKILL host {KILLED_HOST} at step {kill_step}")
  ax.set_xlabel("seconds from the SIGKILL (dotted); dashed: the restore starts")
  ax.set_ylabel("step")
  ax.legend(loc="lower right", fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
