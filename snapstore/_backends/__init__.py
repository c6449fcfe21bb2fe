"""Snapshot stores behind one interface (:class:`.base.Backend`).

``hostfiles``: files on a RAM disk, one store per process (or per failure
domain on a single controller). ``pinned``: ``pinned_host`` arrays per failure
domain, held by a single controller. :func:`build_backend` is the only place that
looks at :class:`StoreKind`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent import futures
from typing import Any

import jax

from ..options import SnapshotOptions, StoreKind
from .base import NO_PROGRESS, Backend, Header
from .hostfiles.backend import HostFilesBackend
from .hostfiles.store import host_dir, open_regular, read_progress, scan
from .pinned.backend import PinnedHostBackend
from .pinned.store import supports_pinned_host

__all__ = [
  "NO_PROGRESS",
  "Backend",
  "Header",
  "HostFilesBackend",
  "PinnedHostBackend",
  "build_backend",
  "host_dir",
  "open_regular",
  "read_progress",
  "resolve_kind",
  "scan",
]


def resolve_kind(kind: StoreKind, slices: Mapping[int, Sequence[jax.Device]] | None
                 ) -> StoreKind:
  """Resolves ``StoreKind.AUTO``; rejects a pinned-host store without slices."""
  if kind is StoreKind.PINNED_HOST and slices is None:
    raise ValueError(
        "the pinned_host store is for a single controller: pass slices= (failure "
        "domain -> devices). With jax.distributed, host files outlive the process "
        "that wrote them; pinned host memory does not.")
  if kind is StoreKind.AUTO:
    devices = [d for devs in (slices or {}).values() for d in devs]
    pinned = slices is not None and supports_pinned_host(devices)
    return StoreKind.PINNED_HOST if pinned else StoreKind.HOST_FILES
  return kind


def build_backend(options: SnapshotOptions, *, host: int, num_hosts: int,
                  slices: Mapping[int, Sequence[jax.Device]] | None,
                  pool: futures.Executor) -> Backend[Any]:
  """The backend for ``options.store`` (AUTO resolved), built once."""
  if slices is not None and num_hosts > 1:
    raise ValueError("slices= is for a single controller (one process); with "
                     "jax.distributed each process keeps its own host store")
  kind = resolve_kind(options.store, slices)
  if slices is not None and options.parity_k is not None and kind is not StoreKind.PINNED_HOST:
    raise ValueError("redundancy=Parity(k) on a single controller needs the pinned_host "
                     "store (devices with pinned_host memory); host files with slices= "
                     "keep full replicas (redundancy=Replicas(n))")
  if kind is StoreKind.PINNED_HOST and slices is not None:
    return PinnedHostBackend(options, slices=slices, pool=pool)
  return HostFilesBackend(options, host=host, num_hosts=num_hosts, slices=slices, pool=pool)
