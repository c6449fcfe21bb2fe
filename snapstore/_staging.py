"""On-device staging (``SnapshotOptions(stage_on_device=True)``): a capture
reads a copy of the state made in the accelerator's own memory, not the
state's buffers.

A train step donates the state it is given. A copy to host memory still
reading a donated buffer holds the next step back until it finishes.
Copying the state's buffers once in device memory first (HBM to HBM, about a
millisecond a GiB) lets the next step start at once while the host copy
reads the staged buffers. It costs one more copy of this host's shards in
device memory until the host copy completes, so it is off by default:
training jobs tend to fill their accelerators' memory.

Measured on one TPU v5e (docs/benchmarks.md, "On a TPU"): with the
pinned-host store and a 1 GiB state, a snapshot every 3 steps of 369 ms
cost 41% in step time staged against 82% unstaged; with host files, no
gain. A staging allocation that fails (out of device memory) is logged once,
and this manager captures from the state's buffers from then on.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

logger = logging.getLogger(__name__)


@jax.jit
def _copy(arrays: list[jax.Array]) -> list[jax.Array]:
  return [x.copy() for x in arrays]


def _stageable(x: Any) -> bool:
  """A device array of this process (typed PRNG keys are left as they are)."""
  return (isinstance(x, jax.Array) and x.is_fully_addressable
          and not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key))


def shard_bytes(arrays: Sequence[jax.Array]) -> int:
  """The most bytes any one device holds of ``arrays`` (each leaf's shard,
  as if every leaf had one on the same device)."""
  return sum(int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize for x in arrays)


class Stager:
  """Stages each capture's device leaves while :attr:`on`."""

  def __init__(self, on: bool) -> None:
    self.on = on

  def stage(self, leaves: Sequence[Any]) -> tuple[list[Any], int]:
    """``leaves`` with each device leaf replaced by its staged copy, and the
    bytes staged on the fullest device (0: nothing staged)."""
    at = [i for i, x in enumerate(leaves) if _stageable(x)] if self.on else []
    if not at:
      return list(leaves), 0
    arrays = [leaves[i] for i in at]
    try:
      copies = _copy(arrays)
    except jax.errors.JaxRuntimeError as e:
      if any(x.is_deleted() for x in arrays):
        raise  # the caller's error (a donated leaf), not staging's
      logger.warning("staging the capture in device memory failed (%s); this manager "
                     "captures from the state's buffers from now on", e)
      self.on = False
      return list(leaves), 0
    out = list(leaves)
    for i, x, y in zip(at, arrays, copies, strict=True):
      # jit may spell the same layout differently (P("d") as P("d", None))
      out[i] = y if y.sharding.is_equivalent_to(x.sharding, x.ndim) else x
    return out, shard_bytes([out[i] for i in at if out[i] is not leaves[i]])
