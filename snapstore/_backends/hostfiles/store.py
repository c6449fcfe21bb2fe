"""The host store: snapshot slots as files on a RAM-backed filesystem.

Layout of one host's store (``<store_dir>/<run_id>/host-<h>/``, mode 0700)::

  slot-<i>.bin             preallocated, reused data files (mode 0600)
  step-<step>.manifest     msgpack manifest naming the slot it lives in
  PROGRESS                 newest step this host was asked to save

The files outlive the trainer process (a tmpfs has no resource tracker that
deletes them when the writer dies). A slot is reused only after its manifest
is deleted, so a torn write can never be read as a snapshot. Slots are
touched once when created: first-touch page faults would otherwise cut copy
speed by ~3x.
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import msgpack
import numpy as np

from ... import _faults, _planner, errors
from ..._index import align
from ..._manifest import Manifest, decode, encode, write_atomic
from ..base import NO_PROGRESS

logger = logging.getLogger(__name__)

_MANIFEST_RE = re.compile(r"^step-(\d{10})\.manifest$")


def host_dir(store_dir: os.PathLike[str] | str, run_id: str, host: int) -> Path:
  return Path(store_dir) / run_id / f"host-{host}"


class HostStore:
  """One host's slots and manifests. Not thread-safe: the manager serializes."""

  def __init__(self, root: os.PathLike[str] | str, *, run_id: str, host: int,
               keep: int, budget_bytes: int | None):
    self.root = Path(root)
    self.run_id = run_id
    self.host = host
    self.keep = keep
    self.budget_bytes = budget_bytes
    self._slot_bytes = 0
    self._num_slots = 0
    self._maps: dict[int, tuple[mmap.mmap, np.ndarray]] = {}
    # path -> ((mtime_ns, size, ino), manifest): decode each file version once.
    self._decoded: dict[Path, tuple[tuple[int, int, int], Manifest]] = {}
    for d in (self.root.parent.parent, self.root.parent, self.root):
      d.mkdir(mode=0o700, exist_ok=True)
    os.chmod(self.root.parent, 0o700)
    os.chmod(self.root, 0o700)
    for tmp in self.root.glob("*.tmp.*"):  # a writer died before its rename.
      logger.info("removing %s: an interrupted write", tmp)
      tmp.unlink(missing_ok=True)

  # ---------------------------------------------------------------- slots
  @property
  def num_slots(self) -> int:
    return self._num_slots

  def plan_slots(self, snapshot_bytes: int) -> int:
    """Sizes the slots for snapshots of ``snapshot_bytes``; raises if over budget.

    Slots = min(keep + 1, budget // size): one slot is written while the
    newest complete snapshots stay readable in the others.
    """
    size = align(max(snapshot_bytes, 1))
    if size == self._slot_bytes and self._num_slots:
      return self._num_slots
    want = _planner.slot_count(size, keep=self.keep, budget_bytes=self.budget_bytes,
                               where=f"the host store of host {self.host}")
    existing = sum(p.stat().st_size for p in self.root.glob("slot-*.bin"))
    free = shutil.disk_usage(self.root).free + existing
    if want * size > free:
      raise errors.BudgetExceededError(
          f"{want} slots of {size} bytes do not fit in the {free} free bytes of "
          f"{self.root}: lower keep, set budget_bytes, or free the RAM disk.")
    self._close_maps()
    for i in range(want):
      path = self._slot_path(i)
      if path.exists() and path.stat().st_size != size:
        self._drop_manifests(lambda m, i=i: m.slot == i, "slot resized")
    self._slot_bytes, self._num_slots = size, want
    for i in range(want):
      self._map(i)
    for path in self.root.glob("slot-*.bin"):  # slots beyond the new count
      if int(path.stem.split("-")[1]) >= want:
        self._drop_manifests(lambda m, p=path: m.slot == int(p.stem.split("-")[1]),
                             "slot count reduced")
        path.unlink(missing_ok=True)
    return want

  def _slot_path(self, i: int) -> Path:
    return self.root / f"slot-{i}.bin"

  def _map(self, i: int) -> np.ndarray:
    if i in self._maps:
      return self._maps[i][1]
    path = self._slot_path(i)
    fresh = not path.exists() or path.stat().st_size != self._slot_bytes
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
      if fresh:
        os.ftruncate(fd, self._slot_bytes)
        os.posix_fallocate(fd, 0, self._slot_bytes)
      mm = mmap.mmap(fd, self._slot_bytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
    finally:
      os.close(fd)
    arr = np.frombuffer(mm, dtype=np.uint8)
    if fresh:
      arr[:] = 0  # first touch here, not in the hot path.
    self._maps[i] = (mm, arr)
    return arr

  def slot_buffer(self, slot: int) -> np.ndarray:
    """The writable bytes of ``slot`` (the caller deletes its manifest first)."""
    return self._map(slot)

  def read_buffer(self, slot: int, size: int) -> np.ndarray:
    """Read-only bytes of ``slot`` (maps it if this process did not write it)."""
    if slot in self._maps:
      view = self._maps[slot][1][:size]
    else:
      path = self._slot_path(slot)
      with open(path, "rb") as f:
        length = os.fstat(f.fileno()).st_size
        if length < size:
          raise errors.CorruptSnapshotError(
              f"{path} has {length} bytes, the manifest needs {size}")
        mm = mmap.mmap(f.fileno(), length, access=mmap.ACCESS_READ)
      view = np.frombuffer(mm, dtype=np.uint8)[:size]
    out = view.view()
    out.flags.writeable = False
    return out

  def take_slot(self, step: int) -> int:
    """A slot for the snapshot of ``step``: a free one, else the oldest
    snapshot's (evicted); any stale manifest naming it is deleted first."""
    slot, evict = _planner.free_slot(self.manifests(), self._num_slots)
    if evict is not None:
      self.delete(evict.step, f"evicted to free a slot for step {step}")
    self._drop_manifests(lambda m: m.slot == slot, f"slot {slot} reused for step {step}")
    return slot

  def _close_maps(self) -> None:
    self._maps.clear()  # mmaps close when the last numpy view is gone.

  def close(self) -> None:
    self._close_maps()

  def wipe(self) -> None:
    """Deletes every manifest, slot and the PROGRESS file (the memory of a
    lost host); the store stays usable and starts empty."""
    self._close_maps()
    for path in self.root.iterdir():
      if path.is_file():
        path.unlink(missing_ok=True)
    self._decoded.clear()
    self._slot_bytes = self._num_slots = 0

  # ------------------------------------------------------------ manifests
  def manifest_path(self, step: int) -> Path:
    return self.root / f"step-{step:010d}.manifest"

  def commit(self, manifest: Manifest) -> None:
    write_atomic(self.manifest_path(manifest.step), encode(manifest),
                 before_rename=lambda: _faults.point("manifest", manifest.step))

  def delete(self, step: int, reason: str) -> None:
    logger.debug("host %d: deleting snapshot of step %d (%s)", self.host, step, reason)
    self.manifest_path(step).unlink(missing_ok=True)

  def _drop_manifests(self, pred: Callable[[Manifest], bool], reason: str) -> None:
    for m in self.manifests():
      if pred(m):
        self.delete(m.step, reason)

  def manifests(self) -> list[Manifest]:
    """Valid manifests of this run on this host, oldest first.

    Unreadable manifests and manifests of another run are skipped with a
    logged reason (never deleted: they may be evidence).
    """
    out = []
    for path in sorted(self.root.iterdir()):
      if not _MANIFEST_RE.match(path.name):
        continue
      try:
        st = path.stat()
        version = (st.st_mtime_ns, st.st_size, st.st_ino)
        cached = self._decoded.get(path)
        if cached is not None and cached[0] == version:
          m = cached[1]
        else:
          m = decode(path.read_bytes(), what=str(path))
          self._decoded[path] = (version, m)
      except (errors.CorruptSnapshotError, OSError) as e:
        logger.warning("ignoring %s: %s", path, e)
        continue
      if m.run_id != self.run_id:
        logger.warning("ignoring %s: written by run %r, this is run %r",
                       path, m.run_id, self.run_id)
        continue
      if m.host != self.host or int(_MANIFEST_RE.match(path.name).group(1)) != m.step:
        logger.warning("ignoring %s: names host %d step %d", path, m.host, m.step)
        continue
      if not self._slot_path(m.slot).exists():
        logger.warning("ignoring %s: its slot file is missing", path)
        continue
      out.append(m)
    return sorted(out, key=lambda m: (m.step, m.incarnation))

  # ------------------------------------------------------------- progress
  def write_progress(self, step: int, incarnation: int) -> None:
    write_atomic(self.root / "PROGRESS",
                 msgpack.packb({"step": step, "incarnation": incarnation}))

  def read_progress(self) -> tuple[int, int]:
    """(newest step asked to save, its incarnation); NO_PROGRESS if none."""
    return read_progress(self.root)


def read_progress(root: os.PathLike[str] | str) -> tuple[int, int]:
  """A host store's PROGRESS: (newest step asked to save, its incarnation),
  NO_PROGRESS if absent or unreadable. Reads only; safe from another process."""
  try:
    doc = msgpack.unpackb((Path(root) / "PROGRESS").read_bytes()[:4096], raw=False)
    return int(doc["step"]), int(doc["incarnation"])
  except (OSError, ValueError, KeyError, TypeError, msgpack.UnpackException):
    return NO_PROGRESS
