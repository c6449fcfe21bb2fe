"""Per-step time with snapshots at interval 1, 2, 5, 10 against no snapshots.

``python -m benchmarks.overhead --mb 256``: one process, 8 CPU devices, a
state of ``--mb`` MB and a step whose compute takes ``--step-factor`` times
one snapshot's copy time (a tanh-matmul chain that touches every leaf and
donates the state). Each interval's loop runs interleaved with a loop
without snapshots, several rounds, and the best round of each is compared:
``ratio`` = step time with snapshots / step time without, same process.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

from benchmarks._common import (
  calibrated_step,
  cleanup,
  emit,
  make_state,
  ram_dir,
  setup_cpu_devices,
)


def run(mb: int, intervals: Sequence[int], steps: int, rounds: int,
        step_factor: float) -> dict:
  import jax

  import snapstore
  state, sharding = make_state(mb << 20)
  nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
  store = ram_dir("snapstore-overhead-")
  try:
    opts = snapstore.SnapshotOptions(store=snapstore.HostFiles(dir=store), keep=1)
    with snapstore.SnapshotManager(opts) as mgr:
      mgr.save(0, state, force=True)  # allocates and touches the slots
      mgr.wait_until_finished()
      t = time.perf_counter()
      mgr.save(1, state, force=True)  # a warm save: what each step pays
      mgr.wait_until_finished()
      copy_s = time.perf_counter() - t
      fn, x, iters = calibrated_step(state, sharding, copy_s * step_factor)
      step = 10

      def loop(interval: int | None) -> float:
        nonlocal state, step
        t = time.perf_counter()
        for _ in range(steps):
          step += 1
          state, _ = fn(state, x, iters)
          if interval is not None and step % interval == 0:
            mgr.save(step, state, force=True)
        jax.block_until_ready(state)
        mgr.wait_until_finished()
        return (time.perf_counter() - t) / steps

      loop(1)
      best: dict[str, float] = {}
      for _ in range(rounds):  # interleaved, so all share the machine's noise
        for key, interval in [("none", None)] + [(str(i), i) for i in intervals]:
          best[key] = min(best.get(key, float("inf")), loop(interval))
  finally:
    cleanup(store)
  return {
      "state_mb": nbytes / 2**20, "snapshot_copy_s": copy_s, "step_s_none": best["none"],
      "intervals": [{"interval": i, "step_s": best[str(i)],
                     "ratio": best[str(i)] / best["none"],
                     "overhead": best[str(i)] / best["none"] - 1.0} for i in intervals],
  }


def main(argv: Sequence[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog="benchmarks.overhead", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--mb", type=int, default=256)
  p.add_argument("--intervals", type=int, nargs="+", default=[1, 2, 5, 10])
  p.add_argument("--steps", type=int, default=10)
  p.add_argument("--rounds", type=int, default=2)
  p.add_argument("--step-factor", type=float, default=10.0,
                 help="step compute time as a multiple of one snapshot's copy time")
  p.add_argument("--out", default="bench-results/overhead.json")
  args = p.parse_args(argv)
  setup_cpu_devices(8)
  emit("overhead", run(args.mb, args.intervals, args.steps, args.rounds, args.step_factor),
       args.out)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
