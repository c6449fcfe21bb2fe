"""Does this jaxlib hang on a cached multi-process CPU program? (docs/limits.md)

``python -m benchmarks.cpu_cache_probe``: the demo's train step (a small flax
transformer: 39 all-gathers, 2 collective-permutes, 2 all-reduces) on
``--hosts`` processes x 2 CPU devices (``jax.distributed``, gloo), five
steps, run twice with one persistent compilation cache: the first run
compiles and writes the cache, the second loads the step from it in
process 0 (JAX writes the cache from process 0 and keys it by each process's
own topology: the others compile again). Nothing of snapstore runs but the
demo's model. Prints JSON: for each run, whether
every process ended within ``--timeout-s`` and how long it took, and
``cached_run_hangs``. On jaxlib 0.12.1 (2026-12-07, a 2-core VM): the first
run 20.9 s, the second hung (killed at 60 s), 2 of 2; on 0.12.0.1 both ran
(19.6 s, 17.0 s). ``snapstore._jax_compat.CPU_CACHE_HANG_SINCE`` is the
first release this reports a hang on.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

STEPS = 5


def _worker(cache: str, host: int, hosts: int, port: int) -> None:
  import jax
  jax.config.update("jax_platforms", "cpu")
  jax.config.update("jax_num_cpu_devices", 2)
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.config.update("jax_compilation_cache_dir", cache)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  jax.distributed.initialize(f"127.0.0.1:{port}", hosts, host)
  from snapstore.demo.example import ModelConfig, Trainer
  trainer = Trainer(ModelConfig())
  state = trainer.init_state()
  for s in range(1, STEPS + 1):
    state, loss = trainer.step(state, s)
    float(loss)  # blocks until the step ran everywhere


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return int(s.getsockname()[1])


def _run(cache: str, hosts: int, timeout_s: float) -> dict[str, Any]:
  port = _free_port()
  procs = [subprocess.Popen([sys.executable, "-m", "benchmarks.cpu_cache_probe", "--worker",
                             cache, str(h), str(hosts), str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
           for h in range(hosts)]
  t0 = time.monotonic()
  deadline = t0 + timeout_s
  codes: list[int | None] = []
  for p in procs:
    try:
      codes.append(p.wait(timeout=max(0.1, deadline - time.monotonic())))
    except subprocess.TimeoutExpired:
      codes.append(None)
  for p in procs:
    if p.poll() is None:
      p.kill()
      p.wait()
  return {"finished": all(c == 0 for c in codes), "exit_codes": codes,
          "seconds": round(time.monotonic() - t0, 2)}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  argv = list(sys.argv[1:] if argv is None else argv)
  if argv[:1] == ["--worker"]:
    _worker(argv[1], int(argv[2]), int(argv[3]), int(argv[4]))
    return {}
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--hosts", type=int, default=4)
  p.add_argument("--timeout-s", type=float, default=90.0,
                 help="a run that takes longer counts as hung")
  a = p.parse_args(argv)
  import importlib.metadata
  with tempfile.TemporaryDirectory(prefix="cpu-cache-probe-") as cache:
    first = _run(cache, a.hosts, a.timeout_s)
    cached = _run(cache, a.hosts, a.timeout_s)
    entries = len(os.listdir(cache))
  out = {"jax": importlib.metadata.version("jax"),
         "jaxlib": importlib.metadata.version("jaxlib"),
         "hosts": a.hosts, "devices_per_host": 2, "steps": STEPS, "cache_entries": entries,
         "fresh_compile": first, "from_cache": cached,
         "cached_run_hangs": first["finished"] and not cached["finished"]}
  print(json.dumps(out, indent=2))
  return out


if __name__ == "__main__":
  main()
