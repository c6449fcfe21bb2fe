"""MaxText-style configuration -> snapstore, and a per-step train-loop hook.

MaxText configures elasticity and checkpointing with flat keys
(``elastic_enabled``, ``elastic_timeout_seconds``, ``elastic_max_retries``,
``elastic_min_slice_count``, ``checkpoint_period``, ``base_output_directory``,
...). :func:`options_from_config` maps such a mapping (a dict, or any object
with those attributes, like MaxText's ``pyconfig``) to snapstore's options;
:class:`SnapshotHook` is the one call a MaxText-like loop makes per step::

    hook = SnapshotHook.from_config(config)
    state, start = hook.restore_or(init_state, abstract_state)
    for step in range(start, config.steps):
      state, metrics = train_step(state, batch)
      hook.on_step(step, state)
    hook.close()
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from snapstore import NothingToRestoreError, RestoreResult, SnapshotManager, SnapshotOptions

from .pathways import ElasticOptions

# MaxText key -> (snapstore field, default when the key is absent)
SNAPSHOT_KEYS = {
    "snapshot_interval": ("interval", 1),
    "snapshot_keep": ("keep", 2),
    "snapshot_replicas": ("replicas", 1),
    "snapshot_store_dir": ("store_dir", "/dev/shm/snapstore"),
    "snapshot_budget_bytes": ("budget_bytes", None),
    "run_name": ("run_id", "default"),
    "checkpoint_period": ("persistent_interval", 0),
}
ELASTIC_KEYS = ("elastic_enabled", "elastic_timeout_seconds", "elastic_max_retries",
                "elastic_min_slice_count", "snapshot_interval", "snapshot_replicas",
                "snapshot_keep")


def _get(config: Any, key: str, default: Any) -> Any:
  if isinstance(config, Mapping):
    return config.get(key, default)
  return getattr(config, key, default)


def options_from_config(config: Any) -> tuple[SnapshotOptions, ElasticOptions, str | None]:
  """(snapshot options, elastic options, persistent directory) from a
  MaxText-style config. The persistent directory is
  ``<base_output_directory>/<run_name>/checkpoints`` when
  ``enable_checkpointing`` is on, as MaxText lays it out."""
  snap = SnapshotOptions(**{field: _get(config, key, default)
                            for key, (field, default) in SNAPSHOT_KEYS.items()})
  defaults = ElasticOptions()
  elastic = ElasticOptions(**{k: _get(config, k, getattr(defaults, k)) for k in ELASTIC_KEYS})
  persistent = None
  base = _get(config, "base_output_directory", None)
  if _get(config, "enable_checkpointing", False) and base:
    persistent = f"{str(base).rstrip('/')}/{snap.run_id}/checkpoints"
  return snap, elastic, persistent


@dataclasses.dataclass
class SnapshotHook:
  """The per-step call of a MaxText-like loop."""

  manager: SnapshotManager
  last_restore: RestoreResult | None = None

  @classmethod
  def from_config(cls, config: Any, **manager_kwargs: Any) -> SnapshotHook:
    snap, _, persistent = options_from_config(config)
    return cls(SnapshotManager(snap, persistent=persistent, **manager_kwargs))

  def restore_or(self, init: Callable[[], Any], abstract_state: Any) -> tuple[Any, int]:
    """(state, first step to run): the freshest snapshot or checkpoint, else
    ``init()`` from step 0."""
    try:
      self.last_restore = self.manager.restore(abstract_state)
    except NothingToRestoreError:
      return init(), 0
    return self.last_restore.state, self.last_restore.step + 1

  def on_step(self, step: int, state: Any, *, extra: Any = None) -> bool:
    """After the train step of ``step``: a snapshot (and, on its period, an
    Orbax checkpoint). Returns whether a snapshot started."""
    return self.manager.save(step, state, extra=extra)

  def close(self) -> None:
    self.manager.close()
