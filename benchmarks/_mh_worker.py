"""One host of ``benchmarks.multihost`` (run by ``snapstore launch``)."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any


class Job:
  """The benchmarks' multi-host job: ``mb`` MB of float32 leaves (16 MB
  each) sharded over every device; a step touches every byte and is padded
  to ``step_s`` with a sleep (the accelerator computing while the host's
  cores are free, so a snapshot's copy may use them)."""

  def __init__(self, mb: int, steps: int, step_s: float):
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    mesh = jax.make_mesh((jax.device_count(),), ("d",),
                         axis_types=(jax.sharding.AxisType.Auto,))
    sharding = NamedSharding(mesh, P("d"))
    leaf = 4 << 20
    n = max(1, (mb << 20) // (leaf * 4))
    size = min(leaf, (mb << 20) // 4)
    make = jax.jit(lambda k: jax.random.normal(k, (size,), jnp.float32),
                   out_shardings=sharding)
    self.state = {f"w{i}": make(jax.random.key(i)) for i in range(n)}
    self.abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), self.state)
    self.state_mb = n * size * 4 / 2**20
    self._step_fn = jax.jit(lambda s: jax.tree.map(lambda x: x * 0.999 + 0.001, s),
                            donate_argnums=0)
    self.steps, self.step_s, self.step = steps, step_s, 0

  def block(self, mgr: Any) -> float:
    """Seconds a step over ``steps`` steps, each saved to ``mgr`` (None: not saved)."""
    import jax
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices("block")
    t = time.perf_counter()
    for _ in range(self.steps):
      self.step += 1
      t_step = time.perf_counter()
      self.state = self._step_fn(self.state)
      jax.block_until_ready(self.state)
      time.sleep(max(0.0, self.step_s - (time.perf_counter() - t_step)))
      if mgr is not None:
        mgr.save(self.step, self.state)
    jax.block_until_ready(self.state)
    if mgr is not None:
      mgr.wait_until_finished()
    return (time.perf_counter() - t) / self.steps


def main() -> int:
  p = argparse.ArgumentParser()
  p.add_argument("--mb", type=int, required=True)
  p.add_argument("--steps", type=int, default=10)
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--repeats", type=int, default=4)
  p.add_argument("--out", required=True)
  p.add_argument("--store", required=True)
  p.add_argument("--local", required=True)
  p.add_argument("--gcs", required=True)
  p.add_argument("--replicas", type=int, default=1)
  p.add_argument("--step-s", type=float, default=0.0)
  a = p.parse_args()
  from snapstore.testing import init_from_env
  host, num_hosts, _ = init_from_env()
  import jax
  import numpy as np
  from jax.experimental import multihost_utils

  import snapstore
  from snapstore._tree import flatten

  job = Job(a.mb, a.steps, a.step_s)
  abstract = job.abstract
  opts = snapstore.SnapshotOptions(store=snapstore.HostFiles(dir=a.store), run_id="mh", keep=1,
                                   redundancy=snapstore.Replicas(a.replicas),
                                   hosts_per_domain=num_hosts // 2)
  report: dict = {"hosts": num_hosts, "state_mb": job.state_mb}
  with snapstore.SnapshotManager(opts) as mgr:
    job.block(mgr)  # compile, allocate slots
    best = {"none": float("inf"), "snap": float("inf")}
    for _ in range(a.rounds):
      for key in best:
        best[key] = min(best[key], job.block(mgr if key == "snap" else None))
    step, state = job.step, job.state
    report.update(step_s_none=best["none"], step_s_snapshot=best["snap"],
                  step_ratio=best["snap"] / best["none"])
    newest = mgr._backend.manifests()[-1]
    mine = sum(p.nbytes for p in newest.pieces if p.owner != host)
    moved = int(np.asarray(multihost_utils.process_allgather(np.array([mine]))).sum())
    report["replica_bytes_per_step"] = moved
    specs, leaves, _ = flatten(state)
    tiers = {"orbax_local": snapstore.OrbaxTier(a.local),
             "orbax_gcs": snapstore.OrbaxTier(a.gcs)}
    for tier in tiers.values():
      tier.save(step, specs, leaves, None)
      tier.wait_until_finished()
    times: dict[str, list[float]] = {"ram": [], "orbax_local": [], "orbax_gcs": []}
    parts: list[dict[str, float]] = []  # each RAM restore's timings on host 0
    for r in range(a.repeats):
      for name in times:
        multihost_utils.sync_global_devices(f"restore-{name}-{r}")
        t = time.perf_counter()
        if name == "ram":
          res = mgr.restore(abstract)
          parts.append(dict(res.timings))
        else:
          empty = snapstore.SnapshotOptions(store=snapstore.HostFiles(dir=a.store),
                                           run_id=f"empty-{name}")
          with snapstore.SnapshotManager(empty, persistent=tiers[name]) as other:
            res = other.restore(abstract)
        jax.block_until_ready(res.state)
        times[name].append(time.perf_counter() - t)
        assert res.step == step, (name, res.step, step)
    # The first restore of each in these processes (what a recovery pays:
    # compiling, first collectives, fresh memory), and the median of the rest.
    med = {k: statistics.median(v[1:] or v) for k, v in times.items()}
    report.update({f"restore_{k}_s": v for k, v in med.items()})
    report.update({f"restore_{k}_first_s": v[0] for k, v in times.items()})
    report["restore_ram_parts_first_s"] = parts[0]  # where the time goes (host 0)
    report["restore_ram_parts_s"] = {k: statistics.median(p.get(k, 0.0) for p in parts[1:] or parts)
                                     for k in parts[0]}
    report["orbax_local_vs_ram"] = med["orbax_local"] / med["ram"]
    report["orbax_gcs_vs_ram"] = med["orbax_gcs"] / med["ram"]
    report["orbax_local_vs_ram_first"] = times["orbax_local"][0] / times["ram"][0]
    report["orbax_gcs_vs_ram_first"] = times["orbax_gcs"][0] / times["ram"][0]
  if host == 0:
    Path(a.out).write_text(json.dumps(report))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
