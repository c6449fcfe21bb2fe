"""One host of ``benchmarks.parity`` (run by ``snapstore launch``)."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from benchmarks._mh_worker import Job


def main() -> int:
  p = argparse.ArgumentParser()
  p.add_argument("--mb", type=int, required=True)
  p.add_argument("--steps", type=int, default=6)
  p.add_argument("--rounds", type=int, default=2)
  p.add_argument("--repeats", type=int, default=2)
  p.add_argument("--parity-k", type=int, default=3)
  p.add_argument("--step-s", type=float, default=0.5)
  p.add_argument("--out", required=True)
  p.add_argument("--store", required=True)
  a = p.parse_args()
  from snapstore.testing import init_from_env
  host, num_hosts, _ = init_from_env()
  import jax
  import numpy as np
  from jax.experimental import multihost_utils

  import snapstore

  def total(x: float) -> list[float]:  # every host's value, in host order
    return [float(v) for v in np.asarray(multihost_utils.process_allgather(np.array([x])))
            .reshape(-1)]

  job = Job(a.mb, a.steps, a.step_s)
  common = dict(store=snapstore.HostFiles(dir=a.store), keep=1, hosts_per_domain=1)
  mgrs = {"replica": snapstore.SnapshotManager(snapstore.SnapshotOptions(
              run_id="replica", redundancy=snapstore.Replicas(1), **common)),
          "parity": snapstore.SnapshotManager(snapstore.SnapshotOptions(
              run_id="parity", redundancy=snapstore.Parity(a.parity_k), **common))}
  report: dict = {"hosts": num_hosts, "domains": num_hosts, "parity_k": a.parity_k,
                  "state_mb": job.state_mb, "step_s": a.step_s}
  for mgr in mgrs.values():
    job.block(mgr)  # compile, allocate slots
  best = {"none": float("inf"), "replica": float("inf"), "parity": float("inf")}
  for _ in range(a.rounds):
    for key in best:
      best[key] = min(best[key], job.block(mgrs.get(key)))
  for key in ("replica", "parity"):
    report[f"{key}_step_overhead"] = best[key] / best["none"] - 1
  report["step_s_measured"] = best

  for mgr in mgrs.values():  # both hold the same newest step
    mgr.save(job.step, job.state, force=True)
    mgr.wait_until_finished()
  for name, mgr in mgrs.items():  # RAM held, measured from each host's store
    store = mgr._backend.stores[host]
    newest = store.manifests()[-1]
    own = sum(p.nbytes for p in newest.pieces if p.owner == host)
    parity = sum(r.piece.nbytes for r in newest.parity)
    others = newest.data_bytes - own
    report[name] = {
        "ram_bytes_per_host_max": max(total(store.held_bytes())),
        "own_bytes_per_host": max(total(own)),
        "extra_bytes_per_host_max": max(total(others)),
        # what crosses between hosts per snapshot: the replicas received, or
        # the parity reduce-scatter (each member sends k sub-blocks of a block)
        "bytes_moved_per_snapshot": sum(total(a.parity_k * parity if parity else others)),
    }
  report["extra_parity_vs_replica"] = (report["parity"]["extra_bytes_per_host_max"]
                                       / report["replica"]["extra_bytes_per_host_max"])

  # The parity kept (a sum modulo 2**32 around a ring of permutes) against
  # the classic XOR on the same ring, and the sum as one psum_scatter.
  from snapstore import _devices, _parity
  st = mgrs["parity"]._backend._stripes()
  arrays = list(job.state.values())
  _, length = _parity.layout(st, list(range(len(arrays))), arrays)
  for op in _parity.OPS:
    run = lambda op=op: _parity.encode(st, arrays, length, op=op,  # noqa: E731
                                 order=_devices.devices())
    jax.block_until_ready(run())  # compile
    times = []
    for r in range(5):
      multihost_utils.sync_global_devices(f"encode-{op}-{r}")
      t = time.perf_counter()
      jax.block_until_ready(run())
      times.append(time.perf_counter() - t)
    report[f"encode_{op}_s"] = statistics.median(times)
  report["encode_xor_vs_sum"] = report["encode_xor_s"] / report["encode_sum_s"]
  report["encode_reduce_scatter_vs_ring"] = (report["encode_sum_reduce_scatter_s"]
                                             / report["encode_sum_s"])

  # A lost host: host 1's store is wiped (a replacement with empty RAM), and
  # every host restores the newest step; its pieces come from replicas, or
  # are rebuilt from parity.
  expected = {k: [np.asarray(s.data).copy() for s in v.addressable_shards]
              for k, v in job.state.items()}
  for name, mgr in mgrs.items():
    if host == 1:
      mgr._backend.stores[1].wipe()
    times = []
    for r in range(a.repeats):
      multihost_utils.sync_global_devices(f"restore-{name}-{r}")
      t = time.perf_counter()
      res = mgr.restore(job.abstract)
      jax.block_until_ready(res.state)
      times.append(time.perf_counter() - t)
    same = all(np.array_equal(np.asarray(s.data), e)
               for k, v in res.state.items()
               for s, e in zip(v.addressable_shards, expected[k], strict=True))
    report[name].update(
        restore_lost_host_s=statistics.median(times), restored_step=res.step,
        newest_step=job.step, bitwise_equal=min(total(float(same))) == 1.0,
        bytes_rebuilt=int(sum(total(res.bytes_read.get("rebuilt", 0)))) // num_hosts,
        bytes_exchanged=int(res.bytes_read.get("exchanged", 0)))
    mgr.close()
  if host == 0:
    Path(a.out).write_text(json.dumps(report))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
