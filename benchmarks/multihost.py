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
Orbax on a local dir and on the GCS emulator, ``--repeats`` times each, in
turn: ``restore_*_first_s``, the first (what a recovery pays: compiling, the
first collectives, fresh memory), and ``restore_*_s``, the median of the
rest; ratios to RAM of both.
All four processes share this machine's cores, so the absolute step times
are inflated; the ratios are the result.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from benchmarks._common import emit, job_args, run_workers


def run(mb: int, steps: int, rounds: int, repeats: int, replicas: int,
        step_s: float) -> dict:
  from snapstore.demo.gcs_emulator import GcsEmulator
  with GcsEmulator(bucket="bench") as gcs:
    return run_workers(
        "benchmarks._mh_worker",
        lambda work: ["--mb", str(mb), "--steps", str(steps), "--rounds", str(rounds),
                      "--repeats", str(repeats), "--local", str(work / "orbax"),
                      "--gcs", gcs.url("mh"), "--replicas", str(replicas),
                      "--step-s", str(step_s)],
        prefix="snapstore-mh-bench-", run_id="mh", env=gcs.env())


def main(argv: Sequence[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog="benchmarks.multihost", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  job_args(p, steps=10, rounds=3, repeats=4)
  p.add_argument("--replicas", type=int, default=1)
  p.add_argument("--out", default="bench-results/multihost.json")
  args = p.parse_args(argv)
  result = run(args.mb, args.steps, args.rounds, args.repeats, args.replicas, args.step_s)
  emit("multihost", dict(result, step_s=args.step_s), args.out)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
