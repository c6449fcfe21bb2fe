"""Goodput of a long training run at scale: GCS-only, Orbax-emergency-style
local checkpoints, and snapstore per-step snapshots.

``python -m benchmarks.goodput --preset v5p-4096`` prints, per strategy:
goodput (useful step time / wall time), expected rewind (steps recomputed per
failure), expected recovery seconds per failure, and per-step save overhead.
``--curves DIR`` also draws goodput against MTBF and against the checkpoint
interval. ``--check RESULTS.json`` compares the model's mean rewind with the
``rewind`` benchmark's real runs (same parameters).

The model (documented, deliberately simple):

* failures: a job of ``hosts`` hosts fails at rate ``hosts / mtbf_host_s``;
  a failure lands at a uniformly random time;
* a save every ``n`` steps becomes usable ``commit_s`` after its step ends
  (the copy off the device, then the write); the rewind is the number of steps
  completed since the newest usable save — averaged exactly over the failure
  time within a period;
* recovery = detection + restart + restore (state bytes per host over the
  tier's read bandwidth; for snapstore, plus its restore decision's CPU
  seconds at the preset's host count, one host lost, measured in the same
  run by ``benchmarks.scale``) + rewind x step time;
* overhead: the time each blocking save stops the step (device -> host copy
  of the host's state over PCIe), spread over its interval; snapstore's copy
  overlaps the step and costs ``snapshot_interference`` x its copy time;
* goodput = (1 - failure rate x recovery per failure) / (1 + overhead).

Sources of the presets' figures (public; the per-host MTBF is derived from
Meta's Llama 3 report: 419 unexpected interruptions in 54 days on 16,384
GPUs, i.e. about 2,048 hosts -> one host failure per ~264 days; GCS
per-host throughput and PCIe figures are conservative round numbers, stated
as assumptions in each preset's ``notes``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

GB = 1e9
DAY = 86400.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class Scenario:
  hosts: int
  chips_per_host: int
  state_bytes_per_host: float
  step_s: float
  mtbf_host_s: float
  detect_s: float = 60.0
  restart_s: float = 120.0
  gcs_read_bps: float = 1.0 * GB      # per host
  gcs_write_bps: float = 0.5 * GB     # per host
  host_net_bps: float = 12.5 * GB     # per host (DCN / NIC)
  host_device_bps: float = 20.0 * GB  # per host, device <-> pinned host
  ckpt_interval: int = 100            # steps between GCS checkpoints
  local_interval: int = 10            # steps between emergency local checkpoints
  snapshot_interval: int = 1          # steps between snapstore snapshots
  # Step slowdown per second of snapshot copy overlapping it (DMA contending
  # for memory bandwidth). Assumed 0.25 on accelerators; on this CPU-only
  # machine, where the copy competes with XLA for the same cores,
  # benchmarks.capture measures ~1.75.
  snapshot_interference: float = 0.25
  # snapstore's restore decision and plan, seconds a host; None: measured
  # at ``hosts`` by benchmarks.scale (one host lost, replicas=1, 500 leaves)
  restore_metadata_s: float | None = None
  notes: str = ""


# Published setups. State = params + Adam moments in fp32 (12 bytes/param)
# plus bf16 params (2 bytes/param): 14 bytes/param, spread over the hosts.
PRESETS: dict[str, Scenario] = {
    "v5e-256": Scenario(
        hosts=64, chips_per_host=4, state_bytes_per_host=14 * 16e9 / 64, step_s=3.0,
        mtbf_host_s=264 * DAY, ckpt_interval=100, host_net_bps=12.5 * GB,
        host_device_bps=4 * 8 * GB,
        notes="16B-param dense model on v5e-256 (4 chips/host, PCIe ~8 GB/s/chip, "
              "100 Gb/s host network); GCS 1 GB/s read, 0.5 GB/s write per host (assumed)"),
    "v5p-4096": Scenario(
        hosts=1024, chips_per_host=4, state_bytes_per_host=14 * 175e9 / 1024, step_s=10.0,
        mtbf_host_s=264 * DAY, ckpt_interval=100, host_net_bps=25 * GB,
        host_device_bps=4 * 16 * GB,
        notes="175B-param model on v5p-4096 (1,024 hosts x 4 chips, PCIe Gen4 "
              "~16 GB/s/chip, 200 Gb/s host network); GCS as above (assumed)"),
    "qwen3-4b-135GiB": Scenario(
        hosts=16, chips_per_host=4, state_bytes_per_host=135 * 2**30 / 16, step_s=2.0,
        mtbf_host_s=264 * DAY / 64, ckpt_interval=100, detect_s=60.0, restart_s=180.0,
        notes="MaxText elastic demo: Qwen3-4B, 135 GiB restored through GCS, checkpoint "
              "every 100 steps, 88 steps lost; 16 hosts; failure rate raised 64x to the "
              "'a host every few hours' regime of large pools (assumed)"),
}


def mean_rewind(interval: int, commit_s: float, step_s: float, *,
                delay: tuple[float, float] | None = None, grid: int = 4000) -> float:
  """Expected steps completed since the newest usable save.

  The failure lands at a uniformly random time, or, with ``delay=(lo, hi)``,
  ``lo..hi`` seconds (uniform) after a uniformly random step ends — how
  ``snapstore launch`` kills: when a step's save begins, after a polling
  delay. Exact average over one period, on a fine grid.
  """
  lag = commit_s / step_s  # in steps
  total = 0.0
  for i in range(grid):
    if delay is None:
      u = lag + interval * (10 + i / grid)  # failure time, in steps
    else:
      k = interval * 10 + int(lag) + (i % interval)
      u = k + (delay[0] + (delay[1] - delay[0]) * ((i // interval) * interval / grid)) / step_s
    done = math.floor(u)
    usable = interval * math.floor((u - lag) / interval)  # newest save usable by then
    total += done - usable
  return total / grid


def rewind_at(step: int, interval: int, commit_s: float, step_s: float,
              delay: tuple[float, float], grid: int = 200) -> float:
  """Expected rewind of a failure ``delay`` seconds (uniform in the window)
  after ``step`` ends: the same model, conditioned on the failure's step."""
  lag = commit_s / step_s
  total = 0.0
  for i in range(grid):
    u = step + (delay[0] + (delay[1] - delay[0]) * (i + 0.5) / grid) / step_s
    total += math.floor(u) - interval * math.floor((u - lag) / interval)
  return total / grid


