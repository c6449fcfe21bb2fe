"""Joining a job in JAX's fault-tolerance mode, and the service it needs.

:func:`initialize` sets the XLA flags for recoverable collectives
(:func:`set_flags`), turns on ``jax_enable_recoverability``, routes Orbax's
barriers through the coordination service (:mod:`.orbax_barrier`), shares
compile-cache keys across device orders (:mod:`.cache_keys`) and connects.
With an external service (:func:`start_service`, hosted by the supervisor)
a worker connects as a client only, so losing process 0 is survivable: a
private JAX API, guarded by version (:func:`unsupported`).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import jax

from .. import _jax_private, _reports
from ..errors import RestartRequired
from . import cache_keys, orbax_barrier, watchdog

RESTART_EXIT_CODE = _reports.RESTART_EXIT_CODE  # "restart the whole job", for launch
SERVICE_ENV = "SNAPSTORE_SERVICE"  # "external": the supervisor hosts the service
COLLECTIVE_TIMEOUT_ENV = "SNAPSTORE_COLLECTIVE_TIMEOUT_S"  # initialize()'s default
DEFAULT_COLLECTIVE_TIMEOUT_S = 30
TESTED_JAX = _jax_private.TESTED_JAX  # the jax versions whose private APIs this uses
_STALE_TOPOLOGY_KEY = "cpu:global_topology/cpu"
_listening_before: set[int] | None = None  # TCP listeners before this process joined

#: Set on CPU: a gloo collective with a dead peer otherwise hangs for 30 min.
CPU_FLAGS = ("--xla_cpu_collective_timeout_seconds={timeout}",)
#: JAX's documented set for GPUs ("Fault Tolerant Distributed JAX").
GPU_FLAGS = ("--xla_gpu_nccl_terminate_on_error=false",
             "--xla_gpu_nccl_async_execution=true",
             "--xla_gpu_nccl_blocking_communicators=false")
GPU_ENV = {"XLA_PYTHON_CLIENT_ABORT_COLLECTIVES_ON_FAILURE": "1",
           "XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT": "1"}



def unsupported() -> str | None:
  """Why in-place recovery cannot run with this JAX, or None if it can."""
  try:
    state, runtime = _jax_private.distributed_state(), _jax_private.runtime()
    from jax.experimental.multihost_utils import live_devices
  except ImportError as e:
    return f"jax {jax.__version__} lacks what in-place recovery needs ({e})"
  untested = _jax_private.version_tested()
  if untested is not None:
    return untested
  needed = [(state, "client"), (runtime, "get_distributed_runtime_client"),
            (runtime, "get_distributed_runtime_service"), (live_devices, "devices")]
  missing = [name for obj, name in needed if not hasattr(obj, name)]
  return f"jax {jax.__version__} lacks {missing}" if missing else None


def start_service(bind_address: str, num_processes: int, *,
                  heartbeat_timeout_s: int = 3) -> Any:
  """The JAX coordination service, recoverable, hosted by the caller (the
  supervisor). Keep the returned object alive; ``.shutdown()`` ends it."""
  return _jax_private.runtime().get_distributed_runtime_service(
      bind_address, num_processes, heartbeat_timeout=heartbeat_timeout_s,
      shutdown_timeout=10, recoverable=True)


def set_flags(*, collective_timeout_s: int = 30) -> None:
  """XLA flags for recoverable collectives; before the backend starts."""
  flags: tuple[str, ...]
  env: dict[str, str]
  if jax.config.jax_platforms and "cuda" in jax.config.jax_platforms:
    flags, env = GPU_FLAGS, GPU_ENV
  elif jax.config.jax_platforms == "cpu":
    flags, env = tuple(f.format(timeout=collective_timeout_s) for f in CPU_FLAGS), {}
  else:  # platform chosen later: set both, each is ignored by the other backend
    flags = GPU_FLAGS + tuple(f.format(timeout=collective_timeout_s) for f in CPU_FLAGS)
    env = GPU_ENV
  have = os.environ.get("XLA_FLAGS", "")
  add = [f for f in flags if f.split("=")[0] not in have]
  os.environ["XLA_FLAGS"] = " ".join([have, *add]).strip()
  for k, v in env.items():
    os.environ.setdefault(k, v)


def initialize(coordinator_address: str, num_processes: int, process_id: int, *,
               external_service: bool | None = None, heartbeat_timeout_s: int = 3,
               collective_timeout_s: int | None = None,
               bind_address: str | None = None) -> None:
  """Joins a multi-controller job in JAX's fault-tolerance mode.

  ``external_service`` (default: ``$SNAPSTORE_SERVICE == "external"``): the
  coordination service runs elsewhere (:func:`start_service`); connect as a
  client only, so that losing process 0 is survivable. Otherwise process 0
  hosts it, as ``jax.distributed.initialize`` does. Call before any other
  JAX use.

  ``collective_timeout_s`` (CPU): how long a gloo collective waits for a peer
  before it fails. A peer whose process died fails it at once (its sockets
  close); the timeout is for a peer that is alive but late, so it must exceed
  the skew between processes (compiling the first step on a loaded machine
  takes seconds), or a healthy job fails its first step. A survivor that
  waits on a peer that died elsewhere in the collective is freed sooner by
  :class:`InPlace`'s watchdog (``abort_after_s``). Default:
  ``$SNAPSTORE_COLLECTIVE_TIMEOUT_S``, else 30.
  Raises :class:`RestartRequired` if this JAX cannot do it.
  """
  global _listening_before
  if collective_timeout_s is None:
    collective_timeout_s = _timeout_from_env()
  _listening_before = watchdog.listening_ports()  # the gloo listener comes later
  why = unsupported()
  if why:
    raise RestartRequired(f"in-place recovery is off: {why}")
  if external_service is None:
    external_service = os.environ.get(SERVICE_ENV) == "external"
  set_flags(collective_timeout_s=collective_timeout_s)
  jax.config.update("jax_enable_recoverability", True)
  _orbax_barriers_in_the_service()
  cache_keys.share()
  if not external_service:
    jax.distributed.initialize(coordinator_address, num_processes, process_id,
                               heartbeat_timeout_seconds=heartbeat_timeout_s,
                               coordinator_bind_address=bind_address)
    return
  state = _jax_private.distributed_state()
  if state.client is not None:
    raise RuntimeError("jax.distributed is already initialized")
  state.coordinator_address = coordinator_address
  state.process_id, state.num_processes = process_id, num_processes
  state.client = _jax_private.runtime().get_distributed_runtime_client(
      coordinator_address, process_id, init_timeout=300, use_compression=True,
      heartbeat_timeout=heartbeat_timeout_s)
  state.client.connect()
  if process_id == 0:  # a replaced process 0 publishes the topology again
    with contextlib.suppress(Exception):
      state.client.key_value_delete(_STALE_TOPOLOGY_KEY)


def _timeout_from_env() -> int:
  value = os.environ.get(COLLECTIVE_TIMEOUT_ENV, str(DEFAULT_COLLECTIVE_TIMEOUT_S))
  try:
    seconds = int(value)
  except ValueError:
    seconds = 0
  if seconds < 1:
    raise ValueError(f"${COLLECTIVE_TIMEOUT_ENV} must be a whole number of seconds >= 1, "
                     f"got {value!r}")
  return seconds


def _orbax_barriers_in_the_service() -> None:
  """Orbax synchronizes processes with a gloo collective over every device
  in JAX's default order unless told to use the coordination service's
  barriers; after a heal that collective would meet the dead process's
  communicator (see :mod:`snapstore._devices`). An absl flag; set without parsing
  the command line. Those barriers then go through
  :func:`snapstore.recovery.orbax_barrier.install`: membership-bound, in the service's
  key-value store."""
  try:
    from absl import flags
    from orbax.checkpoint._src.multihost import multihost  # noqa: F401
  except ImportError:
    return
  name = "experimental_orbax_use_distributed_barrier"
  if name in flags.FLAGS:
    flags.FLAGS[name].value = True
    flags.FLAGS[name].present = 1
    if not flags.FLAGS.is_parsed():
      flags.FLAGS.mark_as_parsed()
  orbax_barrier.install()


def service_ports() -> set[int]:
  port = (_jax_private.distributed_state().coordinator_address or "").rsplit(":", 1)[-1]
  return {int(port)} if port.isdigit() else set()


def gloo_ports() -> set[int]:
  """This process's gloo listener ports: the TCP listeners that appeared
  since :func:`initialize` (the backend, started by ``jax.devices()``, opens
  gloo's), less the coordination service's. A server the program starts in
  between would be counted too: start it before ``initialize``."""
  ports = watchdog.listening_ports() - (_listening_before or set())
  return ports - service_ports()
