"""Frozen, validated option dataclasses and the policies users swap.

A choice is a type: ``interval=Every(10)`` or ``AutoInterval(host_mtbf_s=...)``,
``redundancy=Replicas(1)`` or ``Parity(k=3)``, ``store=HostFiles(...)``,
``PinnedHost(...)`` or ``Auto()`` (:mod:`snapstore.stores`); each carries its
own parameters and checks them. Tuning knobs stay flat fields of
:class:`SnapshotOptions`.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import re
from typing import Any

from .errors import InvalidOptionError as Invalid
from .stores import Auto, HostFiles, PinnedHost

_RUN_ID_RE = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
MAX_INT = 2**48  # steps, incarnations, sizes: far beyond use, far below overflow


def _default_copy_threads() -> int:
  """Half the cores this process may run on, 2 to 32."""
  try:
    cores = len(os.sched_getaffinity(0))
  except (AttributeError, OSError):  # (not Linux)
    cores = os.cpu_count() or 2
  return max(2, min(32, cores // 2))


def _int_option(name: str, value: object, minimum: int, also: str = "") -> None:
  """Raises (naming the option) unless ``value`` is an int in [``minimum``,
  2**48] (bool and float are refused: ``interval=True`` is a mistake)."""
  if type(value) is not int or not minimum <= value <= MAX_INT:
    raise Invalid(f"{name} must be an int in [{minimum}, 2**48]{' ' + also if also else ''}, "
                  f"got {value!r}")


class BusyPolicy(enum.Enum):
  """What ``save`` does when the previous snapshot is still draining."""

  WAIT = "wait"  # block until the previous snapshot is complete, then start.
  SKIP = "skip"  # do not snapshot this step; counted in ``metrics.skipped_busy``.


class FailurePolicy(enum.Enum):
  """What ``save`` does when the RAM tier fails after a run's first
  snapshot (the store filled, the state outgrew the budget, a drain
  failed). A first save that cannot fit always raises: that is a
  misconfiguration."""

  CONTINUE = "continue"  # count it in metrics, log it once per cause, go on training
  RAISE = "raise"        # raise it into the training loop


class Staging(enum.Enum):
  """How a store whose bytes land in this process's memory (host files; the
  pinned-host store with ``PinnedMemory.PROCESS``) captures array leaves
  (``SnapshotOptions.staging``)."""

  AUTO = "auto"      # staged in device memory on accelerators; CPU leaves as views
  ALWAYS = "always"  # staged on CPU devices too (tests: the accelerator path in CI)
  NEVER = "never"    # an async device_put of every leaf to pinned_host (the old path)


@dataclasses.dataclass(frozen=True)
class Every:
  """A snapshot every ``steps`` steps (the steps with ``step % steps == 0``).

  Raises:
    InvalidOptionError: ``steps`` is not an int >= 1.
  """

  steps: int = 1

  def __post_init__(self) -> None:
    _int_option("Every.steps", self.steps, 1)


@dataclasses.dataclass(frozen=True)
class AutoInterval:
  """The Young/Daly interval, from measured snapshot costs and one host's
  mean time between failures in seconds (the job's is this divided by the
  hosts). ``mgr.metrics.interval`` and ``interval_reason`` say which and why.

  Raises:
    InvalidOptionError: ``host_mtbf_s`` is not a number > 0.
  """

  host_mtbf_s: float

  def __post_init__(self) -> None:
    if type(self.host_mtbf_s) not in (int, float) or not self.host_mtbf_s > 0:
      raise Invalid("AutoInterval needs host_mtbf_s: one host's mean time between "
                    f"failures in seconds, got {self.host_mtbf_s!r}")


@dataclasses.dataclass(frozen=True)
class Replicas:
  """``copies`` full copies of each shard without a data-parallel twin, in
  the next failure domains in ring order (0: none, RAM-only).

  Raises:
    InvalidOptionError: ``copies`` is not an int >= 0.
  """

  copies: int = 1

  def __post_init__(self) -> None:
    _int_option("Replicas.copies", self.copies, 0)


@dataclasses.dataclass(frozen=True)
class Parity:
  """The failure domains form groups of ``k + 1`` in ring order, and each
  keeps one parity block (``1 / k`` of its bytes) of the others' shards:
  losing one domain of a group is recoverable for ``1 + 1/k`` of the state
  in RAM instead of ``2x`` (multi-host; ``snapstore capacity`` shows both).

  Raises:
    InvalidOptionError: ``k`` is not an int in [1, 1023].
  """

  k: int = 3

  def __post_init__(self) -> None:
    _int_option("Parity.k", self.k, 1)
    if self.k > 1023:
      raise Invalid(f"Parity.k must be at most 1023, got {self.k}")


Interval = Every | AutoInterval
Redundancy = Replicas | Parity


@dataclasses.dataclass(frozen=True, kw_only=True)
class SnapshotOptions:
  """How often, how many and where snapshots are kept.

  Attributes:
    interval: when to snapshot: :class:`Every` (``Every(1)``: every step) or
      :class:`AutoInterval`.
    keep: newest complete snapshots kept in the host store; between saves it
      also holds the job's retention watermark, the step every store held
      (two snapshots back with ``keep >= 2`` and no ``budget_bytes``), in the
      slot the next one takes.
    run_id: names the run; a store of another run is never restored.
    persistent_interval: save to the persistent tier every this many steps
      (``0`` disables periodic persistent saves).
    busy_policy: what ``save`` does when the previous snapshot still drains.
    failure_policy: what ``save`` does when the RAM tier fails later in a
      run (``FailurePolicy.CONTINUE``: training and the persistent tier go
      on; the last complete snapshot stays restorable).
    copy_threads: worker threads that copy and checksum shards (default:
      half the cores this process may run on, 2 to 32: an accelerator's
      link fills several; ``docs/benchmarks.md``, "On a TPU v5e").
    chunk_bytes: unit of copy and checksum.
    redundancy: how each shard is protected in another failure domain:
      :class:`Replicas` (``Replicas(1)``: one full copy) or :class:`Parity`.
    replica_interval: the replicas (or parity) travel with every
      this-many-th snapshot (1: every one): the snapshot of step ``s``
      carries them when ``(s // interval) % replica_interval == 0``
      (``AutoInterval``: when ``s % replica_interval == 0``), the same on
      every process (a replacement healed in place too;
      :meth:`carries_replicas`). In between, a store keeps only its own
      pieces, so losing a domain rewinds to the newest snapshot whose
      replicas travelled (the restore picks it and reports the rewind). For
      jobs where the transfer costs more of a step than it should.
    hosts_per_domain: hosts that fail together; when set, it overrides
      ``device.slice_index`` (``None``: ``slice_index``, else one domain per
      host).
    store: where snapshots live, with their directory and byte budget: a
      store value (:mod:`snapstore.stores`): ``HostFiles(dir=...,
      budget_bytes=...)``, ``PinnedHost(checksum=..., budget_bytes=...)``,
      ``Auto()`` (the pinned-host store on a single controller given
      ``slices=`` whose devices have pinned host memory, host files
      otherwise), or any value whose ``build(...)`` returns a backend
      (:class:`snapstore.StoreSpec`).
    drain_switch_interval_s: while a snapshot drains on its background
      thread, the interpreter's thread switch interval
      (``sys.setswitchinterval``) is lowered to this many seconds, so the
      drain's Python holds up the training loop for at most that long at a
      time (CPython's default is 5 ms); the previous value is put back when
      no drain runs. ``None``: left alone.
    pause_gc: Python's cyclic garbage collector is paused while a snapshot
      is captured and drained, and while a restore reads one
      (``_switch.collections_paused``): the thousands of short-lived views a
      save of many leaves makes would otherwise bring full collections every
      few saves, and a restore's objects one every few restores (slow in a
      JAX process, which holds many objects). ``False``: left alone.
    prefault_restore: once the store holds a snapshot (at start, or after
      the first one commits), a background thread faults in the host memory
      a restore of it copies into, and it stays in place while idle, so a
      recovery pays neither page faults nor the kernel's re-dirtying of
      freed pages (``python -m benchmarks.capture`` reports the first
      restore in a process: ``restore_first_s``). It costs this process's
      own share of the state in resident memory. ``False``: memory is taken
      when a restore needs it, and an idle one is handed to the kernel as
      free-when-needed (``MADV_FREE``).
    staging: how host files, and the pinned-host store in this process's
      memory (``PinnedMemory.PROCESS``), capture array leaves
      (:class:`Staging`). ``AUTO``: on accelerators, each shard is copied
      in device memory and cut into pieces of about
      ``staging_piece_bytes`` (one jitted program a device), whose copies
      to host memory run while training goes on, so the next step may
      donate the state as soon as ``save`` returns; on CPU devices, a
      zero-copy view of each shard. ``ALWAYS`` stages CPU leaves too
      (what the tests use to run the accelerator path on CPU devices).
      ``NEVER``: an async ``device_put`` to ``pinned_host``, slow on a
      TPU (~1 GB/s on a v5e). The pinned-host store on the slices' own
      hosts (``PinnedMemory.SLICE_HOSTS``) ignores it.
    staging_budget_bytes: device memory per device that a save may leave
      staged for its drain. ``None``: the device's free memory at its
      peak (``memory_stats()``: ``bytes_limit`` less the peak use of
      everything but the staging), less a headroom of 5% of the limit
      (at least 256 MiB); on devices that report no memory (CPU), no
      limit. An int caps that (``0``: nothing is staged). What does not
      fit is copied to host memory before ``save`` returns, in batches of
      half the budget (``metrics.copied_before_return_bytes``,
      ``metrics.stall_seconds``); below two pieces of budget the shards
      are copied whole, without staging.
    staging_piece_bytes: the size of a staged piece, the unit of a copy
      from device to host memory (4 MiB: on a TPU v5e host files saved
      1 GiB at 11.1 GB/s with it, at 2.7 GB/s with 16 MiB). Pieces never
      straddle a ``chunk_bytes`` chunk.
    incarnation: this job's incarnation (restart count); ``None`` takes
      ``$SNAPSTORE_INCARNATION`` (set by ``snapstore launch``), else one more
      than the newest in the stores (agreed across hosts).

  Raises:
    InvalidOptionError: a value of the wrong type or out of range, naming
      the option.
  """

  interval: Interval = Every(1)
  keep: int = 2
  run_id: str = "default"
  persistent_interval: int = 0
  busy_policy: BusyPolicy = BusyPolicy.WAIT
  failure_policy: FailurePolicy = FailurePolicy.CONTINUE
  copy_threads: int = dataclasses.field(default_factory=_default_copy_threads)
  chunk_bytes: int = 16 << 20
  redundancy: Redundancy = Replicas(1)
  replica_interval: int = 1
  hosts_per_domain: int | None = None
  incarnation: int | None = None
  store: Any = Auto()  # HostFiles | PinnedHost | Auto | a StoreSpec of one's own
  drain_switch_interval_s: float | None = 0.0005
  pause_gc: bool = True
  prefault_restore: bool = True
  staging: Staging = Staging.AUTO
  staging_budget_bytes: int | None = None
  staging_piece_bytes: int = 4 << 20

  def __post_init__(self) -> None:
    if not isinstance(self.interval, (Every, AutoInterval)):
      raise Invalid(f"interval must be Every(steps) or AutoInterval(host_mtbf_s=...), "
                    f"got {self.interval!r}")
    if not isinstance(self.redundancy, (Replicas, Parity)):
      raise Invalid(f"redundancy must be Replicas(copies) or Parity(k), "
                    f"got {self.redundancy!r}")
    _int_option("keep", self.keep, 1)
    _int_option("copy_threads", self.copy_threads, 1)
    _int_option("chunk_bytes", self.chunk_bytes, 4096)
    if self.chunk_bytes > 1 << 30:
      raise Invalid(f"chunk_bytes must be at most 1 GiB, got {self.chunk_bytes}")
    if self.chunk_bytes % 4096:
      raise Invalid(
                    f"chunk_bytes must be a positive multiple of 4096, got {self.chunk_bytes}")
    _int_option("persistent_interval", self.persistent_interval, 0, "(0 disables)")
    _int_option("replica_interval", self.replica_interval, 1)
    if self.hosts_per_domain is not None:
      _int_option("hosts_per_domain", self.hosts_per_domain, 1, "or None")
    for name in ("pause_gc", "prefault_restore"):
      if type(getattr(self, name)) is not bool:
        raise Invalid(f"{name} must be True or False, got {getattr(self, name)!r}")
    if self.drain_switch_interval_s is not None and not (
        type(self.drain_switch_interval_s) in (int, float)
        and 0 < self.drain_switch_interval_s <= 1):
      raise Invalid("drain_switch_interval_s must be seconds in (0, 1] or None, got "
                    f"{self.drain_switch_interval_s!r}")
    if self.incarnation is not None:
      _int_option("incarnation", self.incarnation, 0, "or None")
    if not isinstance(self.busy_policy, BusyPolicy):
      raise Invalid(f"busy_policy must be a BusyPolicy, got {self.busy_policy!r}")
    if not isinstance(self.failure_policy, FailurePolicy):
      raise Invalid(f"failure_policy must be a FailurePolicy, got {self.failure_policy!r}")
    if not isinstance(self.staging, Staging):
      raise Invalid(f"staging must be a Staging, got {self.staging!r}")
    if self.staging_budget_bytes is not None:
      _int_option("staging_budget_bytes", self.staging_budget_bytes, 0, "or None")
    _int_option("staging_piece_bytes", self.staging_piece_bytes, 4096)
    if self.staging_piece_bytes > 1 << 30:
      raise Invalid(
                    f"staging_piece_bytes must be at most 1 GiB, got {self.staging_piece_bytes}")
    if not isinstance(self.store, (HostFiles, PinnedHost, Auto)) and not callable(
        getattr(self.store, "build", None)):
      raise Invalid("store must be a store value with a build(...) method: HostFiles(...), "
                    f"PinnedHost(...), Auto() or a StoreSpec of your own, got {self.store!r}")
    if not isinstance(self.run_id, str) or not _RUN_ID_RE.match(self.run_id) or \
        self.run_id in (".", ".."):
      raise Invalid(
                    f"run_id must be one path component matching {_RUN_ID_RE.pattern}, not "
                    f"'.' or '..' (it names a directory), got {self.run_id!r}")

  def should_persist(self, step: int) -> bool:
    return self.persistent_interval > 0 and step % self.persistent_interval == 0

  def carries_replicas(self, step: int) -> bool:
    """Whether the snapshot of ``step`` carries the replicas (or parity):
    from the step and the options only, so every process, and every store's
    retention, agrees (a count of one process's snapshots would not)."""
    every = self.interval.steps if isinstance(self.interval, Every) else 1
    return (step // every) % self.replica_interval == 0

  @property
  def copies(self) -> int:
    """Copies of a shard that travel to other domains: a replica's, or the
    one parity block's source pieces (parity rides the ring once)."""
    return 1 if isinstance(self.redundancy, Parity) else self.redundancy.copies

  @property
  def parity_k(self) -> int | None:
    """``k`` under :class:`Parity`, else None."""
    return self.redundancy.k if isinstance(self.redundancy, Parity) else None
