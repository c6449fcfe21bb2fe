"""Real MaxText with snapstore: per-step overhead and recovery, side by side.

``python -m benchmarks.maxtext`` (needs MaxText, Python >= 3.12): MaxText
0.2.5's own pre-training loop (``snapstore.integrations.maxtext.train``, a
tiny decoder, synthetic data) on 2 processes x 2 CPU devices under
``snapstore launch``, four jobs one after another:

* snapshots off and on (every step, one replica), no failure: the median
  step of each and their ratio (the per-step overhead);
* the same two with host 1 SIGKILLed after a seeded step off MaxText's
  checkpoint period: where each resumed (a RAM snapshot, or MaxText's Orbax
  checkpoint), the steps lost, the restore's seconds, and kill -> first new
  step.

``python -m benchmarks.maxtext --elastic``: MaxText's own elastic training
(single controller, Pathways; simulated on 8 CPU devices as 2 slices by
``benchmarks._maxtext_elastic``), snapstore's per-slice snapshots against
MaxText's Orbax alone, seven jobs after a warm-up: for each, a steady run
(per-step overhead; MaxText alone also with Orbax every step), pause-resume
with slice 1 lost after ``--kill``, and replica-resize with slice 1 lost
after ``--kill`` and back at ``--back``
(then MaxText's scale-up): per event, where it restored from, steps lost,
restore seconds, event -> first new step.

MaxText's steps here are ~10-70 ms of compute for a tiny model on 2 shared
cores, so the overhead ratio is a worst case: a snapshot's fixed cost
against almost no step.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks._common import cleanup, emit, ram_dir, step_intervals

MODULE = "snapstore.integrations.maxtext.train"
TINY = ("per_device_batch_size=1", "max_target_length=32",
        "base_emb_dim=32", "base_num_query_heads=2", "base_num_kv_heads=2",
        "base_mlp_dim=64", "base_num_decoder_layers=1", "head_dim=16", "vocab_size=128",
        "hardware=cpu", "enable_checkpointing=true", "async_checkpointing=false",
        "log_period=1000", "enable_goodput_recording=false", "monitor_goodput=false")


def base_yml() -> str:
  import maxtext
  return str(Path(maxtext.__file__).parent / "configs" / "base.yml")


def grain_args(work: Path, records: int = 256, seed: int = 0) -> list[str]:
  """Writes a pre-tokenized ArrayRecord file of tf.train.Example protos (no
  TensorFlow: MaxText's own protos) and returns MaxText's keys for a grain
  pipeline over it."""
  import numpy as np
  from array_record.python.array_record_module import ArrayRecordWriter
  from maxtext.input_pipeline.protos import example_pb2
  path = work / "train.array_record"
  rng = np.random.default_rng(seed)
  writer = ArrayRecordWriter(str(path), "group_size:1")
  for _ in range(records):
    example = example_pb2.Example()
    example.features.feature["text"].int64_list.value.extend(
        rng.integers(3, 120, rng.integers(4, 28)).tolist())
    writer.write(example.SerializeToString())
  writer.close()
  tokenizer = Path(base_yml()).parent.parent / "assets" / "tokenizers" / "tokenizer.llama2"
  return ["dataset_type=grain", f"grain_train_files={path}", "grain_file_type=arrayrecord",
          "tokenize_train_data=false", f"tokenizer_path={tokenizer}", "grain_worker_count=0"]


def run_job(work: Path, name: str, *, steps: int, period: int, snapshots: bool,
            cache_dir: Path, kills: Sequence[Any] = (), timeout_s: float = 280,
            data: Sequence[str] = ("dataset_type=synthetic",),
            extra: Sequence[str] = ()) -> tuple[list[Any], dict[str, Any]]:
  """One MaxText job under ``snapstore launch`` (2 processes x 2 devices):
  its store in ``work/store-<name>`` (removed after), MaxText's Orbax
  checkpoints in ``work/orbax``, reports and logs in ``work/<name>``.
  ``data``: MaxText's data keys (``grain_args`` for grain). Returns
  (incarnations, host 0's report of the last incarnation)."""
  from snapstore.testing import launch
  out = work / name
  out.mkdir(parents=True)
  store = work / f"store-{name}"
  args = [base_yml(), *TINY, *data, f"steps={steps}", f"checkpoint_period={period}",
          f"run_name={name}", f"base_output_directory={work / 'orbax'}",
          f"jax_cache_dir={cache_dir}", f"snapshot_store_dir={store}",
          f"snapshot_interval={1 if snapshots else 0}", "snapshot_keep=2",
          "snapshot_replicas=1", *extra]
  try:
    incs = launch(MODULE, args, num_hosts=2, devices_per_host=2, store_dir=store,
                  run_id=name, kills=kills, timeout_s=timeout_s, log_dir=out,
                  env={"JAX_PLATFORMS": "cpu", "DECOUPLE_GCLOUD": "TRUE"})
  finally:
    cleanup(store)
  report = json.loads((out / f"maxtext-inc{incs[-1].number}-host0.json").read_text())
  return incs, report


def run_elastic(work: Path, name: str, *, steps: int, period: int, snapshots: bool,
                cache_dir: Path, resize: bool = False, lose: Sequence[int] = (),
                back: int | None = None, flip: Sequence[int] = (), replicas: int = 1,
                timeout_s: float = 300) -> dict[str, Any]:
  """One single-controller elastic MaxText job (``benchmarks._maxtext_elastic``:
  8 CPU devices as 2 slices) in a fresh process: pause-resume, or
  replica-resize with ``resize``. Returns host 0's report, with the worker's
  fault log under ``"worker"``; raises with the log's tail if it failed."""
  import os
  import subprocess
  import sys
  out = work / name
  args = [sys.executable, "-m", "benchmarks._maxtext_elastic", "--out", str(out),
          "--lose", *map(str, lose), "--flip", *map(str, flip),
          *(["--back", str(back)] if back is not None else []), "--",
          base_yml(), *TINY, "dataset_type=synthetic", f"steps={steps}",
          f"checkpoint_period={period}", f"run_name={name}",
          f"base_output_directory={work / 'orbax'}", f"jax_cache_dir={cache_dir}",
          f"snapshot_store_dir={work / 'store'}", f"snapshot_interval={int(snapshots)}",
          "snapshot_keep=2", f"snapshot_replicas={replicas}",
          "enable_single_controller=true", "elastic_enabled=true", "elastic_max_retries=4",
          "elastic_timeout_seconds=60", f"elastic_min_slice_count={1 if resize else -1}"]
  log = work / f"{name}.log"
  with open(log, "wb") as f:
    rc = subprocess.run(args, stdout=f, stderr=subprocess.STDOUT, timeout=timeout_s,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"),
                        cwd=Path(__file__).resolve().parent.parent).returncode
  if rc != 0:
    tail = log.read_text(errors="replace")[-4000:]
    raise RuntimeError(f"elastic MaxText job {name} exited {rc}:\n{tail}")
  report = json.loads((out / "maxtext-inc0-host0.json").read_text())
  report["worker"] = json.loads((out / "worker.json").read_text())
  return report


def _recovery(incs: list[Any], report: dict[str, Any], kill: int) -> dict[str, Any]:
  r = report["restores"][-1]
  first_new = report["times"].get(str(kill + 1))
  return {"source": r["source"], "restored_step": r["step"],
          "steps_lost": kill - r["step"],
          "restore_s": r["ended"] - r["started"],
          "kill_to_first_new_step_s": (first_new - incs[0].kill_time
                                       if first_new and incs[0].kill_time else None)}


def run(steps: int, period: int, kill: int) -> dict[str, Any]:
  from snapstore.testing import Kill
  work = ram_dir("snapstore-maxtext-")
  cache = work / "jax-cache"
  try:
    rows: dict[str, Any] = {}
    for name, snapshots in (("off", False), ("on", True)):
      _, report = run_job(work, f"{name}-steady", steps=steps, period=period,
                          snapshots=snapshots, cache_dir=cache)
      gaps = step_intervals(report)
      rows[name] = {"median_step_s": statistics.median(gaps), "mean_step_s": statistics.mean(gaps),
                    "save_metrics": report.get("save_metrics")}
    rows["on"]["overhead_median"] = rows["on"]["median_step_s"] / rows["off"]["median_step_s"] - 1
    rows["on"]["overhead_mean"] = rows["on"]["mean_step_s"] / rows["off"]["mean_step_s"] - 1
    for name, snapshots in (("off", False), ("on", True)):
      incs, report = run_job(work, f"{name}-killed", steps=steps, period=period,
                             snapshots=snapshots, cache_dir=cache,
                             kills=[Kill(host=1, step=kill, phase="step")])
      rows[name]["recovery"] = _recovery(incs, report, kill)
  finally:
    cleanup(work)
  return {"processes": 2, "devices_per_process": 2, "steps": steps,
          "checkpoint_period": period, "kill_after_step": kill,
          "snapshots_off": rows["off"], "snapshots_on": rows["on"]}


def _elastic_events(report: dict[str, Any]) -> list[dict[str, Any]]:
  return [{"kind": e["kind"], "lost_slices": e["lost_slices"],
           "active_slices": e.get("active_slices"),
           "source": e.get("restore", {}).get("source"),
           "restored_step": e.get("restore", {}).get("step"),
           "steps_lost": e.get("steps_lost"),
           "restore_s": e.get("restore", {}).get("seconds"),
           "event_to_first_new_step_s": e.get("event_to_first_new_step_s")}
          for e in report["elastic"]]


def run_elastic_bench(steps: int, period: int, lose: int, back: int) -> dict[str, Any]:
  """Single-controller elastic MaxText (8 CPU devices as 2 slices), snapstore
  against MaxText's Orbax alone, in both of MaxText's modes: a steady run of
  each (per-step overhead), pause-resume with slice 1 lost after ``lose``,
  and replica-resize with slice 1 lost after ``lose`` and back at ``back``."""
  work = ram_dir("snapstore-maxtext-elastic-")
  cache = work / "jax-cache"
  try:
    rows: dict[str, Any] = {}
    # Both systems then find the 4-device (resized) programs compiled in the
    # shared cache: neither pays a compile the other does not.
    run_elastic(work, "warm-up", steps=steps, period=period, snapshots=False,
                cache_dir=cache, resize=True, lose=[lose], back=back)
    for system, snapshots in (("maxtext_orbax", False), ("snapstore", True)):
      kw = dict(steps=steps, period=period, snapshots=snapshots, cache_dir=cache)
      steady = run_elastic(work, f"{system}-steady", **kw)
      pause = run_elastic(work, f"{system}-pause", lose=[lose], **kw)
      resize = run_elastic(work, f"{system}-resize", resize=True, lose=[lose], back=back, **kw)
      gaps = step_intervals(steady)
      rows[system] = {
          "median_step_s": statistics.median(gaps),
          "pause_resume": _elastic_events(pause),
          "replica_resize": _elastic_events(resize),
          "final_digest": {"pause_resume": pause["digests"].get(str(steps - 1)),
                           "replica_resize": resize["digests"].get(str(steps - 1))}}
    ours, alone = rows["snapstore"], rows["maxtext_orbax"]
    ours["overhead_median"] = ours["median_step_s"] / alone["median_step_s"] - 1
    # What MaxText alone pays per step for snapstore's rewind of 0: Orbax every step.
    every = run_elastic(work, "maxtext_orbax-every-step", steps=steps, period=1,
                        snapshots=False, cache_dir=cache)
    alone["every_step_median_step_s"] = statistics.median(step_intervals(every))
    alone["every_step_overhead_median"] = (alone["every_step_median_step_s"]
                                           / alone["median_step_s"] - 1)
    for mode in ("pause_resume", "replica_resize"):
      ours[f"{mode}_steps_lost_total"] = sum(e["steps_lost"] or 0 for e in ours[mode])
      alone[f"{mode}_steps_lost_total"] = sum(e["steps_lost"] or 0 for e in alone[mode])
  finally:
    cleanup(work)
  return {"devices": 8, "slices": 2, "steps": steps, "checkpoint_period": period,
          "lose_after_step": lose, "back_at_step": back, **rows}


def main(argv: Sequence[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog="benchmarks.maxtext", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--steps", type=int, default=None, help="default 40 (--elastic: 24)")
  p.add_argument("--checkpoint-period", type=int, default=None, help="default 10 (--elastic: 8)")
  p.add_argument("--kill", type=int, default=None,
                 help="SIGKILL host 1 (--elastic: lose slice 1) after this step; "
                      "default 28 (--elastic: 11)")
  p.add_argument("--out", default=None,
                 help="default bench-results/maxtext.json (maxtext-elastic.json)")
  p.add_argument("--elastic", action="store_true",
                 help="single-controller elastic MaxText (Pathways, simulated on 8 CPU "
                      "devices as 2 slices): snapstore vs MaxText's Orbax alone, both modes")
  p.add_argument("--back", type=int, default=17,
                 help="--elastic: slice 1 returns at this step (replica-resize)")
  args = p.parse_args(argv)
  defaults = (24, 8, 11) if args.elastic else (40, 10, 28)
  args.steps, args.checkpoint_period, args.kill = (
      d if v is None else v
      for v, d in zip((args.steps, args.checkpoint_period, args.kill), defaults, strict=True))
  if args.elastic:
    if not (0 < args.kill < args.back < args.steps - 1):
      p.error("--elastic needs 0 < --kill < --back < --steps - 1")
    emit("maxtext-elastic", run_elastic_bench(args.steps, args.checkpoint_period, args.kill,
                                              args.back),
         args.out or "bench-results/maxtext-elastic.json")
    return 0
  if args.kill % args.checkpoint_period == 0 or not 0 < args.kill < args.steps - 1:
    p.error("--kill must be inside the run and off the checkpoint period")
  emit("maxtext", run(args.steps, args.checkpoint_period, args.kill),
       args.out or "bench-results/maxtext.json")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
