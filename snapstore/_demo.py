"""``snapstore demo``: lose the live state at a step, recover from the RAM snapshot
and, side by side, from the Orbax checkpoint on (emulated) GCS only.

Single process, 8 CPU devices (a 2x4 mesh). Both recoveries continue to the
same final step and must end bitwise equal to each other.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from . import SnapshotManager, SnapshotOptions, Source
from .example import ModelConfig, Trainer


def _timed_steps(trainer: Trainer, state: Any, steps: range, mgr: SnapshotManager | None,
                 timeline: list[tuple[str, int, float]], run: str, t0: float,
                 progress: Any) -> tuple[Any, list[float]]:
  times = []
  for s in steps:
    t = time.perf_counter()
    state, loss = trainer.step(state, s)
    loss.block_until_ready()
    if mgr is not None:
      mgr.save(s, state)
    times.append(time.perf_counter() - t)
    timeline.append((run, s, time.perf_counter() - t0))
    progress(run, s)
  return state, times


def run_demo(*, kill_step: int = 37, checkpoint_every: int = 20, total_steps: int = 50,
             persistent_dir: str | None = None, report: str = "demo-report.json",
             plot: str = "demo-timeline.png", progress=lambda run, s: None) -> dict[str, Any]:
  if not 0 < kill_step < total_steps:
    raise ValueError(f"need 0 < kill_step ({kill_step}) < total_steps ({total_steps})")
  from .gcs_emulator import GcsEmulator  # noqa: PLC0415
  with contextlib.ExitStack() as stack:
    if persistent_dir is None:
      gcs = stack.enter_context(GcsEmulator(bucket="ckpt"))
      ckpt = gcs.url(f"demo-{os.getpid()}")
    else:
      ckpt = str(Path(persistent_dir).absolute())
    base = Path("/dev/shm") if os.path.isdir("/dev/shm") else Path(tempfile.gettempdir())
    store = Path(tempfile.mkdtemp(prefix="snapstore-demo-", dir=base))
    stack.callback(shutil.rmtree, store, ignore_errors=True)
    trainer = Trainer(ModelConfig(dim=64, layers=2, seq=32, batch=16))
    opts = SnapshotOptions(interval=1, keep=2, persistent_interval=checkpoint_every,
                           store_dir=store, run_id="demo")
    timeline: list[tuple[str, int, float]] = []
    t0 = time.perf_counter()

    # Warm-up (compilation) outside the measured loop.
    state = trainer.init_state()
    state, _ = trainer.step(state, 0)
    state = trainer.init_state()

    # Before the failure: snapshots every step, Orbax every checkpoint_every.
    mgr = stack.enter_context(SnapshotManager(opts, persistent=ckpt))
    state, snap_times = _timed_steps(trainer, state, range(1, kill_step + 1), mgr,
                                     timeline, "before", t0, progress)
    mgr.wait_until_finished()
    t_fail = time.perf_counter() - t0
    del state  # the failure: the live state is gone.

    results = {}
    finals = {}
    for run, use_snapshots in (("snapstore", True), ("gcs-only", False)):
      t = time.perf_counter()
      t0_run = t - t_fail  # both recoveries start at the failure on the plot
      if use_snapshots:
        r = mgr.restore(trainer.abstract_state())
      else:
        with SnapshotManager(SnapshotOptions(store_dir=store, run_id="demo-empty"),
                             persistent=ckpt) as gcs_only:
          r = gcs_only.restore(trainer.abstract_state())
      restore_s = time.perf_counter() - t
      t = time.perf_counter()
      state, _ = _timed_steps(trainer, r.state, range(r.step + 1, kill_step + 1), None,
                              timeline, run, t0_run, progress)
      recompute_s = time.perf_counter() - t
      state, plain_times = _timed_steps(trainer, state, range(kill_step + 1, total_steps + 1),
                                        None, timeline, run, t0_run, progress)
      finals[run] = jax.tree.map(lambda x: np.asarray(jax.random.key_data(x) if
                                 jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
                                 else x), state)
      results[run] = {
          "restored_step": r.step, "source": r.source.value,
          "rewind_steps": kill_step - r.step, "restore_s": restore_s,
          "recompute_s": recompute_s, "recovery_s": restore_s + recompute_s,
          "bytes_read_gcs": r.bytes_read.get("persistent", 0) if persistent_dir is None else 0,
          "bytes_read_ram": r.bytes_read.get("snapshot", 0),
          "timings": r.timings, "notes": list(r.notes),
      }
      if run == "gcs-only":
        step_plain = float(np.median(plain_times))
    equal = all(np.array_equal(a, b) for a, b in zip(
        jax.tree.leaves(finals["snapstore"]), jax.tree.leaves(finals["gcs-only"])))
    step_snap = float(np.median(snap_times))
    out = {
        "kill_step": kill_step, "checkpoint_every": checkpoint_every,
        "total_steps": total_steps, "persistent": ckpt, "failure_at_s": t_fail,
        "runs": results, "final_states_equal": bool(equal),
        "step_s_with_snapshots": step_snap, "step_s_without": step_plain,
        "snapshot_overhead": step_snap / step_plain - 1.0,
        "state_bytes": int(sum(x.nbytes for x in jax.tree.leaves(finals["snapstore"]))),
        "devices": jax.device_count(),
    }
    Path(report).write_text(json.dumps(out, indent=2))
    _plot(timeline, kill_step, results, plot)
    out["report"], out["plot"] = str(Path(report).absolute()), str(Path(plot).absolute())
    return out


def _plot(timeline: list[tuple[str, int, float]], kill_step: int,
          results: dict[str, Any], path: str) -> None:
  import matplotlib  # noqa: PLC0415
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415
  fig, ax = plt.subplots(figsize=(8, 4))
  for run, color, label in (
      ("before", "black", "training (snapshot every step)"),
      ("snapstore", "tab:green",
       f"snapstore: restored step {results['snapstore']['restored_step']}"),
      ("gcs-only", "tab:red",
       f"GCS-only: restored step {results['gcs-only']['restored_step']}")):
    pts = [(t, s) for r, s, t in timeline if r == run]
    ax.plot([t for t, _ in pts], [s for _, s in pts], ".", ms=3, color=color,
            label=label)
  ax.axhline(kill_step, ls="--", color="grey", lw=0.8, label=f"failure at step {kill_step}")
  ax.set_xlabel("wall time (s)")
  ax.set_ylabel("step")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