@dataclasses.dataclass(frozen=True)
class Outcome:
  strategy: str
  goodput: float
  rewind_steps: float
  recovery_s: float
  overhead: float
  failures_per_day: float


def evaluate(sc: Scenario) -> list[Outcome]:
  rate = sc.hosts / sc.mtbf_host_s
  d2h = sc.state_bytes_per_host / sc.host_device_bps  # blocking copy off the device
  gcs_commit = d2h + sc.state_bytes_per_host / sc.gcs_write_bps
  out = []

  def outcome(name: str, rewind: float, restore_s: float, overhead: float) -> Outcome:
    step = sc.step_s * (1 + overhead)
    recovery = sc.detect_s + sc.restart_s + restore_s + rewind * step
    goodput = max(0.0, 1 - rate * recovery) / (1 + overhead)
    return Outcome(name, goodput, rewind, recovery, overhead, rate * DAY)

  gcs_restore = sc.state_bytes_per_host / sc.gcs_read_bps
  gcs_ovh = d2h / (sc.ckpt_interval * sc.step_s)
  out.append(outcome("gcs-only", mean_rewind(sc.ckpt_interval, gcs_commit, sc.step_s),
                     gcs_restore, gcs_ovh))
  # Emergency local checkpoints: the lost host's copy comes from a peer over
  # the host network; the save blocks for the device -> host copy.
  local_commit = d2h + sc.state_bytes_per_host / sc.host_net_bps
  local_rewind = min(mean_rewind(sc.local_interval, local_commit, sc.step_s),
                     mean_rewind(sc.ckpt_interval, gcs_commit, sc.step_s))
  out.append(outcome("emergency-local", local_rewind,
                     sc.state_bytes_per_host / sc.host_net_bps,
                     gcs_ovh + d2h / (sc.local_interval * sc.step_s)))
  # snapstore: the copy runs beside the step (async device -> pinned host and
  # the replica transfer); usable once both are done.
  snap_commit = d2h + sc.state_bytes_per_host / sc.host_net_bps
  snap_rewind = min(mean_rewind(sc.snapshot_interval, snap_commit, sc.step_s),
                    mean_rewind(sc.ckpt_interval, gcs_commit, sc.step_s))
  snap_ovh = sc.snapshot_interference * d2h / (sc.snapshot_interval * sc.step_s)
  out.append(outcome("snapstore", snap_rewind,
                     sc.state_bytes_per_host / min(sc.host_net_bps, sc.host_device_bps)
                     + metadata_s(sc), gcs_ovh + snap_ovh))
  return out


def metadata_s(sc: Scenario) -> float:
  """snapstore's restore metadata seconds a host in ``sc``."""
  if sc.restore_metadata_s is not None:
    return sc.restore_metadata_s
  return _measured_metadata_s(sc.hosts)


@functools.lru_cache(maxsize=16)
def _measured_metadata_s(hosts: int) -> float:
  from benchmarks.scale import run_case
  return float(run_case(max(hosts, 4), "one", "replicas")["cpu_s_max"])


def best_snapshot_interval(sc: Scenario, candidates: Sequence[int] = (1, 2, 5, 10, 20)
                           ) -> tuple[int, Outcome]:
  """The snapshot interval with the highest snapstore goodput."""
  scored = [(k, evaluate(dataclasses.replace(sc, snapshot_interval=k))[-1])
            for k in candidates]
  return max(scored, key=lambda ko: ko[1].goodput)


def young_daly_interval(sc: Scenario) -> int:
  """The interval ``SnapshotOptions(interval=AutoInterval(...))`` would choose here: the
  same rule (``snapstore._interval.young_daly_steps``) on this model's cost
  of one snapshot and the job's MTBF."""
  from snapstore._interval import young_daly_steps
  cost = sc.snapshot_interference * sc.state_bytes_per_host / sc.host_device_bps
  return young_daly_steps(cost, sc.mtbf_host_s / sc.hosts, sc.step_s)


