"""Snapshot stores behind one interface (:class:`.base.Backend`).

``hostfiles``: files on a RAM disk, one store per process (or per failure
domain on a single controller). ``pinned``: ``pinned_host`` arrays per failure
domain, held by a single controller. Each is built by its store value
(:mod:`snapstore.stores`: ``HostFiles``, ``PinnedHost``, ``Auto``); a
backend of one's own is built by a value of one's own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent import futures
from typing import Any

import jax

from ..options import SnapshotOptions
from ..stores import Auto, HostFiles, PinnedHost
from .base import NO_PROGRESS, Backend, Header, StoreSpec
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
  "StoreSpec",
  "build",
  "host_dir",
  "open_regular",
  "read_progress",
  "resolve",
  "scan",
  "supports_pinned_host",
]


def resolve(store: Auto, slices: Mapping[int, Sequence[jax.Device]] | None
            ) -> HostFiles | PinnedHost:
  """The store ``Auto()`` stands for, given the manager's ``slices``:
  pinned host for a single controller whose devices all have
  ``pinned_host`` memory, else host files."""
  devices = [d for devs in (slices or {}).values() for d in devs]
  if slices is not None and supports_pinned_host(devices):
    return PinnedHost(budget_bytes=store.budget_bytes)
  return HostFiles(dir=store.dir, budget_bytes=store.budget_bytes)


def build(store: object, options: SnapshotOptions, *, host: int, num_hosts: int,
          slices: Mapping[int, Sequence[jax.Device]] | None,
          pool: futures.Executor) -> Backend[Any]:
  """The backend of a store value (once, at the manager's construction):
  the built-in values (:mod:`snapstore.stores`) here, any other
  :class:`StoreSpec` by its own ``build``. Raises ValueError where the
  store cannot serve this job (saying why, and what to use)."""
  if isinstance(store, Auto):
    store = resolve(store, slices)
  if isinstance(store, (HostFiles, PinnedHost)) and slices is not None and num_hosts > 1:
    raise ValueError("slices= is for a single controller (one process); with "
                     "jax.distributed each process keeps its own host store")
  if isinstance(store, HostFiles):
    if slices is not None and options.parity_k is not None:
      raise ValueError("redundancy=Parity(k) on a single controller needs the pinned_host "
                       "store (store=PinnedHost(), devices with pinned_host memory); host "
                       "files with slices= keep full replicas (redundancy=Replicas(n))")
    return HostFilesBackend(options, store, host=host, num_hosts=num_hosts, slices=slices,
                            pool=pool)
  if isinstance(store, PinnedHost):
    if slices is None:
      raise ValueError(
          "the pinned_host store is for a single controller: pass slices= (failure "
          "domain -> devices). With jax.distributed, host files outlive the process "
          "that wrote them; pinned host memory does not.")
    return PinnedHostBackend(options, store, slices=slices, pool=pool)
  if not isinstance(store, StoreSpec):
    raise TypeError(f"store must be HostFiles(...), PinnedHost(...), Auto() or a value "
                    f"with a build(...) method (StoreSpec), got {store!r}")
  return store.build(options, host=host, num_hosts=num_hosts, slices=slices, pool=pool)
