"""Where snapshots live: the store values.

``SnapshotOptions(store=...)`` takes one of these, as ``interval`` takes
``Every`` and ``redundancy`` takes ``Replicas``::

    HostFiles(dir="/dev/shm/snapstore", budget_bytes=8 << 30)  # files on a RAM disk
    PinnedHost(checksum=PinnedChecksum.AUTO)                   # pinned_host, per slice
    Auto()                                                     # the default: one of the two

or any value of one's own with a ``build(...)`` that returns a
:class:`~snapstore.Backend` (:class:`~snapstore.StoreSpec`). The manager
builds the backend once, at construction (``snapstore._backends.build``:
the values here are plain data, built there), and from then on talks to
the backend only. A new backend passes :mod:`snapstore.testing.backend_suite`
by declaring its store value in a test class.
"""

from __future__ import annotations

import dataclasses
import enum
import os

from .errors import InvalidOptionError as Invalid

DEFAULT_STORE_DIR = "/dev/shm/snapstore"
_MAX_BUDGET = 2**48

__all__ = ["DEFAULT_STORE_DIR", "Auto", "HostFiles", "PinnedChecksum", "PinnedHost", "PinnedMemory"]


class PinnedChecksum(enum.Enum):
  """The pinned-host store's integrity check."""

  AUTO = "auto"      # HOST where this process holds the copies (PinnedMemory.PROCESS,
                     # CPU devices), DEVICE elsewhere
  HOST = "host"      # crc32c of the pinned buffer, in place
  DEVICE = "device"  # a 64-bit sum computed by XLA on the device, for memory the
                     # controller cannot address


class PinnedMemory(enum.Enum):
  """Where the pinned-host store keeps each slice's bytes."""

  AUTO = "auto"        # PROCESS where this process has every device's host memory (CPU
                       # devices, or one process that is not a Pathways client), else
                       # SLICE_HOSTS; SLICE_HOSTS with PinnedChecksum.DEVICE
  PROCESS = "process"  # this process's memory, reused from save to save: array leaves
                       # leave accelerators staged in pieces (the link's speed, see
                       # SnapshotOptions.staging) and are checked by crc32c on host threads
  SLICE_HOSTS = "slice_hosts"  # a pinned_host jax.Array on each slice's own hosts (on
                               # Pathways the bytes never reach the controller); a
                               # device_put, ~1 GB/s off a TPU v5e chip


def _check_budget(owner: str, budget_bytes: object) -> None:
  if budget_bytes is not None and (type(budget_bytes) is not int
                                   or not 1 <= budget_bytes <= _MAX_BUDGET):
    raise Invalid(f"{owner}.budget_bytes must be an int in [1, 2**48] or None, "
                  f"got {budget_bytes!r}")


def _check_dir(owner: str, path: object) -> None:
  if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
    raise Invalid(f"{owner}.dir must be a non-empty path, got {path!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class HostFiles:
  """Files on a RAM disk, written by each process; they outlive it, so a
  restarted process restores from them.

  Attributes:
    dir: a directory on a RAM-backed filesystem; the store of a run lives in
      ``<dir>/<run_id>/host-<process index>/`` (what ``snapstore inspect``
      and ``snapstore launch`` read).
    budget_bytes: byte budget of this process's store (``None``: the free
      space of ``dir``). One snapshot being written plus the newest complete
      one must fit, so the budget must hold two snapshots.

  Raises:
    InvalidOptionError: an empty ``dir``, or a budget not an int in [1, 2**48].
  """

  dir: str | os.PathLike[str] = DEFAULT_STORE_DIR
  budget_bytes: int | None = None

  def __post_init__(self) -> None:
    _check_dir("HostFiles", self.dir)
    _check_budget("HostFiles", self.budget_bytes)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PinnedHost:
  """``pinned_host`` jax.Arrays on each slice's hosts, held by a single
  controller (``SnapshotManager(..., slices=...)``): losing a slice loses
  exactly its arrays. They die with the controller.

  Attributes:
    checksum: the integrity check (:class:`PinnedChecksum`).
    budget_bytes: byte budget of each slice's store (``None``: the hosts'
      memory); it must hold two snapshots of the slice's share.
    memory: where the bytes live (:class:`PinnedMemory`): this process's
      memory, or each slice's own hosts (Pathways).

  Raises:
    InvalidOptionError: ``checksum`` not a :class:`PinnedChecksum`, ``memory``
      not a :class:`PinnedMemory`, ``PinnedMemory.PROCESS`` with
      ``PinnedChecksum.DEVICE``, or a budget not an int in [1, 2**48].
  """

  checksum: PinnedChecksum = PinnedChecksum.AUTO
  budget_bytes: int | None = None
  memory: PinnedMemory = PinnedMemory.AUTO

  def __post_init__(self) -> None:
    if not isinstance(self.checksum, PinnedChecksum):
      raise Invalid(f"PinnedHost.checksum must be a PinnedChecksum, got {self.checksum!r}")
    if not isinstance(self.memory, PinnedMemory):
      raise Invalid(f"PinnedHost.memory must be a PinnedMemory, got {self.memory!r}")
    if self.memory is PinnedMemory.PROCESS and self.checksum is PinnedChecksum.DEVICE:
      raise Invalid("PinnedHost(memory=PinnedMemory.PROCESS) checks its copies by crc32c on "
                    "the host: use PinnedChecksum.HOST or AUTO")
    _check_budget("PinnedHost", self.budget_bytes)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Auto:
  """:class:`PinnedHost` for a single controller given ``slices=`` whose
  devices all have ``pinned_host`` memory, else :class:`HostFiles`
  (``SnapshotManager.store`` is the one chosen).

  Attributes:
    dir: the host files' directory (:attr:`HostFiles.dir`).
    budget_bytes: the chosen store's budget (per process, or per slice).

  Raises:
    InvalidOptionError: as :class:`HostFiles`.
  """

  dir: str | os.PathLike[str] = DEFAULT_STORE_DIR
  budget_bytes: int | None = None

  def __post_init__(self) -> None:
    _check_dir("Auto", self.dir)
    _check_budget("Auto", self.budget_bytes)
