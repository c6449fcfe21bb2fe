"""Pathways (single controller): snapstore behind pathwaysutils' elastic
retry, and a drop-in for Orbax v1's ``Snapshotter``.

On Pathways one Python controller survives worker failures; the next JAX op
on a lost slice raises ``JaxRuntimeError`` (``DATA_LOSS``, or
``DEADLINE_EXCEEDED`` after missed heartbeats) and
``pathwaysutils.elastic.manager.Manager.elastic_retry`` retries the wrapped
function. Here the controller keeps one snapshot store per slice (failure
domain): a slice's pieces, plus a copy of every piece that has no
data-parallel twin in another slice. When a slice is lost, its store is
dropped (its hosts' memory is gone) and the retry restores the freshest step
that the surviving stores still cover — onto all slices again (pause-resume)
or onto the surviving ones (replica-resize) — else the newest Orbax step.

:class:`ElasticTrainer` wires that up; :class:`Snapshotter` has the
constructor keywords and methods of
``orbax.checkpoint.experimental.v1.training.pathways.Snapshotter`` so code
written for it switches by one argument.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

from snapstore import (
    NothingToRestoreError,
    OrbaxTier,
    RestoreResult,
    SnapshotManager,
    SnapshotOptions,
)

logger = logging.getLogger(__name__)

Slices = Mapping[int, Sequence[jax.Device]]

#: pathwaysutils 0.1.5-0.1.11 delete every live jax.Array on each elastic
#: event, the pinned_host snapshots included.
MIN_PATHWAYSUTILS = "0.1.13"


def check_pathwaysutils() -> str:
  """The installed pathwaysutils' version; raises RuntimeError if it is one
  that deletes the snapshots on an elastic event."""
  from importlib.metadata import version as installed

  from packaging.version import Version
  found = installed("pathwaysutils")
  if Version(found) < Version(MIN_PATHWAYSUTILS):
    raise RuntimeError(
        f"pathwaysutils {found} deletes every live jax.Array on each elastic event, the "
        f"snapshots in pinned host memory included; snapstore needs pathwaysutils >= "
        f"{MIN_PATHWAYSUTILS} (pip install -U pathwaysutils)")
  return found


def slices_of(devices: Sequence[jax.Device]) -> dict[int, list[jax.Device]]:
  """slice index -> devices, from ``device.slice_index`` (one slice if absent)."""
  out: dict[int, list[jax.Device]] = {}
  for d in devices:
    out.setdefault(int(getattr(d, "slice_index", 0) or 0), []).append(d)
  return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class ElasticOptions:
  """MaxText's elastic flags, plus the snapshots' own options.

  ``elastic_min_slice_count``: -1 waits for all slices (pause-resume); a
  smaller count continues on the slices that are up (replica-resize).
  ``snapshots``: every :class:`SnapshotOptions` choice (interval, redundancy,
  budget, busy policy, store directory, run id, Orbax interval) for the
  per-slice stores.
  """

  elastic_enabled: bool = True
  elastic_timeout_seconds: float | None = 300.0
  elastic_max_retries: int = 3
  elastic_min_slice_count: int = -1
  elastic_poll_seconds: float = 10.0
  snapshots: SnapshotOptions = dataclasses.field(default_factory=SnapshotOptions)

  def __post_init__(self) -> None:
    if self.elastic_max_retries < 0:
      raise ValueError("elastic_max_retries must be >= 0")
    if self.elastic_min_slice_count == 0 or self.elastic_min_slice_count < -1:
      raise ValueError("elastic_min_slice_count is -1 (all slices) or >= 1")
    if not isinstance(self.snapshots, SnapshotOptions):
      raise TypeError(f"snapshots must be a SnapshotOptions, got {self.snapshots!r}")


@dataclasses.dataclass(frozen=True)
class ElasticEvent:
  """One attempt after a slice loss: what was lost and what was restored."""

  attempt: int
  lost_slices: tuple[int, ...]
  active_slices: tuple[int, ...]
  restored_step: int | None
  source: str | None
  rewind_steps: int | None
  notes: tuple[str, ...]
  bytes_read: dict[str, int] = dataclasses.field(default_factory=dict)


class ElasticTrainer:
  """Runs a training loop under ``Manager.elastic_retry``, restoring from
  host-RAM snapshots (or Orbax) on every attempt.

  Args:
    elastic: a ``pathwaysutils.elastic.manager.Manager``.
    options: :class:`ElasticOptions`; its ``snapshots`` say where the
      per-slice stores live and how often Orbax saves
      (``persistent_interval``).
    persistent: the Orbax tier (path, ``gs://``, or :class:`OrbaxTier`).

  ``run(loop, abstract_state)``: each attempt builds the abstract state for
  the active slices' devices, restores the freshest recoverable step (None on
  a fresh start) and calls ``loop(restored, devices)``; the loop trains and
  calls ``trainer.snapshots.save(step, state)`` each step.
  """

  def __init__(self, elastic: Any, *, options: ElasticOptions | None = None,
               persistent: OrbaxTier | str | os.PathLike[str] | None = None):
    check_pathwaysutils()
    self.elastic = elastic
    self.options = options or ElasticOptions()
    self.snapshots = SnapshotManager(self.options.snapshots, persistent=persistent,
                                     slices=elastic.slice_to_devices)
    self.events: list[ElasticEvent] = []
    self._attempt = 0
    self._lost: tuple[int, ...] = ()

  def active_devices(self) -> list[jax.Device]:
    return [d for s in sorted(self.elastic.active_slice_indices)
            for d in self.elastic.slice_to_devices[s]]

  def _on_elastic_event(self) -> None:
    from pathwaysutils.elastic import elastic as pw_elastic
    up = pw_elastic.get_active_slice_indices(self.elastic.slice_to_devices)
    self._lost = tuple(sorted(set(self.elastic.all_slice_indices) - set(up)))
    # The lost slices' hosts restart: whatever they held in RAM is gone.
    self.snapshots.forget_domains(self._lost, "slice lost")

  def run(self, loop: Callable[[RestoreResult | None, list[jax.Device]], Any],
          abstract_state: Callable[[list[jax.Device]], Any]) -> Any:
    def attempt() -> Any:
      self._attempt += 1
      devices = self.active_devices()
      self.snapshots.set_active_domains(sorted(self.elastic.active_slice_indices))
      try:
        restored = self.snapshots.restore(abstract_state(devices))
      except NothingToRestoreError:
        restored = None
      if self._attempt > 1:
        event = ElasticEvent(
            self._attempt, self._lost, tuple(sorted(self.elastic.active_slice_indices)),
            restored.step if restored else None,
            restored.source.value if restored else None,
            restored.rewind_steps if restored else None,
            restored.notes if restored else (),
            dict(restored.bytes_read) if restored else {})
        self.events.append(event)
        logger.warning("elastic attempt %d: lost slices %s, restored step %s from %s "
                       "(rewind %s)", event.attempt, event.lost_slices,
                       event.restored_step, event.source, event.rewind_steps)
      return loop(restored, devices)

    if not self.options.elastic_enabled:
      return attempt()
    from pathwaysutils.elastic.manager import ElasticRetryLimit
    minimum = (None if self.options.elastic_min_slice_count == -1
               else self.options.elastic_min_slice_count)
    wrapped = self.elastic.elastic_retry(
        minimum_slice_count=minimum, poll_interval=self.options.elastic_poll_seconds,
        timeout=self.options.elastic_timeout_seconds,
        retry_policy=ElasticRetryLimit(self.options.elastic_max_retries + 1),
        on_elastic_event_callback=self._on_elastic_event)(attempt)
    return wrapped()

  def close(self) -> None:
    self.snapshots.close()


@dataclasses.dataclass(frozen=True)
class SnapshotMetadata:
  """What ``Snapshotter.latest`` returns (Orbax returns its own metadata type
  with the same ``step`` attribute)."""

  step: int


class Snapshotter:
  """Orbax v1 ``Snapshotter``'s interface, backed by snapstore.

  Same keywords and methods: ``Snapshotter(replica_axis_index=0)``,
  ``save(step, state)``, ``load(abstract_state, reset_snapshot_state=True)``,
  ``join()``, ``latest``. Unlike Orbax's: every byte is checksummed and
  verified on load; ``save`` never drops a step silently (``options.busy_policy``
  WAIT blocks, SKIP skips and counts in ``metrics.skipped_busy``); ``keep``
  snapshots are kept; pieces without a data-parallel twin get a copy in
  another slice; SingleDeviceSharding leaves, typed PRNG keys, numpy arrays
  and Python scalars round-trip; and with ``persistent`` set, ``load`` falls
  back to the newest Orbax checkpoint.

  ``replica_axis_index`` is accepted for compatibility: failure domains come
  from ``slices`` (or the devices' ``slice_index``), not from a mesh axis.
  """

  def __init__(self, *, replica_axis_index: int = 0, options: SnapshotOptions | None = None,
               persistent: OrbaxTier | str | os.PathLike[str] | None = None,
               slices: Slices | None = None):
    self.replica_axis_index = replica_axis_index
    opts = options or SnapshotOptions(keep=1, run_id="snapshotter")
    self._slices = slices if slices is not None else slices_of(jax.devices())
    self._mgr = SnapshotManager(opts, persistent=persistent, slices=self._slices)
    # where the last load came from (its ``state`` is None)
    self.last_restore: RestoreResult | None = None

  @property
  def manager(self) -> SnapshotManager:
    return self._mgr

  def save(self, step: int, state: Any) -> None:
    """Starts a snapshot of ``state`` (returns once its buffers are safe)."""
    self._mgr.save(step, state, force=True)

  def load(self, abstract_state: Any, *, reset_snapshot_state: bool = True) -> Any:
    """The freshest recoverable state, placed like ``abstract_state``.

    Raises ``RuntimeError`` (as Orbax's does) when there is nothing to load.
    ``reset_snapshot_state`` is accepted for compatibility; older snapshots
    stay until retention replaces them.
    """
    del reset_snapshot_state
    try:
      result = self._mgr.restore(abstract_state)
    except NothingToRestoreError as e:
      raise RuntimeError(f"No snapshots available to restore from: {e}") from e
    # Where it came from, without the state: holding it would keep a second
    # state in memory once the caller's steps have replaced it.
    self.last_restore = dataclasses.replace(result, state=None)
    # The slices the state now lives on are up: later snapshots use them. A
    # state on no device (loaded into numpy arrays) says nothing of them.
    devices = {d for x in jax.tree.leaves(result.state)
               if isinstance(x, jax.Array) for d in x.sharding.device_set}
    if devices:
      self._mgr.set_active_domains(sorted({k for k, devs in self._slices.items()
                                           if devices & set(devs)}))
    return result.state

  def join(self) -> None:
    """Blocks until the snapshot in flight is complete."""
    self._mgr.wait_until_finished()

  @property
  def latest(self) -> SnapshotMetadata | None:
    steps = self._mgr.snapshot_steps()
    return SnapshotMetadata(steps[-1]) if steps else None

  def close(self) -> None:
    self._mgr.close()
