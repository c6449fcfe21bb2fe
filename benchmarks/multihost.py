"""Multi-host snapshots: per-step overhead with replicas=1, restore from RAM
against the Orbax tier (local dir and GCS emulator), replica bytes per step.

``python -m benchmarks.multihost --mb 256``: 4 local host processes
(``snapstore launch``, ``jax.distributed`` on CPU with gloo, 2 devices each,
2 failure domains of 2 hosts); the state is ``--mb`` MB in total, float32
leaves sharded over all 8 devices; a step touches every byte and is padded
to ``--step-s`` with a sleep (the accelerator computing while the host's
cores are free: what the snapshot's copy overlaps in real training). In the same
processes, blocks of steps without and with snapshots alternate (best of
``--rounds``); then the same step is restored from the RAM snapshots and from
Orbax on a local dir and on the GCS emulator (median of ``--repeats``).
All four processes share this machine's cores, so the absolute step times
are inflated; the ratios are the result.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from pathlib import Path

from benchmarks._common import cleanup, emit, ram_dir


def run(mb: int, steps: int, rounds: int, repeats: int, replicas: int,
        step_s: float) -> dict:
  from snapstore.demo.gcs_emulator import GcsEmulator  # noqa: PLC0415
  from snapstore.launch import launch  # noqa: PLC0415
  work = ram_dir("snapstore-mh-bench-")
  root = str(Path(__file__).resolve().parents[1])
  try:
    with GcsEmulator(bucket="bench") as gcs:
      env = dict(gcs.env(), PYTHONPATH=os.pathsep.join(
          [root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
      out = work / "result.json"
      launch("benchmarks._mh_worker",
             ["--mb", str(mb), "--steps", str(steps), "--rounds", str(rounds),
              "--repeats", str(repeats), "--out", str(out), "--store", str(work / "store"),
              "--local", str(work / "orbax"), "--gcs", gcs.url("mh"),
              "--replicas", str(replicas), "--step-s", str(step_s)],
             num_hosts=4, devices_per_host=2, store_dir=work / "store", run_id="mh",
             max_incarnations=1, timeout_s=1200, log_dir=work, env=env)
      return json.loads(out.read_text())
  except RuntimeError as e:
    logs = "".join(p.read_text()[-2000:] for p in sorted(work.glob("inc0-host*.log")))
    raise RuntimeError(f"{e}\n{logs}") from e
  finally:
    cleanup(work)


def main(argv: Sequence[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog="benchmarks.multihost", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--mb", type=int, default=256)
  p.add_argument("--steps", type=int, default=10)
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--repeats", type=int, default=2)
  p.add_argument("--replicas", type=int, default=1)
  p.add_argument("--step-s", type=float, default=0.5,
                 help="step time: the state update, padded with a sleep that stands "
                      "for accelerator compute (host cores free); 0: the bare update")
  p.add_argument("--out", default="bench-results/multihost.json")
  args = p.parse_args(argv)
  result = run(args.mb, args.steps, args.rounds, args.repeats, args.replicas, args.step_s)
  emit("multihost", dict(result, step_s=args.step_s), args.out)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
