"""Frozen, validated option dataclasses and the policies users swap."""

from __future__ import annotations

import dataclasses
import enum
import os
import re

_RUN_ID_RE = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
DEFAULT_STORE_DIR = "/dev/shm/snapstore"


class BusyPolicy(enum.Enum):
  """What ``save`` does when the previous snapshot is still draining."""

  WAIT = "wait"  # block until the previous snapshot is complete, then start.
  SKIP = "skip"  # do not snapshot this step; counted in ``metrics.skipped``.


class FailurePolicy(enum.Enum):
  """What ``save`` does when the RAM tier fails after a run's first
  snapshot (the store filled, the state outgrew the budget, a drain
  failed). A first save that cannot fit always raises: that is a
  misconfiguration."""

  CONTINUE = "continue"  # count it in metrics, log it once per cause, go on training
  RAISE = "raise"        # raise it into the training loop


class StoreKind(enum.Enum):
  """Where snapshots live."""

  AUTO = "auto"                # PINNED_HOST for a single controller with slices=
                               # whose devices have pinned_host memory, else HOST_FILES
  HOST_FILES = "host_files"    # files on a RAM disk, written by each process
  PINNED_HOST = "pinned_host"  # pinned_host jax.Arrays on each slice's hosts


@dataclasses.dataclass(frozen=True, kw_only=True)
class SnapshotOptions:
  """How often, how many and where snapshots are kept.

  Attributes:
    interval: take a snapshot every ``interval`` steps (``step % interval == 0``),
      or ``"auto"``: the Young/Daly interval from measured snapshot costs and
      ``host_mtbf_s`` (``mgr.metrics.interval`` and ``interval_reason`` say
      which and why).
    host_mtbf_s: with ``interval="auto"``: one host's mean time between
      failures in seconds (the job's is this divided by the hosts).
    keep: newest complete snapshots kept in the host store.
    budget_bytes: byte budget of this host's store, or of each slice's
      pinned-host store (``None``: no budget beyond the free space of
      ``store_dir``, or of the hosts' memory). One snapshot being written plus the
      newest complete one must fit, so the budget must hold two snapshots.
    store_dir: a directory on a RAM-backed filesystem; the store of this run
      lives in ``<store_dir>/<run_id>/host-<process index>/``.
    run_id: names the run; a store of another run is never restored.
    persistent_interval: save to the persistent tier every this many steps
      (``0`` disables periodic persistent saves).
    busy_policy: what ``save`` does when the previous snapshot still drains.
    failure_policy: what ``save`` does when the RAM tier fails later in a
      run (``FailurePolicy.CONTINUE``: training and the persistent tier go
      on; the last complete snapshot stays restorable).
    copy_threads: worker threads that copy and checksum shards.
    chunk_bytes: unit of copy and checksum.
    replicas: copies of each shard kept in other failure domains (multi-host),
      with ``redundancy="replica"``.
    redundancy: ``"replica"`` (``replicas`` full copies of a shard without a
      data-parallel twin, in the next domains) or ``"parity"``: the domains
      form groups of ``parity_k + 1`` in ring order and each keeps one parity
      block (``1 / parity_k`` of its bytes) of the others' shards, so losing
      one domain of a group is recoverable for ``1 + 1/k`` of the state in RAM
      instead of ``2x`` (multi-host; ``snapstore plan`` shows both).
    parity_k: with ``redundancy="parity"``: the data domains per parity block.
    replica_interval: the replicas (or parity) travel with every
      this-many-th snapshot (1: every one): the snapshot of step ``s``
      carries them when ``(s // interval) % replica_interval == 0``
      (``interval="auto"``: when ``s % replica_interval == 0``), the same on
      every process (a replacement healed in place too;
      :meth:`carries_replicas`). In between, a store keeps only its own
      pieces, so losing a domain rewinds to the newest snapshot whose
      replicas travelled (the restore picks it and reports the rewind). For
      jobs where the transfer costs more of a step than it should.
    hosts_per_domain: hosts that fail together, where devices carry no
      ``slice_index`` (``None``: one domain per host).
    store: where snapshots live (:class:`StoreKind`); ``AUTO`` picks the
      pinned-host store on a single controller given ``slices=`` (Pathways),
      host files otherwise.
    pinned_checksum: the pinned-host store's integrity check: ``"host"``
      (crc32c of the pinned buffer, in place), ``"device"`` (a 64-bit sum
      computed by XLA on the device, for memory the controller cannot
      address), or ``"auto"``: host on CPU devices, device elsewhere.
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
    incarnation: this job's incarnation (restart count); ``None`` takes
      ``$SNAPSTORE_INCARNATION`` (set by ``snapstore launch``), else one more
      than the newest in the stores (agreed across hosts).
  """

  interval: int | str = 1
  host_mtbf_s: float | None = None
  keep: int = 2
  budget_bytes: int | None = None
  store_dir: str | os.PathLike[str] = DEFAULT_STORE_DIR
  run_id: str = "default"
  persistent_interval: int = 0
  busy_policy: BusyPolicy = BusyPolicy.WAIT
  failure_policy: FailurePolicy = FailurePolicy.CONTINUE
  copy_threads: int = 2
  chunk_bytes: int = 16 << 20
  replicas: int = 1
  redundancy: str = "replica"
  parity_k: int = 3
  replica_interval: int = 1
  hosts_per_domain: int | None = None
  incarnation: int | None = None
  store: StoreKind = StoreKind.AUTO
  pinned_checksum: str = "auto"
  drain_switch_interval_s: float | None = 0.0005
  pause_gc: bool = True
  prefault_restore: bool = True

  def __post_init__(self):
    if self.interval == "auto":
      mtbf = self.host_mtbf_s
      if type(mtbf) not in (int, float) or mtbf is None or not mtbf > 0:
        raise ValueError("interval='auto' needs host_mtbf_s: one host's mean time "
                         f"between failures in seconds, got {self.host_mtbf_s!r}")
    else:
      _int_option("interval", self.interval, 1, "or 'auto'")
    _int_option("keep", self.keep, 1)
    _int_option("copy_threads", self.copy_threads, 1)
    _int_option("chunk_bytes", self.chunk_bytes, 4096)
    if self.chunk_bytes > 1 << 30:
      raise ValueError(f"chunk_bytes must be at most 1 GiB, got {self.chunk_bytes}")
    if self.chunk_bytes % 4096:
      raise ValueError(
          f"chunk_bytes must be a positive multiple of 4096, got {self.chunk_bytes}")
    if self.budget_bytes is not None:
      _int_option("budget_bytes", self.budget_bytes, 1, "or None")
    _int_option("persistent_interval", self.persistent_interval, 0, "(0 disables)")
    _int_option("replicas", self.replicas, 0)
    _int_option("replica_interval", self.replica_interval, 1)
    if self.redundancy not in ("replica", "parity"):
      raise ValueError(f"redundancy is 'replica' or 'parity', got {self.redundancy!r}")
    _int_option("parity_k", self.parity_k, 1)
    if self.parity_k > 1023:
      raise ValueError(f"parity_k must be at most 1023, got {self.parity_k}")
    if self.hosts_per_domain is not None:
      _int_option("hosts_per_domain", self.hosts_per_domain, 1, "or None")
    for name in ("pause_gc", "prefault_restore"):
      if type(getattr(self, name)) is not bool:
        raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
    if self.drain_switch_interval_s is not None and not (
        type(self.drain_switch_interval_s) in (int, float)
        and 0 < self.drain_switch_interval_s <= 1):
      raise ValueError("drain_switch_interval_s must be seconds in (0, 1] or None, got "
                       f"{self.drain_switch_interval_s!r}")
    if self.incarnation is not None:
      _int_option("incarnation", self.incarnation, 0, "or None")
    if not isinstance(self.busy_policy, BusyPolicy):
      raise TypeError(f"busy_policy must be a BusyPolicy, got {self.busy_policy!r}")
    if not isinstance(self.failure_policy, FailurePolicy):
      raise TypeError(f"failure_policy must be a FailurePolicy, got {self.failure_policy!r}")
    if not isinstance(self.store, StoreKind):
      raise TypeError(f"store must be a StoreKind, got {self.store!r}")
    if not isinstance(self.run_id, str) or not _RUN_ID_RE.match(self.run_id) or \
        self.run_id in (".", ".."):
      raise ValueError(
          f"run_id must be one path component matching {_RUN_ID_RE.pattern}, not "
          f"'.' or '..' (it names a directory), got {self.run_id!r}")
    if not isinstance(self.store_dir, (str, os.PathLike)) or not os.fspath(self.store_dir):
      raise ValueError(f"store_dir must be a non-empty path, got {self.store_dir!r}")
    if self.pinned_checksum not in ("auto", "host", "device"):
      raise ValueError(
          f"pinned_checksum is 'auto', 'host' or 'device', got {self.pinned_checksum!r}")

  def should_persist(self, step: int) -> bool:
    return self.persistent_interval > 0 and step % self.persistent_interval == 0

  def carries_replicas(self, step: int) -> bool:
    """Whether the snapshot of ``step`` carries the replicas (or parity):
    from the step and the options only, so every process, and every store's
    retention, agrees (a count of one process's snapshots would not)."""
    every = self.interval if isinstance(self.interval, int) else 1
    return (step // every) % self.replica_interval == 0


MAX_INT = 2**48  # steps, incarnations, sizes: far beyond use, far below overflow


def _int_option(name: str, value: object, minimum: int, also: str = "") -> None:
  """Raises (naming the option) unless ``value`` is an int in [``minimum``,
  2**48] (bool and float are refused: ``interval=True`` is a mistake)."""
  if type(value) is not int or not minimum <= value <= MAX_INT:
    kind = TypeError if type(value) is not int else ValueError
    raise kind(f"{name} must be an int in [{minimum}, 2**48]{' ' + also if also else ''}, "
               f"got {value!r}")