def _table(sc_name: str, sc: Scenario) -> dict[str, Any]:
  k, best = best_snapshot_interval(sc)
  yd = young_daly_interval(sc)
  at_yd = evaluate(dataclasses.replace(sc, snapshot_interval=yd))[-1]
  return {"preset": sc_name, "scenario": dataclasses.asdict(sc),
          "strategies": [dataclasses.asdict(o) for o in evaluate(sc)],
          "snapstore_restore_metadata_s": metadata_s(sc),
          "best_snapshot_interval": {"interval": k, **dataclasses.asdict(best)},
          "auto_interval": {"interval": yd, **dataclasses.asdict(at_yd)}}


def curves(sc: Scenario, name: str, out_dir: Path) -> list[str]:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  out_dir.mkdir(parents=True, exist_ok=True)
  paths = []
  for key, xs, label, log in (
      ("mtbf_host_s", [sc.mtbf_host_s * f for f in (1 / 64, 1 / 32, 1 / 16, 1 / 8, 1 / 4,
                                                    1 / 2, 1, 2, 4)],
       "MTBF per host (days)", True),
      ("ckpt_interval", [10, 20, 50, 100, 200, 500, 1000], "GCS checkpoint interval (steps)",
       True)):
    fig, ax = plt.subplots(figsize=(6, 3.5))
    series: dict[str, list[float]] = {}
    for x in xs:
      for o in evaluate(dataclasses.replace(sc, **{key: x})):
        series.setdefault(o.strategy, []).append(o.goodput)
    shown = [x / DAY for x in xs] if key == "mtbf_host_s" else xs
    for strategy, ys in series.items():
      ax.plot(shown, ys, "o-", ms=3, label=strategy)
    if log:
      ax.set_xscale("log")
    ax.set_xlabel(label)
    ax.set_ylabel("goodput")
    ax.set_title(f"{name}: {sc.hosts} hosts, {sc.state_bytes_per_host / GB:.1f} GB/host")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = out_dir / f"goodput-{name}-vs-{key.split('_')[0]}.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    paths.append(str(path))
  return paths


def check(rewind_results: dict[str, Any], delay: tuple[float, float] = (0.0, 0.02)
          ) -> dict[str, Any]:
  """Predicted vs measured mean rewind for each case of a ``rewind`` run:
  same kill steps, step time, commit times and failure timing (``launch``
  kills within one poll, 20 ms, of a step's save). ``predicted_mean`` is
  conditioned on the run's kill steps; ``expected_mean`` averages over a
  uniformly random kill step (what a long run converges to)."""
  rows = []
  for case in rewind_results["cases"]:
    c = case["checkpoint_interval"]
    for mode in ("without", "with"):
      m = case[mode]
      kills = m.get("kill_steps", case["kill_steps"])
      # The commit lag varies from checkpoint to checkpoint: average the model
      # over the lags the run observed.
      lags = [lag * m["step_s"] for lag in m["ckpt_commit_steps_each"].values()]
      per_kill = [sum(rewind_at(k, c, lag, m["step_s"], delay) for lag in lags) / len(lags)
                  for k in kills]
      ckpt_s = m["ckpt_commit_steps"] * m["step_s"]
      expected = mean_rewind(c, ckpt_s, m["step_s"], delay=delay)
      if mode == "with":  # a snapshot every step, the checkpoint as fallback
        per_kill = [min(p, rewind_at(k, 1, m["snapshot_commit_s"], m["step_s"], delay))
                    for p, k in zip(per_kill, kills, strict=True)]
        expected = min(expected, mean_rewind(1, m["snapshot_commit_s"], m["step_s"],
                                             delay=delay))
      pred = sum(per_kill) / len(per_kill)
      rows.append({"checkpoint_interval": c, "snapshots": mode == "with",
                   "kills": len(kills), "measured_mean": m["mean"],
                   "predicted_mean": pred, "expected_mean": expected,
                   "measured": m["rewinds"], "predicted": per_kill,
                   "relative_error": abs(pred - m["mean"]) / max(m["mean"], 1e-9)})
  return {"rows": rows}


def main(argv: Sequence[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog="benchmarks.goodput", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--preset", choices=sorted(PRESETS), nargs="*", default=sorted(PRESETS))
  p.add_argument("--curves", default=None, help="write goodput curves (PNG) to this folder")
  p.add_argument("--check", default=None, help="a benchmarks.rewind JSON to compare with")
  p.add_argument("--out", default="bench-results/goodput.json")
  args = p.parse_args(argv)
  result: dict[str, Any] = {"presets": [_table(n, PRESETS[n]) for n in args.preset]}
  if args.curves:
    result["curves"] = [path for n in args.preset
                        for path in curves(PRESETS[n], n, Path(args.curves))]
  if args.check:
    result["check"] = check(json.loads(Path(args.check).read_text()))
  from benchmarks._common import emit
  emit("goodput", result, args.out)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
