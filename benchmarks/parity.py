"""Parity vs replica snapshots on a 4-host job: RAM per host, bytes moved per
snapshot, per-step overhead, restore of a lost host, side by side.

``python -m benchmarks.parity --mb 256``: 4 local host processes
(``snapstore launch``, ``jax.distributed`` on CPU with gloo, 2 devices each),
each its own failure domain; the state is ``--mb`` MB of float32 leaves
sharded over all 8 devices (no data-parallel twin: every byte needs
redundancy). In the same processes, blocks of steps without snapshots, with
``replicas=1`` and with ``redundancy="parity"`` (k = 3) alternate (best of
``--rounds``). RAM is measured from the stores (slot files); then host 1's
store is wiped and every host restores the newest step: replicas, or a
parity rebuild (median of ``--repeats``), checked bitwise. All four
processes share this machine's cores: the ratios are the result. Also
prints ``snapstore capacity`` for a TPU v5p-sized job (175B params, 14 bytes a
param, 1,024 hosts).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from benchmarks._common import emit, job_args, run_workers


def run(mb: int, steps: int, rounds: int, repeats: int, k: int, step_s: float) -> dict:
  return run_workers(
      "benchmarks._parity_worker",
      lambda work: ["--mb", str(mb), "--steps", str(steps), "--rounds", str(rounds),
                    "--repeats", str(repeats), "--parity-k", str(k), "--step-s", str(step_s)],
      prefix="snapstore-parity-bench-", run_id="parity")


def v5p_capacity() -> dict:
  from snapstore.capacity import from_size
  state = int(175e9 * 14)
  return {"params": 175e9, "bytes_per_param": 14, "hosts": 1024, "keep": 2,
          "ram_bytes_per_host": 448 * 10**9,
          "options": [p.as_dict() for p in from_size(state, hosts=1024, keep=2)]}


def main(argv: Sequence[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog="benchmarks.parity", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  job_args(p, steps=6, rounds=2, repeats=2)
  p.add_argument("--parity-k", type=int, default=3)
  p.add_argument("--out", default="bench-results/parity.json")
  args = p.parse_args(argv)
  result = run(args.mb, args.steps, args.rounds, args.repeats, args.parity_k, args.step_s)
  emit("parity", dict(result, v5p_capacity=v5p_capacity()), args.out)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
