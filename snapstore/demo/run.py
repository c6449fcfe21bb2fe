"""``snapstore demo``: SIGKILL one host of a 4-process job, recover from RAM
snapshots, and side by side from Orbax checkpoints on (emulated) GCS only.

Both runs are real multi-process jobs (``snapstore launch``: 4 hosts x 2 CPU
devices, ``jax.distributed`` with gloo, 2 failure domains). The killed host is
replaced by an empty one (its RAM store is wiped). The snapshot run restores
its shards from the replicas in the other domain; the GCS-only run restores
the last Orbax checkpoint and recomputes from there. Both continue to the
same final step and must end with bitwise equal global states.

Each step is padded to ``step_s`` (default 0.3 s) with a sleep: the toy model
computes in ~0.1 s, a real one in seconds, and the pad stands for the
accelerator computing while the host's cores are free. Recompute time scales
with it; the steps lost do not.
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

from .._backends.hostfiles.store import host_dir, read_progress
from ..launch import Incarnation, Kill, launch

HOSTS, DEVICES_PER_HOST, KILLED_HOST = 4, 2, 1
Progress = Callable[[str, int], None]


def _run(name: str, *, work: Path, persistent: str, snapshots: bool, kill_step: int,
         checkpoint_every: int, total_steps: int, step_s: float, env: dict[str, str],
         progress: Progress) -> dict[str, Any]:
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
                   "--min-step-s", str(step_s)],
                  num_hosts=HOSTS, devices_per_host=DEVICES_PER_HOST, store_dir=store,
                  run_id="demo", kills=[Kill(KILLED_HOST, kill_step, lose_store=True)],
                  timeout_s=600, log_dir=out, env=env)
  finally:
    done.set()
    watcher.join()
    shutil.rmtree(store, ignore_errors=True)
  progress(name, total_steps)
  return _summarize(incs, out, kill_step)


def _summarize(incs: list[Incarnation], out: Path, kill_step: int) -> dict[str, Any]:
  if len(incs) != 2 or not incs[1].ok:
    raise RuntimeError(f"expected one failure and one clean restart, got "
                       f"{[i.as_dict() for i in incs]}; logs in {out}")
  first, second = incs
  before = json.loads((out / "inc0-host0.json").read_text())
  after = json.loads((out / "inc1-host0.json").read_text())
  r = after["restore"]
  times = {int(k): v for k, v in after["times"].items()}
  kill_t = first.kill_time
  phases = {
      "detection_s": first.ended - kill_t,       # supervisor sees the death, tears down
      "restart_s": after["restore_start"] - first.ended,  # processes, jax init, model
      "restore_s": after["restore_end"] - after["restore_start"],
      # The first step after the restore carries the new processes' warm-up
      # (loading compiled programs, first transfers); the rest is pure replay.
      "first_step_s": times[r["step"] + 1] - after["restore_end"],
      "replay_s": times[kill_step] - times[r["step"] + 1],
  }
  phases["kill_to_first_new_step_s"] = times[kill_step + 1] - kill_t
  return {
      "restored_step": r["step"], "source": r["source"], "rewind_steps": r["rewind_steps"],
      **phases,
      "bytes_read_gcs": r["bytes_read"].get("persistent", 0),
      "bytes_read_ram": r["bytes_read"].get("snapshot", 0),
      "bytes_exchanged": r["bytes_read"].get("exchanged", 0),
      "restore_timings": r["timings"], "notes": r["notes"],
      "step_s": _median_step(before, kill_step),
      "final_digest": after["digests"][str(max(int(k) for k in after["digests"]))],
      "timeline": {"start": first.started, "kill": kill_t,
                   "restart": second.started,
                   "before": sorted((int(s), t) for s, t in before["times"].items()),
                   "after": sorted(times.items())},
  }


def _median_step(report: dict[str, Any], kill_step: int) -> float:
  """Median step interval before the failure, past the first (compiling) steps."""
  t = [report["times"][str(s)] for s in range(3, kill_step) if str(s) in report["times"]]
  return float(np.median(np.diff(t))) if len(t) > 2 else float("nan")


def run_demo(*, kill_step: int = 37, checkpoint_every: int = 20, total_steps: int = 45,
             step_s: float = 0.3, persistent_dir: str | None = None,
             report: str = "demo-report.json",
             plot: str = "demo-timeline.png",
             progress: Progress = lambda run, s: None) -> dict[str, Any]:
  if not 0 < kill_step < total_steps:
    raise ValueError(f"need 0 < kill_step ({kill_step}) < total_steps ({total_steps})")
  if kill_step % checkpoint_every == 0:
    raise ValueError(f"kill_step {kill_step} is a checkpoint step; pick another")
  from .gcs_emulator import GcsEmulator  # noqa: PLC0415
  with contextlib.ExitStack() as stack:
    base = Path("/dev/shm") if os.path.isdir("/dev/shm") else Path(tempfile.gettempdir())
    work = Path(tempfile.mkdtemp(prefix="snapstore-demo-", dir=base))
    stack.callback(shutil.rmtree, work, ignore_errors=True)
    env = {"JAX_COMPILATION_CACHE_DIR": str(work / "jax-cache"),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    if persistent_dir is None:
      gcs = stack.enter_context(GcsEmulator(bucket="ckpt"))
      env.update(gcs.env())
      where = lambda run: gcs.url(f"demo-{os.getpid()}-{run}")  # noqa: E731
    else:
      where = lambda run: str(Path(persistent_dir, run).absolute())  # noqa: E731
    runs = {}
    for name, snapshots in (("snapstore", True), ("gcs-only", False)):
      runs[name] = _run(name, work=work, persistent=where(name), snapshots=snapshots,
                        kill_step=kill_step, checkpoint_every=checkpoint_every,
                        total_steps=total_steps, step_s=step_s, env=env,
                        progress=progress)
  snap, plain = runs["snapstore"]["step_s"], runs["gcs-only"]["step_s"]
  out = {
      "hosts": HOSTS, "devices_per_host": DEVICES_PER_HOST, "killed_host": KILLED_HOST,
      "kill_step": kill_step, "checkpoint_every": checkpoint_every,
      "total_steps": total_steps, "min_step_s": step_s,
      "persistent": "gcs-emulator" if persistent_dir is None else persistent_dir,
      "runs": runs,
      "final_states_equal": runs["snapstore"]["final_digest"] == runs["gcs-only"]["final_digest"],
      "step_s_with_snapshots": snap, "step_s_without": plain,
      "snapshot_overhead": snap / plain - 1.0,
  }
  Path(report).write_text(json.dumps(out, indent=2))
  _plot(runs, kill_step, plot)
  out["report"], out["plot"] = str(Path(report).absolute()), str(Path(plot).absolute())
  return out


def _plot(runs: dict[str, Any], kill_step: int, path: str) -> None:
  import matplotlib  # noqa: PLC0415
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415
  fig, ax = plt.subplots(figsize=(8, 4))
  for (name, run), color in zip(runs.items(), ("tab:green", "tab:red")):
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
  ax.set_xlabel("seconds from the SIGKILL (dotted); dashed: the job restarts")
  ax.set_ylabel("step")
  ax.legend(loc="lower right", fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
