"""Counters and timings a SnapshotManager reports."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any


class Source(enum.Enum):
  """Where a restored state came from."""

  SNAPSHOT = "snapshot"      # a host-RAM snapshot
  PERSISTENT = "persistent"  # the Orbax tier


@dataclasses.dataclass
class SaveMetrics:
  """Cumulative save-side counters of one manager (read them any time)."""

  snapshots_started: int = 0
  snapshots_committed: int = 0
  skipped_busy: int = 0          # steps not snapshotted under BusyPolicy.SKIP
  waited_busy: int = 0           # saves that waited under BusyPolicy.WAIT
  wait_seconds: float = 0.0      # time save() spent waiting for a drain
  capture_seconds: float = 0.0   # time save() spent before returning (last)
  drain_seconds: float = 0.0     # background copy + checksum + commit (last)
  capture_seconds_total: float = 0.0
  drain_seconds_total: float = 0.0
  # host files on accelerators (SnapshotOptions.staging): the last save's
  staged_bytes: int = 0          # bytes left in device memory, copied while training runs
  copied_before_return_bytes: int = 0  # bytes over the staging budget, copied before return
  stall_seconds: float = 0.0     # time save() waited for those (part of capture_seconds)
  stall_seconds_total: float = 0.0
  bytes_snapshotted: int = 0
  persistent_saves: int = 0
  interval: int = 1              # the snapshot interval in force (``"auto"``: chosen)
  interval_reason: str = "fixed"
  first_touch_seconds: float = 0.0  # drains' time faulting fresh memory in (first use)
  ahead_seconds: float = 0.0     # host files: making the next slots between saves (off both)
  store_failures: int = 0        # saves the RAM tier failed (FailurePolicy.CONTINUE)
  last_store_failure: str = ""   # the last one's error
  watermark: int = -1            # the newest step every store held at the last agreement
  agree_seconds_total: float = 0.0  # save() agreeing on it (one small reduction a save)

  def as_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class RestoreResult:
  """What ``restore`` returns: the state and where it came from.

  Attributes:
    step: the restored step.
    state: the restored pytree, laid out like the abstract state.
    extra: the ``extra`` saved with the step.
    source: ``Source.SNAPSHOT`` or ``Source.PERSISTENT``.
    rewind_steps: newest step ever saved minus ``step``.
    newest_step: the newest step ever passed to ``save`` (-1 if unknown).
    bytes_read: bytes read per tier (``{"snapshot": n, "persistent": m}``; multi-host
      also ``"exchanged"``: state bytes moved between this host and others
      (sparse) or summed between hosts (full); ``"rebuilt"``: bytes of lost
      pieces rebuilt from parity).
    timings: seconds per phase (``scan``, ``plan``, ``read``, ``total``...);
      ``scan`` includes ``scan_persistent`` (listing the persistent tier's
      committed steps) and ``scan_exchange`` (every process's manifests,
      one exchange; multi-host); ``read``, of the step restored, includes
      ``read_verify`` (its copies read and checked; one process: the wait
      for them, while earlier leaves are put), ``read_agree`` (the hosts
      agreeing on bad copies; multi-host) and ``read_place`` (pieces moved
      between hosts or rebuilt, and the leaves built).
      ``first_touch``: of ``total``, the time spent faulting fresh host
      memory in, a first use's cost (a restore into memory kept from the
      last one, or faulted in ahead, pays none).
    notes: why fresher candidates were not used.
    exchange: how a multi-host restore agreed (``""`` for one process):
      ``"sparse"``, each host's own metadata and point-to-point moves
      (``bytes_read`` then has ``"received"`` and ``"sent"``: state bytes
      this host got from and gave to others); or ``"full: <why>"``, every
      host's manifests exchanged (a target laid out otherwise than the save).
  """

  step: int
  state: Any
  extra: Any
  source: Source
  rewind_steps: int
  newest_step: int
  bytes_read: dict[str, int]
  timings: dict[str, float]
  notes: tuple[str, ...] = ()
  exchange: str = ""

  def summary(self) -> dict[str, Any]:
    return {"step": self.step, "source": self.source.value,
            "rewind_steps": self.rewind_steps, "newest_step": self.newest_step,
            "bytes_read": dict(self.bytes_read),
            "timings": {k: round(v, 6) for k, v in self.timings.items()},
            "notes": list(self.notes), "exchange": self.exchange}
