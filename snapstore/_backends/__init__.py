"""Snapshot stores behind one interface (:class:`.base.Backend`).

``hostfiles``: files on a RAM disk, one store per process (or per failure
domain on a single controller). ``pinned``: ``pinned_host`` arrays per failure
domain, held by a single controller. Each is built by its store value
(:mod:`snapstore.stores`: ``HostFiles``, ``PinnedHost``, ``Auto``); a
backend of one's own is built by a value of one's own.
"""

from __future__ import annotations

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
  "host_dir",
  "open_regular",
  "read_progress",
  "scan",
  "supports_pinned_host",
]
