"""The worker's side of ``launch``: identity from the environment, reports back.

A process that :func:`snapstore.testing.supervisor` starts reads who it is from
the environment (:func:`init_from_env`) and leaves what the incarnation
report carries in ``SNAPSTORE_REPORT_DIR`` (:mod:`snapstore._reports`: the
restores and digests here, missing hosts, resizes and restart reasons from
the engine). Every name a worker needs is here.
"""

from __future__ import annotations

import functools
import os
from typing import Any

from .._reports import (
    IN_PLACE_ENV,
    INCARNATION_ENV,
    REPORT_DIR_ENV,
    RESTART_EXIT_CODE,
    incarnation_from_env,
    report_digest,
    report_missing,
    report_resize,
    report_restart,
    report_restore,
)

__all__ = [
  "INCARNATION_ENV",
  "IN_PLACE_ENV",
  "REPORT_DIR_ENV",
  "RESTART_EXIT_CODE",
  "global_digest",
  "in_place_from_env",
  "incarnation_from_env",
  "init_from_env",
  "report_digest",
  "report_missing",
  "report_resize",
  "report_restart",
  "report_restore",
]


def global_digest(state: Any, replicated: Any) -> str:
  """The sha256 of a global state, the same on every process: every byte is
  gathered to every process by one jitted identity onto ``replicated`` (a
  fully replicated sharding of the state's mesh). Collective. Typed PRNG
  keys count by their key data."""
  import hashlib

  import jax
  import numpy as np
  leaves = [jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
            else x for x in jax.tree.leaves(state)]
  h = hashlib.sha256()
  for x in _gather_all(replicated)(leaves):
    h.update(np.asarray(x.addressable_shards[0].data).tobytes())
  return h.hexdigest()


@functools.lru_cache(maxsize=8)
def _gather_all(replicated: Any) -> Any:
  """The jitted identity onto ``replicated``: one jit object per sharding, so
  a digest after every step traces and compiles it once (a new lambda each
  call would trace and compile it at every digest)."""
  import jax
  return jax.jit(lambda xs: xs, out_shardings=replicated)


def init_from_env() -> tuple[int, int, int]:
  """In a process started by ``launch``: configures JAX for CPU (gloo, the
  given devices per host) and joins the job. Returns (host, hosts,
  incarnation). Call before any other JAX use."""
  import jax
  env = os.environ
  host, num_hosts = int(env["SNAPSTORE_HOST"]), int(env["SNAPSTORE_NUM_HOSTS"])
  jax.config.update("jax_platforms", "cpu")
  jax.config.update("jax_num_cpu_devices", int(env["SNAPSTORE_DEVICES_PER_HOST"]))
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  if in_place_from_env():
    from .. import recovery
    recovery.initialize(env["SNAPSTORE_COORDINATOR"], num_hosts, host,
                        bind_address=env.get("SNAPSTORE_COORDINATOR_BIND"))
  else:
    jax.distributed.initialize(env["SNAPSTORE_COORDINATOR"], num_hosts, host,
                               heartbeat_timeout_seconds=10,
                               coordinator_bind_address=env.get("SNAPSTORE_COORDINATOR_BIND"))
  return host, num_hosts, int(env["SNAPSTORE_INCARNATION"])


def in_place_from_env() -> bool:
  """True in a worker that ``launch(in_place=True)`` started."""
  return os.environ.get(IN_PLACE_ENV) == "1"
