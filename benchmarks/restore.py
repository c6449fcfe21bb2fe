"""Restore seconds of the same step from RAM, from Orbax on a local dir, and
from Orbax on the GCS emulator.

``python -m benchmarks.restore --mb 256``: one process, 8 CPU devices. The
state is saved once as a snapshot and once by Orbax to each persistent
location (same step); each restore runs ``--repeats`` times, interleaved, into
the same abstract state (shardings included) and the median is kept.
Ratios: ``orbax_local_vs_ram`` and ``orbax_gcs_vs_ram`` (how many times slower
than the RAM snapshot).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks._common import cleanup, make_state, ram_dir, sized_main


def run(mb: int, repeats: int) -> dict:
  import jax

  import snapstore
  from snapstore.demo.gcs_emulator import GcsEmulator
  state, _ = make_state(mb << 20)
  nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                         sharding=x.sharding), state)
  work = ram_dir("snapstore-restore-")
  step = 7
  try:
    with GcsEmulator(bucket="bench") as gcs:
      local = Path(work, "orbax")  # /dev/shm: the local tier's best case
      tiers = {"orbax_local": str(local), "orbax_gcs": gcs.url("restore")}
      opts = snapstore.SnapshotOptions(store=snapstore.HostFiles(dir=work / "store"),
                                       run_id="bench", persistent_interval=step)
      managers = {"ram": snapstore.SnapshotManager(opts, persistent=tiers["orbax_local"])}
      for name, where in tiers.items():
        empty = snapstore.SnapshotOptions(store=snapstore.HostFiles(dir=work / "store"),
                                           run_id=f"empty-{name}")
        managers[name] = snapstore.SnapshotManager(empty, persistent=where)
      managers["ram"].save(step, state)
      managers["orbax_gcs"].persistent.save(step, *_flat(state), None)
      for m in managers.values():
        m.wait_until_finished()
      times: dict[str, list[float]] = {k: [] for k in managers}
      sources = {}
      for _ in range(repeats):
        for name, m in managers.items():
          t = time.perf_counter()
          r = m.restore(abstract)
          jax.block_until_ready(r.state)
          times[name].append(time.perf_counter() - t)
          assert r.step == step, (name, r.step)
          sources[name] = r.source.value
      for m in managers.values():
        m.close()
  finally:
    cleanup(work)
  med = {k: statistics.median(v) for k, v in times.items()}
  return {
      "state_mb": nbytes / 2**20, "step": step, "sources": sources,
      **{f"{k}_s": v for k, v in med.items()},
      **{f"{k}_gbps": nbytes / v / 1e9 for k, v in med.items()},
      "orbax_local_vs_ram": med["orbax_local"] / med["ram"],
      "orbax_gcs_vs_ram": med["orbax_gcs"] / med["ram"],
  }


def _flat(state):
  from snapstore._tree import flatten
  specs, leaves, _ = flatten(state)
  return specs, leaves


def main(argv: Sequence[str] | None = None) -> int:
  return sized_main("restore", __doc__, run, argv)


if __name__ == "__main__":
  raise SystemExit(main())
