"""snapstore against Orbax's own in-RAM options, on the same state, side by side.

``python -m benchmarks.vs_orbax --mb 256``: one process, 8 CPU devices as a
(replica=2, model=4) mesh, float32 leaves sharded over ``model`` and
replicated over ``replica`` (data parallelism over two slices). For each
system, ``--repeats`` rounds, interleaved:

* ``snapstore``: its Orbax-compatible ``Snapshotter`` (one pinned-host store
  per slice): ``save`` (returns once the copies are dispatched), ``join``
  (copied, checksummed on device, committed), ``load`` (verified on device);
* ``snapstore_host_files``: the same with ``store=HostFiles()`` (files on
  /dev/shm, crc32c on the host), the multi-controller store;
* ``orbax_snapshotter``: Orbax v1 ``Snapshotter`` (pinned-host copies split by
  the replica axis): ``save``, ``join``, ``load``;
* ``orbax_local_ramfs``: the local tier of Orbax's emergency checkpointing,
  an async ``CheckpointManager`` on ``/dev/shm`` (the emergency manager
  itself saves locally only in non-primary slices, which one process does
  not have): ``save``, ``wait_until_finished``, ``restore``.

Reported per system: median ``save_return_s``, ``save_complete_s``,
``restore_s``; and snapstore's ratios to each (>1: snapstore is faster).

``floor``: what the machine allows a store that checks every byte, measured
in the same run: ``save_complete_s``, two checked copies of the state's
bytes (one per slice, as snapstore keeps them; Orbax's Snapshotter keeps
both replicas too), ``restore_s``, one checked copy (snapstore's fused copy
and crc32c, ``_checksum.copy_crc``, on two threads into reused memory,
nothing else); and
each snapstore system's times over it (``over_floor``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

from benchmarks._common import checked_copy_seconds, cleanup, ram_dir, sized_main

_WARMUP = 2


class _System:
  name: str

  def save(self, step: int, state: Any) -> None: ...
  def complete(self) -> None: ...
  def restore(self, step: int, abstract: Any) -> Any: ...
  def close(self) -> None: ...


def _systems(work: Any, mesh: Any, abstract: Any) -> dict[str, Any]:
  """Each system's name and how to make it (made only when chosen: the
  cold path of one must not be warmed by making another)."""
  import orbax.checkpoint as ocp
  from orbax.checkpoint.experimental.v1.training.pathways import Snapshotter

  import snapstore

  class Snap(_System):
    # snapstore's drop-in Snapshotter: one store per slice (the two rows of
    # the mesh), as on Pathways: pinned_host arrays (the default with
    # slices), or host files for comparison.
    def __init__(self, kind="pinned_host"):
      from snapstore.integrations.pathways import Snapshotter as SnapstoreSnapshotter
      self.name = "snapstore" if kind == "pinned_host" else f"snapstore_{kind}"
      store = (snapstore.PinnedHost() if kind == "pinned_host"
               else snapstore.HostFiles(dir=work / "snapstore"))
      rows = mesh.devices
      self.s = SnapstoreSnapshotter(
          options=snapstore.SnapshotOptions(store=store, keep=1, run_id=kind),
          slices={k: list(rows[k]) for k in range(rows.shape[0])})

    def save(self, step, state):
      self.s.save(step, state)

    def complete(self):
      self.s.join()

    def restore(self, step, abstract):
      return self.s.load(abstract)

    def close(self):
      self.s.close()

  class OrbaxSnapshotter(_System):
    name = "orbax_snapshotter"

    def __init__(self):
      self.s = Snapshotter(replica_axis_index=0)

    def save(self, step, state):
      self.s.save(step, state)

    def complete(self):
      self.s.join()

    def restore(self, step, abstract):
      return self.s.load(abstract, reset_snapshot_state=False)

    def close(self):
      pass

  class OrbaxRamfs(_System):
    # Orbax's emergency CheckpointManager keeps its local tier as an Orbax
    # CheckpointManager writing to a RAM disk in each non-primary slice; in
    # one process every slice is the primary one and it never saves locally
    # (checked: the local directory stays empty), so its local tier is run
    # directly: an async CheckpointManager on /dev/shm.
    name = "orbax_local_ramfs"

    def __init__(self):
      self.m = ocp.CheckpointManager(
          work / "orbax-ramfs",
          options=ocp.CheckpointManagerOptions(max_to_keep=1, enable_async_checkpointing=True))

    def save(self, step, state):
      self.m.save(step, args=ocp.args.StandardSave(state))

    def complete(self):
      self.m.wait_until_finished()

    def restore(self, step, abstract):
      return self.m.restore(step, args=ocp.args.StandardRestore(abstract))

    def close(self):
      self.m.close()

  return {"snapstore": Snap,
          "snapstore_host_files": lambda: Snap("host_files"),
          "orbax_snapshotter": OrbaxSnapshotter, "orbax_local_ramfs": OrbaxRamfs}


def make_state(mb: int, leaves: int | None = None) -> tuple[Any, dict[str, Any], Any]:
  """(mesh, state, abstract): ``mb`` MB of float32 leaves on a (replica=2,
  model=4) mesh, sharded over ``model`` (16 MB leaves, or the bytes split
  over ``leaves``)."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec as P
  mesh = jax.make_mesh((2, 4), ("replica", "model"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  sharding = NamedSharding(mesh, P(None, "model"))
  if leaves:
    elems, n = max(1024, (mb << 20) // 4 // leaves // 1024 * 1024), leaves
  else:
    elems = min(4 << 20, (mb << 20) // 4)
    n = max(1, (mb << 20) // (elems * 4))
  make = jax.jit(lambda k: jax.random.normal(k, (elems // 1024, 1024), jnp.float32),
                 out_shardings=sharding)
  state = {f"w{i}": make(jax.random.key(i)) for i in range(n)}
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
                          state)
  return mesh, jax.block_until_ready(state), abstract


def systems(work: Any, mesh: Any, abstract: Any, only: Sequence[str] | None = None
            ) -> list[Any]:
  """The systems compared, those named in ``only`` (default all)."""
  return [make() for name, make in _systems(work, mesh, abstract).items()
          if only is None or name in only]


def run(mb: int, repeats: int, only: Sequence[str] | None = None,
        leaves: int | None = None) -> dict:
  """``leaves``: the same bytes split over this many leaves (default: 16 MB
  leaves)."""
  import jax
  import numpy as np
  mesh, state, abstract = make_state(mb, leaves)
  n = len(state)
  nbytes = sum(x.nbytes for x in state.values())
  work = ram_dir("snapstore-vs-orbax-")
  times: dict[str, dict[str, list[float]]] = {}
  try:
    chosen = systems(work, mesh, abstract, only)
    # Two rounds warm up (allocation, compilation): snapstore's stores with
    # keep=1 write two slots in turn, and the second slot's first touch
    # (the kernel faulting in fresh memory) would fall in the first timed
    # round.
    for r in range(repeats + _WARMUP):
      for sys_ in chosen:
        t = time.perf_counter()
        sys_.save(r + 1, state)
        ret = time.perf_counter() - t
        sys_.complete()
        done = time.perf_counter() - t
        t = time.perf_counter()
        out = jax.block_until_ready(sys_.restore(r + 1, abstract))
        rest = time.perf_counter() - t
        for k in state:
          if not np.array_equal(np.asarray(out[k]), np.asarray(state[k])):
            raise AssertionError(f"{sys_.name} restored a different {k}")
        if r >= _WARMUP:
          row = times.setdefault(sys_.name, {"save_return_s": [], "save_complete_s": [],
                                             "restore_s": []})
          row["save_return_s"].append(ret)
          row["save_complete_s"].append(done)
          row["restore_s"].append(rest)
    for sys_ in chosen:
      sys_.close()
  finally:
    cleanup(work)
  sources = [np.asarray(x).reshape(-1).view(np.uint8) for x in state.values()]
  floor = {"save_complete_s": checked_copy_seconds(sources, copies=2, repeats=repeats),
           "restore_s": checked_copy_seconds(sources, copies=1, repeats=repeats)}
  del sources
  med = {name: {k: statistics.median(v) for k, v in row.items()} for name, row in times.items()}
  over_floor = {name: {k: med[name][k] / floor[k] for k in floor}
                for name in med if name.startswith("snapstore")}
  snap = med["snapstore"]
  ratios: dict[str, float] = {}
  for other in [n for n in med if n != "snapstore"]:
    for k in ("save_return_s", "save_complete_s", "restore_s"):
      ratios[f"{other}_over_snapstore_{k[:-2]}"] = med[other][k] / snap[k]
  return {"state_mb": nbytes / 2**20, "leaves": n, "systems": med, "ratios": ratios,
          "floor": floor, "over_floor": over_floor}


def main(argv: Sequence[str] | None = None) -> int:
  return sized_main("vs_orbax", __doc__, run, argv)


if __name__ == "__main__":
  raise SystemExit(main())
