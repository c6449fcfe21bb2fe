"""The persistent tier: an Orbax ``CheckpointManager`` at any Orbax path.

The state is saved flat: one array per non-scalar leaf under a stable name
(``l00012``), typed keys as their ``key_data``, plus a small JSON item with the
leaf specs, the scalar leaves and ``extra`` (msgpack, base64). Only steps that
Orbax committed (its finalization marker) are listed.
"""

from __future__ import annotations

import base64
import dataclasses
import logging
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax
import msgpack
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from . import _devices, errors
from ._tree import LeafKind, LeafSpec, spec_from_row, spec_row, target_sharding

if TYPE_CHECKING:
  from .recovery import OrbaxBarrier

logger = logging.getLogger(__name__)

STATE, META = "state", "snapstore"


def _name(i: int) -> str:
  return f"l{i:05d}"


class OrbaxTier:
  """Periodic Orbax checkpoints beside the snapshots.

  Args:
    manager: an ``orbax.checkpoint.CheckpointManager`` (async recommended), or
      a path (local directory or ``gs://...``) for which one is created with
      async saving and ``max_to_keep``.

  ``save`` and ``restore`` are collective in a multi-process job: every
  process calls them with the same step. In a recoverable job
  (:mod:`snapstore.recovery`) the manager made from a path commits through
  :mod:`snapstore.recovery.orbax_barrier`: a save that a replaced process took part in is
  abandoned, never committed, and the job goes on; while the job runs
  without some processes (``InPlace`` with ``min_hosts``) the manager's
  active processes are the members, and it saves and restores without the
  others (a manager passed in keeps its own barrier and processes: see
  ``docs/in-place.md``).
  """

  def __init__(self, manager: ocp.CheckpointManager | str | os.PathLike[str], *,
               max_to_keep: int = 3):
    self._path: str | None = None
    self._barrier: OrbaxBarrier | None = None
    self._max_to_keep = max_to_keep
    if not isinstance(manager, ocp.CheckpointManager):
      # Every process creates the directory itself, and no root metadata is
      # written: Orbax synchronizes all processes for each, which a
      # replacement joining a running job (in-place recovery) cannot do alone.
      epath.Path(manager).mkdir(parents=True, exist_ok=True)
      self._path = str(manager)
      manager = self._make()
    self._manager = manager
    self.bytes_read = 0

  def _make(self) -> ocp.CheckpointManager:
    assert self._path is not None
    options: dict[str, Any] = dict(max_to_keep=self._max_to_keep,
                                   enable_async_checkpointing=True, create=False)
    if "save_root_metadata" in {f.name for f in dataclasses.fields(
        ocp.CheckpointManagerOptions)}:
      options["save_root_metadata"] = False
    if jax.process_count() > 1 and getattr(jax.config, "jax_enable_recoverability", False):
      from .recovery import OrbaxBarrier  # (a recoverable job: loaded; else never needed)
      self._barrier = OrbaxBarrier()
      options["async_options"] = ocp.AsyncOptions(barrier_sync_fn=self._barrier)
      members = _devices.processes()
      if members is not None:  # the job runs without some processes: they sit out
        options["multiprocessing_options"] = ocp.options.MultiprocessingOptions(
            primary_host=members[0], active_processes=set(members),
            barrier_sync_key_prefix=f"members-{_devices.membership()}")
    return ocp.CheckpointManager(self._path, options=ocp.CheckpointManagerOptions(**options))

  @property
  def manager(self) -> ocp.CheckpointManager:
    """The Orbax manager, after a membership change a new one (see
    :mod:`snapstore.recovery.orbax_barrier`): the old one's save in flight is abandoned, its
    error logged, never committed."""
    if self._barrier is not None and self._barrier.stale():
      old, self._barrier = self._manager, None
      try:
        old.wait_until_finished()
      except Exception as e:  # noqa: BLE001  (Abandoned, or Orbax's wrapper of it)
        logger.warning("the Orbax save in flight when a process was replaced is abandoned, "
                       "not committed: %s", e)
      self._manager = self._make()
    return self._manager

  @property
  def directory(self) -> str:
    return str(self.manager.directory)

  def save(self, step: int, specs: Sequence[LeafSpec], leaves: Sequence[Any],
           extra: Any) -> None:
    arrays: dict[str, jax.Array | np.ndarray] = {}
    scalars: dict[str, Any] = {}
    for i, (spec, leaf) in enumerate(zip(specs, leaves, strict=True)):
      if spec.kind is LeafKind.SCALAR:
        scalars[str(i)] = leaf
      elif spec.kind is LeafKind.KEY:
        arrays[_name(i)] = jax.random.key_data(leaf)
      elif spec.kind is LeafKind.NUMPY:
        arrays[_name(i)] = np.array(leaf, copy=True)
      else:
        arrays[_name(i)] = leaf
    meta = {
        "leaves": [spec_row(s) for s in specs],
        "scalars": scalars,
        "extra": base64.b64encode(msgpack.packb(extra, use_bin_type=True)).decode(),
    }
    self.manager.save(step, args=ocp.args.Composite(**{
        STATE: ocp.args.StandardSave(arrays), META: ocp.args.JsonSave(meta)}))

  def committed_steps(self) -> list[int]:
    """Steps whose Orbax checkpoint is committed, as stored now."""
    self.manager.reload()
    return sorted(self.manager.all_steps())

  def latest_step(self) -> int | None:
    steps = self.committed_steps()
    return steps[-1] if steps else None

  def restore(self, step: int, specs: Sequence[LeafSpec],
              targets: Sequence[Any]) -> tuple[list[Any], Any]:
    """Restores ``step`` into leaves laid out like ``targets``.

    Returns (leaves, extra). ``specs`` are the abstract state's specs; the
    check against what was saved is the caller's (it raises TreeMismatchError).
    """
    if step not in self.committed_steps():
      raise errors.StepNotFoundError(
          f"step {step} has no committed Orbax checkpoint in {self.directory}")
    meta = self.manager.restore(step, args=ocp.args.Composite(
        **{META: ocp.args.JsonRestore()}))[META]
    abstract: dict[str, np.ndarray | jax.ShapeDtypeStruct] = {}
    for i, (spec, target) in enumerate(zip(specs, targets, strict=True)):
      if spec.kind is LeafKind.SCALAR:
        continue
      if spec.kind is LeafKind.NUMPY:
        abstract[_name(i)] = np.zeros(spec.shape, spec.np_dtype)
      else:
        abstract[_name(i)] = jax.ShapeDtypeStruct(
            spec.shape, spec.np_dtype, sharding=target_sharding(target))
    arrays = self.manager.restore(step, args=ocp.args.Composite(
        **{STATE: ocp.args.StandardRestore(abstract)}))[STATE]
    out = []
    for i, spec in enumerate(specs):
      if spec.kind is LeafKind.SCALAR:
        out.append(meta["scalars"][str(i)])
        continue
      a = arrays[_name(i)]
      self.bytes_read += spec.nbytes
      if spec.kind is LeafKind.KEY:
        a = jax.random.wrap_key_data(a, impl=spec.key_impl)
      elif spec.kind is LeafKind.NUMPY:
        a = np.asarray(a)
      out.append(a)
    extra = msgpack.unpackb(base64.b64decode(meta["extra"]), raw=False,
                            strict_map_key=False)
    return out, extra

  def saved_specs(self, step: int) -> list[LeafSpec]:
    meta = self.manager.restore(step, args=ocp.args.Composite(
        **{META: ocp.args.JsonRestore()}))[META]
    return [spec_from_row(row) for row in meta["leaves"]]

  def wait_until_finished(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.close()

