"""Capture and restore throughput of the host store against memcpy, same run.

``python -m benchmarks.capture --mb 256 512``: for each state size, on 8 CPU
devices (a 2x4 mesh, float32 leaves of ~16 MB sharded over all devices):

* ``memcpy_gbps``: single-thread ``np.copyto`` of the state's bytes into a
  touched, reused buffer, timed right before each timed save and restore
  (this machine's bandwidth drifts by a third within a minute: a baseline
  taken once, before everything, made the ratios drift as much);
* ``save_gbps``: bytes / (time from ``save`` to the snapshot committed), and
  ``save_return_s``: how long ``save`` itself blocked;
* ``restore_gbps``: bytes / ``restore`` time (checksums verified, arrays
  placed on their devices; the median of ``--repeats``), and
  ``restore_first_s``: the first restore in the process (its memory fresh:
  what a recovery pays);
* ``save_vs_memcpy`` / ``restore_vs_memcpy``: the median memcpy time of the
  samples taken beside the saves (restores) over their median time;
* per-step overhead of ``save`` at interval 1 against the same loop without
  snapshots, with a step that takes ~10x the copy (a matmul chain);
* ``gc_full_collections`` / ``gc_full_seconds``: Python's full garbage
  collections during ``gc_saves`` saves in a row (the first ``--repeats`` of
  them are the timed saves); ``gc_restore_full_collections``: those during
  the timed restores;
* ``floor``: the least a store written in Python pays per piece here,
  unchecked (``_common.piecewise_floor``: a view and a copy a piece; a copy
  a piece and JAX's batched put a leaf), and ``over_floor``, save complete
  and restore over it;
* ``checked_floor``: one checked copy of every shard and nothing else
  (``_common.checked_copy_seconds``: snapstore's fused copy and crc32c into
  touched, reused memory, on one thread or two, whichever is faster), and
  ``vs_memcpy``, the memcpy samples taken beside it over it: what any store
  that checks every byte can reach here, the bound of ``save_vs_memcpy``
  and ``restore_vs_memcpy``;
* ``many_leaves``: the same, with the same bytes split over
  ``--many-leaves`` leaves (default 500), and its times over the few-leaves
  case's (per-leaf Python cost shows there), the floor's too;
* ``jax_floor``: JAX's own per-shard cost alone (``_common.jax_floor``: a
  numpy view of every shard, the hold a save needs; every leaf placed from
  filled host buffers, what a restore ends in), and in ``vs_few_leaves`` the
  ``jax_bound_*`` ratios: the few-leaves time plus the many leaves' extra
  JAX cost, over the few-leaves time, the least any store that holds and
  places each shard could show.

Ratios to memcpy are the headline: they are measured side by side.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

from benchmarks._common import (
  FullCollections,
  Memcpy,
  calibrated_step,
  checked_floor,
  cleanup,
  emit,
  jax_floor,
  make_state,
  piecewise_floor,
  ram_dir,
  setup_cpu_devices,
  upper_median,
)


def one_size(mb: int, repeats: int, step_factor: float, leaves: int | None = None,
             gc_saves: int = 20) -> dict:
  import jax

  import snapstore
  state, sharding = make_state(mb << 20, leaves)
  nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
  memcpy = Memcpy(nbytes)
  store = ram_dir("snapstore-bench-")
  try:
    opts = snapstore.SnapshotOptions(store=snapstore.HostFiles(dir=store), keep=1)
    with snapstore.SnapshotManager(opts) as mgr:
      for warm in (0, 1):  # allocates and touches both slots (keep=1 writes two in turn)
        mgr.save(warm, state)
        mgr.wait_until_finished()
      returns, totals = [], []
      with FullCollections() as gcs:
        gc_saves = max(gc_saves, repeats)
        for i in range(1, gc_saves + 1):
          if i <= repeats:
            memcpy.sample()
          t = time.perf_counter()
          mgr.save(1 + i, state)
          if i <= repeats:
            returns.append(time.perf_counter() - t)
          mgr.wait_until_finished()
          if i <= repeats:
            totals.append(time.perf_counter() - t)
      abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                             sharding=x.sharding), state)
      t = time.perf_counter()  # the first in this process: what a recovery pays
      jax.block_until_ready(mgr.restore(abstract).state)
      restore_first_s = time.perf_counter() - t
      save_memcpy_s = memcpy.median_since(0)
      restores = []
      with FullCollections() as restore_gcs:
        for _ in range(repeats):
          memcpy.sample()
          t = time.perf_counter()
          jax.block_until_ready(mgr.restore(abstract).state)
          restores.append(time.perf_counter() - t)
      restore_s = upper_median(restores)
      restore_memcpy_s = memcpy.median_since(repeats)

      save_s = upper_median(totals)
      floor = piecewise_floor(state, repeats)
      jax_cost = jax_floor(state, repeats)
      checked = checked_floor(state, repeats, memcpy)
      fn, x, iters = calibrated_step(state, sharding, save_s * step_factor)
      state, _ = fn(state, x, iters)

      next_step = [1000]  # steps only grow within a lineage (StepOrderError)

      def loop(snap: bool, steps: int = repeats * 2) -> float:
        nonlocal state
        t = time.perf_counter()
        for _ in range(steps):
          state, _ = fn(state, x, iters)
          if snap:
            mgr.save(next_step[0], state)
            next_step[0] += 1
        jax.block_until_ready(state)
        mgr.wait_until_finished()
        return (time.perf_counter() - t) / steps
      loop(True, 2)
      plain, snap = [], []
      for _ in range(3):  # interleave to share the machine's noise
        plain.append(loop(False))
        snap.append(loop(True))
      step_plain, step_snap = min(plain), min(snap)
  finally:
    cleanup(store)
  return {
      "state_mb": nbytes / 2**20, "leaves": len(state),
      "memcpy_gbps": nbytes / memcpy.median_since(0) / 1e9,
      "save_gbps": nbytes / save_s / 1e9, "save_vs_memcpy": save_memcpy_s / save_s,
      "save_return_s": upper_median(returns), "save_complete_s": save_s,
      "restore_gbps": nbytes / restore_s / 1e9, "restore_vs_memcpy": restore_memcpy_s / restore_s,
      "restore_s": restore_s, "restore_first_s": restore_first_s,
      "step_s_plain": step_plain, "step_s_snapshot": step_snap,
      "copy_fraction_of_step": save_s / step_plain,
      "step_overhead": step_snap / step_plain - 1.0,
      "floor": floor,
      "over_floor": {"save_complete_s": save_s / floor["save_s"],
                     "restore_s": restore_s / floor["restore_s"]},
      "checked_floor": checked,
      "jax_floor": jax_cost,
      "gc_saves": gc_saves, "gc_full_collections": gcs.count, "gc_full_seconds": gcs.seconds,
      "gc_restore_full_collections": restore_gcs.count,
  }


def jax_bound(few: dict, many: dict) -> dict[str, float]:
  """The least ``vs_few_leaves`` any checked store could show here: the
  few-leaves time plus what JAX alone adds for the many leaves' shards
  (``jax_floor``: a hold a shard at save, a placed shard at restore), over
  the few-leaves time."""
  def bound(key: str, floor: str) -> float:
    extra = max(0.0, many["jax_floor"][floor] - few["jax_floor"][floor])
    return (few[key] + extra) / few[key]
  return {"jax_bound_save_complete_s": bound("save_complete_s", "hold_s"),
          "jax_bound_save_return_s": bound("save_return_s", "hold_s"),
          "jax_bound_restore_s": bound("restore_s", "place_s")}


def main(argv: Sequence[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog="benchmarks.capture", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--mb", type=int, nargs="+", default=[64, 256, 1024, 2048])
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--step-factor", type=float, default=10.0,
                 help="step compute time as a multiple of the measured copy time")
  p.add_argument("--many-leaves", type=int, default=500,
                 help="also run each size split over this many leaves (0: skip)")
  p.add_argument("--out", default="bench-results/capture.json")
  args = p.parse_args(argv)
  setup_cpu_devices(8)
  rows, many = [], []
  for mb in args.mb:
    rows.append(one_size(mb, args.repeats, args.step_factor))
    if args.many_leaves:
      row = one_size(mb, args.repeats, args.step_factor, args.many_leaves)
      row["vs_few_leaves"] = {k: row[k] / rows[-1][k] for k in
                              ("save_complete_s", "save_return_s", "restore_s",
                               "restore_first_s")}
      row["vs_few_leaves"].update({f"floor_{k}": row["floor"][k] / rows[-1]["floor"][k]
                                   for k in row["floor"]})
      row["vs_few_leaves"].update(jax_bound(rows[-1], row))
      many.append(row)
  emit("capture", {"sizes": rows, "many_leaves": many}, args.out)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
