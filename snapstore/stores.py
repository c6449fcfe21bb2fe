"""Where snapshots live: store values that build their backend.

``SnapshotOptions(store=...)`` takes one of these, as ``interval`` takes
``Every`` and ``redundancy`` takes ``Replicas``::

    HostFiles(dir="/dev/shm/snapstore", budget_bytes=8 << 30)  # files on a RAM disk
    PinnedHost(checksum=PinnedChecksum.AUTO)                   # pinned_host, per slice
    Auto()                                                     # the default: one of the two

or any value of one's own with a ``build(...)`` that returns a
:class:`~snapstore.Backend` (:class:`StoreSpec`): the
manager calls it once, at construction, and from then on talks to the
backend only. A new backend passes :mod:`snapstore.testing.backend_suite`
by declaring its store value in a test class.
"""

from __future__ import annotations

import dataclasses
import enum
import os
from collections.abc import Mapping, Sequence
from concurrent import futures
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:  # (the backends import the options, which import these values)
  import jax

  from ._backends import Backend
  from .options import SnapshotOptions

DEFAULT_STORE_DIR = "/dev/shm/snapstore"
_MAX_BUDGET = 2**48

__all__ = ["DEFAULT_STORE_DIR", "Auto", "HostFiles", "PinnedChecksum", "PinnedHost", "StoreSpec"]


class PinnedChecksum(enum.Enum):
  """The pinned-host store's integrity check."""

  AUTO = "auto"      # HOST on CPU devices, DEVICE elsewhere
  HOST = "host"      # crc32c of the pinned buffer, in place
  DEVICE = "device"  # a 64-bit sum computed by XLA on the device, for memory the
                     # controller cannot address


@runtime_checkable
class StoreSpec(Protocol):
  """A store value: builds the backend a :class:`SnapshotManager` keeps its
  snapshots in. Called once, by the manager's constructor (collective on a
  multi-controller job: every process builds its own)."""

  def build(self, options: SnapshotOptions, *, host: int, num_hosts: int,
            slices: Mapping[int, Sequence[jax.Device]] | None,
            pool: futures.Executor) -> Backend[Any]:
    """The backend for this store.

    Args:
      options: the manager's options (``run_id``, ``keep``, ``chunk_bytes``...).
      host: this process's index; num_hosts: the processes of the job.
      slices: single controller only: failure domain -> its devices (None:
        one store for this process).
      pool: the manager's copy threads, for the backend's copies.

    Returns:
      A :class:`~snapstore.Backend`.

    Raises:
      ValueError: this store cannot serve this job (say why, and what to use).
    """
    ...


def _check_budget(owner: str, budget_bytes: object) -> None:
  if budget_bytes is not None and (type(budget_bytes) is not int
                                   or not 1 <= budget_bytes <= _MAX_BUDGET):
    kind = TypeError if type(budget_bytes) is not int else ValueError
    raise kind(f"{owner}.budget_bytes must be an int in [1, 2**48] or None, "
               f"got {budget_bytes!r}")


def _check_dir(owner: str, path: object) -> None:
  if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
    raise ValueError(f"{owner}.dir must be a non-empty path, got {path!r}")


def _one_controller(slices: Mapping[int, Sequence[jax.Device]] | None, num_hosts: int) -> None:
  if slices is not None and num_hosts > 1:
    raise ValueError("slices= is for a single controller (one process); with "
                     "jax.distributed each process keeps its own host store")


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
  """

  dir: str | os.PathLike[str] = DEFAULT_STORE_DIR
  budget_bytes: int | None = None

  def __post_init__(self) -> None:
    _check_dir("HostFiles", self.dir)
    _check_budget("HostFiles", self.budget_bytes)

  def build(self, options: SnapshotOptions, *, host: int, num_hosts: int,
            slices: Mapping[int, Sequence[jax.Device]] | None,
            pool: futures.Executor) -> Backend[Any]:
    """A :class:`HostFilesBackend`; one store per failure domain under
    ``slices=``. Raises ValueError for ``slices=`` on several processes, or
    with ``Parity`` (host files keep full replicas there)."""
    _one_controller(slices, num_hosts)
    if slices is not None and options.parity_k is not None:
      raise ValueError("redundancy=Parity(k) on a single controller needs the pinned_host "
                       "store (store=PinnedHost(), devices with pinned_host memory); host "
                       "files with slices= keep full replicas (redundancy=Replicas(n))")
    from ._backends import HostFilesBackend
    return HostFilesBackend(options, self, host=host, num_hosts=num_hosts, slices=slices,
                            pool=pool)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PinnedHost:
  """``pinned_host`` jax.Arrays on each slice's hosts, held by a single
  controller (``SnapshotManager(..., slices=...)``): losing a slice loses
  exactly its arrays. They die with the controller.

  Attributes:
    checksum: the integrity check (:class:`PinnedChecksum`).
    budget_bytes: byte budget of each slice's store (``None``: the hosts'
      memory); it must hold two snapshots of the slice's share.
  """

  checksum: PinnedChecksum = PinnedChecksum.AUTO
  budget_bytes: int | None = None

  def __post_init__(self) -> None:
    if not isinstance(self.checksum, PinnedChecksum):
      raise TypeError(f"PinnedHost.checksum must be a PinnedChecksum, got {self.checksum!r}")
    _check_budget("PinnedHost", self.budget_bytes)

  def build(self, options: SnapshotOptions, *, host: int, num_hosts: int,
            slices: Mapping[int, Sequence[jax.Device]] | None,
            pool: futures.Executor) -> Backend[Any]:
    """A :class:`PinnedHostBackend`, one store per slice. Raises ValueError
    without ``slices=`` (or on several processes)."""
    _one_controller(slices, num_hosts)
    if slices is None:
      raise ValueError(
          "the pinned_host store is for a single controller: pass slices= (failure "
          "domain -> devices). With jax.distributed, host files outlive the process "
          "that wrote them; pinned host memory does not.")
    from ._backends import PinnedHostBackend
    return PinnedHostBackend(options, self, slices=slices, pool=pool)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Auto:
  """:class:`PinnedHost` for a single controller given ``slices=`` whose
  devices all have ``pinned_host`` memory, else :class:`HostFiles` (what
  :meth:`resolve` returns; ``SnapshotManager.store`` is the one chosen).

  Attributes:
    dir: the host files' directory (:attr:`HostFiles.dir`).
    budget_bytes: the chosen store's budget (per process, or per slice).
  """

  dir: str | os.PathLike[str] = DEFAULT_STORE_DIR
  budget_bytes: int | None = None

  def __post_init__(self) -> None:
    _check_dir("Auto", self.dir)
    _check_budget("Auto", self.budget_bytes)

  def resolve(self, slices: Mapping[int, Sequence[jax.Device]] | None
              ) -> HostFiles | PinnedHost:
    """The store this value stands for, given the manager's ``slices``."""
    from ._backends import supports_pinned_host
    devices = [d for devs in (slices or {}).values() for d in devs]
    if slices is not None and supports_pinned_host(devices):
      return PinnedHost(budget_bytes=self.budget_bytes)
    return HostFiles(dir=self.dir, budget_bytes=self.budget_bytes)

  def build(self, options: SnapshotOptions, *, host: int, num_hosts: int,
            slices: Mapping[int, Sequence[jax.Device]] | None,
            pool: futures.Executor) -> Backend[Any]:
    """The backend of :meth:`resolve`'s store."""
    return self.resolve(slices).build(options, host=host, num_hosts=num_hosts, slices=slices,
                                      pool=pool)
