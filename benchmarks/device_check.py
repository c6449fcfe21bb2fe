"""The checks a CPU cannot make, as one command for a GPU machine.

``python -m benchmarks.device_check [--mb 1024]`` prints JSON:

* ``capture``: device -> ``pinned_host`` throughput (``jax.device_put`` onto
  the same sharding with ``memory_kind="pinned_host"``, what the pinned-host
  store does) against ``jax.device_get`` and a host ``memcpy``, same run;
* ``snapshot``: a ``SnapshotManager`` save (to host files) and restore of
  the same state, bitwise checked, with their throughput;
* ``recovery``: ``snapstore.recovery.set_flags`` on GPU (JAX's documented
  flag set), then a recoverable one-process job (``jax_enable_recoverability``,
  ``live_devices``) running a jitted step. Recovery across processes needs
  one GPU per process; with one GPU this checks that the flag set and the
  ``InPlace`` loop start and run.

Without a GPU it prints ``{"skipped": ...}`` and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import tempfile
import time
from collections.abc import Sequence


def _gbps(nbytes: int, seconds: float) -> float:
  return round(nbytes / seconds / 1e9, 2)


def main(argv: Sequence[str] | None = None) -> int:
  p = argparse.ArgumentParser()
  p.add_argument("--mb", type=int, default=1024)
  p.add_argument("--repeats", type=int, default=5)
  a = p.parse_args(argv)
  os.environ.setdefault("JAX_PLATFORMS", "cuda")
  from snapstore import recovery
  recovery.set_flags()  # before the backend starts
  import jax
  try:
    gpus = jax.devices("gpu")
  except RuntimeError as e:
    print(json.dumps({"skipped": f"no GPU: {e}"}))
    return 0
  import numpy as np

  import snapstore
  out: dict = {"devices": [str(d) for d in gpus], "jax": jax.__version__,
               "xla_flags": os.environ.get("XLA_FLAGS", "")}
  n = (a.mb << 20) // 4
  x = jax.device_put(np.arange(n, dtype=np.float32), gpus[0])
  x.block_until_ready()
  pinned = x.sharding.with_memory_kind("pinned_host")

  def timed(fn) -> float:
    best = float("inf")
    for _ in range(a.repeats):
      t = time.perf_counter()
      jax.block_until_ready(fn())
      best = min(best, time.perf_counter() - t)
    return best

  host = np.empty(n, np.float32)
  out["capture"] = {
      "mb": a.mb,
      "device_to_pinned_host_gbps": _gbps(x.nbytes, timed(lambda: jax.device_put(x, pinned))),
      "device_get_gbps": _gbps(x.nbytes, timed(lambda: jax.device_get(x))),
      "host_memcpy_gbps": _gbps(x.nbytes, timed(lambda: np.copyto(host, np.asarray(host)))),
  }
  state = {"w": x, "step": 3}
  with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as d:
    with snapstore.SnapshotManager(snapstore.SnapshotOptions(store_dir=d, keep=1)) as mgr:
      t = time.perf_counter()
      mgr.save(1, state)
      mgr.wait_until_finished()
      save_s = time.perf_counter() - t
      t = time.perf_counter()
      r = mgr.restore(jax.tree.map(lambda v: v, state))
      jax.block_until_ready(r.state)
      restore_s = time.perf_counter() - t
      same = bool(np.array_equal(np.asarray(r.state["w"]), np.asarray(x)))
  out["snapshot"] = {"save_gbps": _gbps(x.nbytes, save_s),
                     "restore_gbps": _gbps(x.nbytes, restore_s), "bitwise_equal": same}
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  service = recovery.start_service(f"127.0.0.1:{port}", 1)
  try:
    recovery.initialize(f"127.0.0.1:{port}", 1, 0, external_service=True)
    job = recovery.InPlace()
    step_fn = jax.jit(lambda v: v * 2.0)
    steps = 0
    while steps < 3:
      try:
        with job.live() as devices:
          y = step_fn(jax.device_put(np.ones(4, np.float32), devices[0]))
          y.block_until_ready()
        steps += 1
      except job.FAILURES as e:
        job.failed(e)
    out["recovery"] = {"steps": steps, "generation": job.generation,
                       "unsupported": recovery.unsupported()}
    job.close()
  finally:
    service.shutdown()
  print(json.dumps(out, indent=2))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
