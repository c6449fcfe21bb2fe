"""A 2-process in-place job (``tests/test_watchdog.py``): one all-reduce to set
up gloo, then process 1 freezes itself (SIGSTOP: alive, silent, its sockets
open) while process 0 waits in the next all-reduce. Process 0 writes what
ended its wait to ``argv[1]``. The collective timeout is 600 s, so only the
watchdog can end the wait within the test's time."""

import json
import os
import signal
import sys
import time

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from snapstore import recovery

if __name__ == "__main__":
  jax.config.update("jax_platforms", "cpu")
  jax.config.update("jax_num_cpu_devices", 1)
  pid = int(os.environ["SNAPSTORE_HOST"])
  recovery.initialize(os.environ["SNAPSTORE_COORDINATOR"], 2, pid, collective_timeout_s=600)
  job = recovery.InPlace(abort_after_s=1.5)

  def total(devices: list[jax.Device]) -> float:
    mesh = Mesh(np.array(devices), ("x",))
    x = jax.make_array_from_callback((2, 256), NamedSharding(mesh, PartitionSpec("x")),
                                     lambda idx: np.ones((1, 256), np.float32))
    return float(jax.jit(lambda v: v.sum(), out_shardings=NamedSharding(mesh, PartitionSpec()))(x))

  with job.live() as devices:
    first = total(devices)
  if pid == 1:
    time.sleep(1.0)  # a few beats first
    os.kill(os.getpid(), signal.SIGSTOP)
  t0 = time.monotonic()
  try:
    with job.live() as devices:
      outcome = {"result": total(devices)}
  except job.FAILURES as e:
    outcome = {"error": type(e).__name__, "cause": repr(e.__cause__ or e.__context__)}
  outcome.update(first=first, waited_s=time.monotonic() - t0, aborts=job.watchdog.aborts,
                 gloo_ports=sorted(job.watchdog.gloo_ports))
  with open(sys.argv[1], "w") as f:
    json.dump(outcome, f)
  os._exit(0)
