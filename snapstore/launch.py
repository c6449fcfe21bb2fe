"""A local supervisor that stands in for JobSet: N host processes, restarts, faults.

``launch`` starts ``num_hosts`` processes of a training module with
``jax.distributed`` on CPU (gloo collectives, ``devices_per_host`` devices
each). When any process dies, the others are killed and the whole job
restarts as a new incarnation — what the JAX coordination service forces on a
real multi-controller job. Faults are injected from outside, for real:
``Kill(host, step)`` sends SIGKILL when that host's store reports the step
(its ``PROGRESS`` file); ``lose_store=True`` also wipes the host's RAM store,
modelling a replaced machine.

Each process gets its identity from the environment: ``SNAPSTORE_COORDINATOR``,
``SNAPSTORE_NUM_HOSTS``, ``SNAPSTORE_HOST``, ``SNAPSTORE_INCARNATION``,
``SNAPSTORE_DEVICES_PER_HOST``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from ._hoststore import HostStore, host_dir

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Kill:
  """SIGKILL ``host`` once it reports ``step`` (in incarnation ``incarnation``)."""

  host: int
  step: int
  incarnation: int = 0
  lose_store: bool = False


@dataclasses.dataclass
class Incarnation:
  number: int
  num_hosts: int
  started: float
  ended: float = 0.0
  exit_codes: dict[int, int] = dataclasses.field(default_factory=dict)
  killed: list[int] = dataclasses.field(default_factory=list)
  kill_time: float | None = None

  @property
  def ok(self) -> bool:
    return bool(self.exit_codes) and all(c == 0 for c in self.exit_codes.values())


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def launch(module: str, args: Sequence[str], *, num_hosts: int, devices_per_host: int,
           store_dir: str | os.PathLike[str], run_id: str, kills: Sequence[Kill] = (),
           shrink_to: int | None = None, max_incarnations: int = 3,
           timeout_s: float = 300.0, log_dir: str | os.PathLike[str] | None = None,
           env: dict[str, str] | None = None) -> list[Incarnation]:
  """Runs ``python -m module args`` on ``num_hosts`` local processes until all
  exit 0, restarting after failures. ``shrink_to`` restarts with fewer hosts."""
  out: list[Incarnation] = []
  hosts = num_hosts
  deadline = time.monotonic() + timeout_s
  for number in range(max_incarnations):
    port = _free_port()
    inc = Incarnation(number, hosts, time.time())
    out.append(inc)
    procs = {}
    for h in range(hosts):
      penv = dict(os.environ, **(env or {}))
      penv.update(SNAPSTORE_COORDINATOR=f"127.0.0.1:{port}", SNAPSTORE_NUM_HOSTS=str(hosts),
                  SNAPSTORE_HOST=str(h), SNAPSTORE_INCARNATION=str(number),
                  SNAPSTORE_DEVICES_PER_HOST=str(devices_per_host))
      log = (open(Path(log_dir) / f"inc{number}-host{h}.log", "wb")
             if log_dir else subprocess.DEVNULL)
      procs[h] = subprocess.Popen([sys.executable, "-m", module, *args], env=penv,
                                  stdout=log, stderr=subprocess.STDOUT)
    pending = [k for k in kills if k.incarnation == number]
    stores = {h: HostStore(host_dir(store_dir, run_id, h), run_id=run_id, host=h,
                           keep=1, budget_bytes=None) for h in range(hosts)}
    failed = False
    while procs.keys() - inc.exit_codes.keys():
      if time.monotonic() > deadline:
        for p in procs.values():
          p.kill()
        raise TimeoutError(f"job did not finish in {timeout_s} s (incarnation {number})")
      for k in list(pending):
        if k.host < hosts and stores[k.host].read_progress()[0] >= k.step:
          procs[k.host].send_signal(signal.SIGKILL)
          inc.killed.append(k.host)
          inc.kill_time = time.time()
          pending.remove(k)
          logger.info("incarnation %d: SIGKILL host %d at step %d", number, k.host, k.step)
          if k.lose_store:
            shutil.rmtree(host_dir(store_dir, run_id, k.host), ignore_errors=True)
      for h, p in procs.items():
        if h not in inc.exit_codes and p.poll() is not None:
          inc.exit_codes[h] = p.returncode
          if p.returncode != 0:
            failed = True
      if failed:  # the coordination service would abort the rest: do it now.
        for h, p in procs.items():
          if p.poll() is None:
            p.kill()
          inc.exit_codes[h] = p.wait()
        break
      time.sleep(0.02)
    inc.ended = time.time()
    if not failed:
      return out
    if shrink_to:
      hosts = shrink_to
  raise RuntimeError(f"job still failing after {max_incarnations} incarnations")
