"""MaxText and snapstore: MaxText's own loop with snapshots
(``python -m snapstore.integrations.maxtext.train``, see :mod:`.train`), and,
for loops of your own, a MaxText-style config mapping and a per-step hook.

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
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from snapstore import (
    Auto,
    AutoInterval,
    Every,
    NothingToRestoreError,
    Replicas,
    RestoreResult,
    SnapshotManager,
    SnapshotOptions,
)

from ..pathways import ElasticOptions

# MaxText key -> (snapstore field, default when the key is absent); ``store_dir``
# and ``budget_bytes`` are the fields of the store value, ``Auto(dir=, budget_bytes=)``.
SNAPSHOT_KEYS = {
    "snapshot_interval": ("interval", 1),
    "snapshot_keep": ("keep", 2),
    "snapshot_replicas": ("replicas", 1),
    "snapshot_store_dir": ("store_dir", "/dev/shm/snapstore"),
    "snapshot_budget_bytes": ("budget_bytes", None),
    "run_name": ("run_id", "default"),
    "checkpoint_period": ("persistent_interval", 0),
}
# The keys of ``python -m snapstore.integrations.maxtext.train`` (command line
# or yml): MaxText key -> SnapshotOptions field (``store_dir``, ``budget_bytes``: the
# store value's, ``store=Auto(dir=, budget_bytes=)``). ``snapshot_interval=0``: off.
TRAIN_KEYS = {
    "snapshot_interval": "interval",
    "snapshot_keep": "keep",
    "snapshot_replicas": "replicas",
    "snapshot_replica_interval": "replica_interval",
    "snapshot_hosts_per_domain": "hosts_per_domain",
    "snapshot_store_dir": "store_dir",
    "snapshot_budget_bytes": "budget_bytes",
    "snapshot_host_mtbf_s": "host_mtbf_s",
}


class MaxTextConfigError(ValueError):
  """A ``snapshot_*`` key snapstore does not know, or a bad value; names the key."""


def typed(fields: Mapping[str, Any]) -> dict[str, Any]:
  """MaxText's flat values as :class:`SnapshotOptions` fields: ``interval``
  an int (:class:`Every`) or ``"auto"`` with ``host_mtbf_s``
  (:class:`AutoInterval`), ``replicas`` an int (:class:`Replicas`),
  ``store_dir`` and ``budget_bytes`` the store's (:class:`Auto`: pinned
  host per slice on Pathways' elastic path, host files otherwise)."""
  out = dict(fields)
  store = {k: out.pop(f) for f, k in (("store_dir", "dir"), ("budget_bytes", "budget_bytes"))
           if f in out}
  if store:
    out["store"] = Auto(**store)
  mtbf = out.pop("host_mtbf_s", None)
  if "interval" in out:
    v = out["interval"]
    if v == "auto":
      if mtbf is None:
        raise ValueError("snapshot_interval=auto needs snapshot_host_mtbf_s: one host's "
                         "mean time between failures in seconds")
      out["interval"] = AutoInterval(mtbf)
    elif type(v) is int:
      out["interval"] = Every(v)
    else:
      raise ValueError(f"an int or 'auto', got {v!r}")
  elif mtbf is not None:
    AutoInterval(mtbf)  # (checked alone: the error names the key)
  if "replicas" in out:
    out["redundancy"] = Replicas(out.pop("replicas"))
  return out


def split_snapshot_keys(args: Sequence[str]) -> tuple[list[str], dict[str, Any]]:
  """(MaxText's ``key=value`` arguments, snapstore's ``snapshot_*`` ones with
  YAML-parsed values, as MaxText parses its own)."""
  import yaml  # MaxText's dependency
  rest, ours = [], {}
  for a in args:
    key, eq, value = a.partition("=")
    if key.startswith("snapshot_"):
      if not eq:
        raise MaxTextConfigError(f"{a!r}: expected {key}=<value>")
      try:
        ours[key] = yaml.safe_load(value)
      except yaml.YAMLError as e:
        raise MaxTextConfigError(f"{key}={value!r}: not a YAML value ({e})") from e
    else:
      rest.append(a)
  return rest, ours


def snapshot_options(config: Mapping[str, Any]) -> SnapshotOptions | None:
  """The options of the ``snapshot_*`` keys in ``config`` (``run_name`` names
  the run), or None with ``snapshot_interval=0``. Raises
  :class:`MaxTextConfigError` naming the first unknown key or bad value."""
  fields: dict[str, Any] = {}
  for key, value in config.items():
    if key == "run_name":
      fields["run_id"] = str(value)
      continue
    if key not in TRAIN_KEYS:
      raise MaxTextConfigError(f"unknown snapstore key {key!r}; known: "
                               f"{', '.join(sorted(TRAIN_KEYS))}")
    fields[TRAIN_KEYS[key]] = value
  off = fields.get("interval", 1) == 0
  names = {**{f: k for k, f in TRAIN_KEYS.items()}, "run_id": "run_name"}
  for field in fields:  # one key at a time (off or not), so the error names it
    if field == "interval" and off:
      continue
    try:
      SnapshotOptions(**typed({field: fields[field]}
                              | ({"host_mtbf_s": 1.0} if field == "interval" else {})))
    except (TypeError, ValueError) as e:
      key = names[field]
      raise MaxTextConfigError(f"{key}={config[key]!r}: {e}") from e
  if off:
    return None
  try:
    return SnapshotOptions(**typed(fields))
  except (TypeError, ValueError) as e:
    raise MaxTextConfigError(f"snapstore keys {dict(config)}: {e}") from e


ELASTIC_KEYS = ("elastic_enabled", "elastic_timeout_seconds", "elastic_max_retries",
                "elastic_min_slice_count")


def _get(config: Any, key: str, default: Any) -> Any:
  if isinstance(config, Mapping):
    return config.get(key, default)
  return getattr(config, key, default)


def options_from_config(config: Any) -> tuple[SnapshotOptions, ElasticOptions, str | None]:
  """(snapshot options, elastic options, persistent directory) from a
  MaxText-style config. The persistent directory is
  ``<base_output_directory>/<run_name>/checkpoints`` when
  ``enable_checkpointing`` is on, as MaxText lays it out."""
  snap = SnapshotOptions(**typed({field: _get(config, key, default)
                                  for key, (field, default) in SNAPSHOT_KEYS.items()}))
  defaults = ElasticOptions()
  elastic = ElasticOptions(snapshots=snap, **{k: _get(config, k, getattr(defaults, k))
                                              for k in ELASTIC_KEYS})
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
      result = self.manager.restore(abstract_state)
    except NothingToRestoreError:
      return init(), 0
    self.last_restore = dataclasses.replace(result, state=None)  # not a second state
    return result.state, result.step + 1

  def on_step(self, step: int, state: Any, *, extra: Any = None) -> bool:
    """After the train step of ``step``: a snapshot (and, on its period, an
    Orbax checkpoint). Returns whether a snapshot started."""
    return self.manager.save(step, state, extra=extra)

  def close(self) -> None:
    self.manager.close()
