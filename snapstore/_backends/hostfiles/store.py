"""The host store: snapshot slots as files on a RAM-backed filesystem.

Layout of one host's store (``<store_dir>/<run_id>/host-<h>/``, mode 0700)::

  slot-<i>.bin                       preallocated, reused data files (mode 0600)
  step-<step>-inc<inc>.manifest      msgpack manifest naming the slot it lives in
  PROGRESS                           newest step this host was asked to save

The files outlive the trainer process (a tmpfs has no resource tracker that
deletes them when the writer dies). A slot is reused only after its manifest
is deleted, so a torn write can never be read as a snapshot. Slots are
touched once when created: first-touch page faults would otherwise slow
every copy into a fresh slot several times over; the drain makes a new
slot, or takes the one made ahead between saves (:mod:`.slots`).

Safety: the run and host directories must be ours (owner, no symlink, not
writable by others) or the store is refused before anything is touched;
nothing under them is opened through a symlink (``O_NOFOLLOW``) and only
regular files are read (a FIFO or a directory in a slot's place is
corruption). A slot file is never resized in place: a state of a new size
gets new slot files while the complete snapshots in the old ones stay until
the new one is committed, and no mapping of ours can outlive its file's
length by our own doing.
"""

from __future__ import annotations

import errno
import itertools
import logging
import mmap
import os
import re
import shutil
import stat
from collections.abc import Sequence
from pathlib import Path
from typing import cast

import msgpack
import numpy as np

from ... import _arena, _faults, _planner, errors
from ..._index import align
from ..._manifest import MAX_MANIFEST_BYTES, Manifest, decode, encode, kept_copy, write_atomic
from ..base import NO_PROGRESS
from .slots import SlotMaker

logger = logging.getLogger(__name__)

_MANIFEST_RE = re.compile(r"^step-(\d{10,19})-inc(\d{1,19})\.manifest$")
_SLOT_RE = re.compile(r"^slot-(\d{1,9})\.bin$")
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)


def host_dir(store_dir: os.PathLike[str] | str, run_id: str, host: int) -> Path:
  return Path(store_dir) / run_id / f"host-{host}"


def secure_dir(path: Path, *, create: bool, shared_ok: bool = False) -> None:
  """Creates ``path`` (0700) if missing; raises UnsafeStoreError, touching
  nothing, if it is a symlink, not a directory, not ours, or writable by
  others. ``shared_ok``: a root-owned sticky directory is fine (``/dev/shm``)."""
  try:
    st = os.lstat(path)
  except FileNotFoundError:
    if not create:
      raise
    try:  # the store dir's missing parents too; the run and host dirs one level
      os.makedirs(path, 0o700) if shared_ok else os.mkdir(path, 0o700)
    except FileExistsError:
      pass
    st = os.lstat(path)
  why = None
  sticky = bool(st.st_mode & stat.S_ISVTX)
  if stat.S_ISLNK(st.st_mode):
    why = "is a symlink"
  elif not stat.S_ISDIR(st.st_mode):
    why = "is not a directory"
  elif st.st_uid != os.getuid() and not (shared_ok and st.st_uid == 0 and sticky):
    why = f"is owned by uid {st.st_uid}, not by this user (uid {os.getuid()})"
  elif st.st_mode & 0o022 and not (shared_ok and sticky):
    why = f"is writable by others (mode {stat.S_IMODE(st.st_mode):o})"
  if why:
    raise errors.UnsafeStoreError(
        f"refusing the snapshot store: {path} {why}. Nothing was read or changed; use a "
        "HostFiles(dir=...) of your own (mode 0700), or remove what is there.")


def open_regular(path: Path, flags: int = _READ, mode: int = 0o600) -> int:
  """An fd of ``path`` opened without following a symlink (and without
  blocking on a FIFO); raises CorruptSnapshotError unless a regular file."""
  fd = os.open(path, flags, mode)
  if not stat.S_ISREG(os.fstat(fd).st_mode):
    os.close(fd)
    raise errors.CorruptSnapshotError(f"{path} is not a regular file")
  return fd


def read_small(path: Path, limit: int) -> bytes:
  fd = open_regular(path)
  try:
    size = os.fstat(fd).st_size
    if size > limit:
      raise errors.CorruptSnapshotError(f"{path}: {size} bytes exceeds the limit of {limit}")
    chunks, left = [], size
    while left > 0:
      got = os.read(fd, left)
      if not got:
        break
      chunks.append(got)
      left -= len(got)
    return b"".join(chunks)
  finally:
    os.close(fd)


class HostStore:
  """One host's slots and manifests. Not thread-safe: the backend serializes."""

  def __init__(self, root: os.PathLike[str] | str, *, run_id: str, host: int,
               keep: int, budget_bytes: int | None):
    self.root = Path(root)
    self.run_id = run_id
    self.host = host
    self.keep = keep
    self.budget_bytes = budget_bytes
    self.num_slots = keep + 1
    self._slot_size = 0  # the size of the last slot reserved
    self._maps: dict[int, tuple[mmap.mmap, np.ndarray]] = {}
    self._inodes: dict[int, int] = {}  # slot -> inode of the file we mapped
    self._planned: tuple[int, int] | None = None  # (slot, size) reserved, made by the drain
    self._ahead = SlotMaker(self.root)  # the next slot, made between saves (.slots)
    # path -> ((mtime_ns, size, ino), manifest or why not): decode each file
    # version once; only the files there now are kept.
    self._decoded: dict[Path, tuple[tuple[int, int, int], Manifest | str]] = {}
    self._make_dirs()
    for entry in os.scandir(self.root):  # a writer died before its rename.
      if ".tmp." in entry.name and entry.is_file(follow_symlinks=False):
        try:
          os.unlink(entry.path)
          logger.info("removed %s: an interrupted write", entry.path)
        except OSError as e:  # a read-only store still restores
          logger.info("cannot remove %s (%s)", entry.path, e)

  def _make_dirs(self) -> None:
    """The store's directories, made where missing (checked where present)."""
    secure_dir(self.root.parent.parent, create=True, shared_ok=True)
    secure_dir(self.root.parent, create=True)
    secure_dir(self.root, create=True)

  # ---------------------------------------------------------------- slots
  def _slot_path(self, i: int) -> Path:
    return self.root / f"slot-{i}.bin"

  def _slot_sizes(self) -> dict[int, int]:
    """slot -> file size, for the regular slot files here (others ignored)."""
    out = {}
    for entry in os.scandir(self.root):
      m = _SLOT_RE.match(entry.name)
      if m and entry.is_file(follow_symlinks=False):
        out[int(m.group(1))] = entry.stat(follow_symlinks=False).st_size
      elif m:
        logger.warning("ignoring %s: not a regular file", entry.path)
    return out

  def reserve(self, step: int, snapshot_bytes: int, watermark: int | None = None) -> int:
    """A slot of the right size for ``step``'s snapshot (see :meth:`_reserve`);
    an OSError of the store (read-only, gone) is raised as StoreError."""
    try:
      return self._reserve(step, snapshot_bytes, watermark)
    except errors.SnapstoreError:
      raise
    except OSError as e:
      raise errors.StoreError(f"host {self.host}: cannot write {self.root} ({e}); the "
                              "snapshots already there are untouched") from e

  def _reserve(self, step: int, snapshot_bytes: int, watermark: int | None) -> int:
    """A slot of the right size for ``step``'s snapshot: a free one, else a
    new file; the oldest snapshots are evicted while the store would exceed
    its slots (:func:`.._planner.slot_count`) or the byte budget, never the
    job's ``watermark`` step (None: never the newest complete one; see
    :func:`.._planner.evictable`). Raises BudgetExceededError (before
    deleting anything) if the budget cannot hold that one and this one,
    StoreError if the store cannot be written."""
    if not os.path.isdir(self.root):  # removed under us: its snapshots are gone
      logger.warning("host %d: the store directory %s is gone; making it again", self.host,
                     self.root)
      self._make_dirs()
    size = align(max(snapshot_bytes, 1))
    if size <= self._slot_size <= 2 * size:
      # Sizes that alternate (replicas with every other snapshot) share one
      # slot size, the larger: free slots are reused, not remade every save.
      size = self._slot_size
    self.num_slots = _planner.slot_count(size, keep=self.keep, budget_bytes=self.budget_bytes,
                                         where=f"the host store of host {self.host}")
    valid = sorted(_planner.fence(self.manifests()), key=lambda m: m.step)
    sizes = self._slot_sizes()
    victims = _planner.evictable(valid, watermark)
    kept = [m for m in valid if m not in victims]

    def over() -> bool:
      held = sum(sizes.get(m.slot, 0) for m in valid)
      return len({m.slot for m in valid}) + 1 > self.num_slots or (
          self.budget_bytes is not None and held + size > self.budget_bytes)
    if valid and over() and not self._fits_after_eviction(kept, sizes, size):
      raise errors.BudgetExceededError(
          f"host {self.host}: the budget of {self.budget_bytes} bytes cannot hold the "
          f"snapshot a restore needs (step {kept[0].step}) and one of {size} bytes; "
          "nothing was deleted. Raise budget_bytes.")
    while victims and over():
      victim = victims.pop(0)
      valid.remove(victim)
      self.delete(victim, f"evicted for step {step}")
    used = {m.slot for m in valid}
    for m in self.manifests():  # stale manifests naming a slot we may reuse
      if m.slot not in used:
        self.delete(m, f"slot {m.slot} reused for step {step}")
    free = [i for i in sorted(sizes) if i not in used]
    slot = next((i for i in free if sizes[i] == size), None)
    for i in free:  # free slots of another size hold nothing: drop them
      if i != slot:
        self._unmap(i)
        os.unlink(self._slot_path(i))
    self._planned = None
    if slot is None:  # the lowest number with no file (of any type) of that name
      slot = next(i for i in itertools.count()
                  if i not in used and not os.path.lexists(self._slot_path(i)))
      if self._ahead.size not in (0, size):  # made for a size no longer wanted
        self._ahead.discard()
      if not os.access(self.root, os.W_OK):  # (the drain makes the file: found here)
        raise OSError(errno.EROFS if os.statvfs(self.root).f_flag & os.ST_RDONLY
                      else errno.EACCES, "no new file can be made here")
      self._check_room(size, with_ahead=True)
      self._planned = (slot, size)  # made off this thread: slot_buffer, in the drain
    self._slot_size = size  # (only once it has one: a refused size is not remembered)
    return slot

  def _fits_after_eviction(self, kept: list[Manifest], sizes: dict[int, int],
                           size: int) -> bool:
    if self.budget_bytes is None:
      return True
    return sum(sizes.get(m.slot, 0) for m in kept) + size <= self.budget_bytes

  def _check_room(self, size: int, *, with_ahead: bool = False) -> None:
    """Raises BudgetExceededError unless the filesystem has room for a slot
    of ``size`` (``with_ahead``: what is allocated of a slot of that size
    made ahead counts as room: it becomes this one)."""
    free = shutil.disk_usage(self.root).free
    if with_ahead and self._ahead.size == size:
      free += self._ahead.allocated
    if size > free:
      raise errors.BudgetExceededError(
          f"a slot of {size} bytes does not fit in the {free} free bytes of "
          f"{self.root}: lower keep, set budget_bytes, or free the RAM disk.")

  def _room_planned(self) -> int:
    """Bytes the slot :meth:`reserve` planned still needs (0: none planned)."""
    if self._planned is None:
      return 0
    size = self._planned[1]
    return size - (self._ahead.allocated if self._ahead.size == size else 0)

  @staticmethod
  def check_room_for(stores: Sequence[HostStore]) -> None:
    """Raises BudgetExceededError unless the filesystem ``stores`` share has
    room for every slot they planned, at once (each checked its own)."""
    need = sum(store._room_planned() for store in stores)
    if need and stores:
      free = shutil.disk_usage(stores[0].root).free
      if need > free:
        raise errors.BudgetExceededError(
            f"the new slots of {len(stores)} stores need {need} bytes, more than the "
            f"{free} free bytes of {stores[0].root.parent}: lower keep, set budget_bytes, "
            "or free the RAM disk.")

  def _make_planned(self, i: int, size: int) -> None:
    """Makes the slot :meth:`reserve` planned: the one made ahead, if it has
    that size, else a new one."""
    self._planned = None
    mm = self._ahead.take(size, self._slot_path(i))
    if mm is None:
      self._create_slot(i, size)
      return
    self._maps[i] = (mm, np.frombuffer(mm, dtype=np.uint8))
    self._inodes[i] = os.lstat(self._slot_path(i)).st_ino

  def make_ahead(self) -> None:
    """Starts making the slot a coming save will take, on a thread of its
    own (:mod:`.slots`), while every slot file here has the size of the last
    reserved, there are fewer than the store uses, and the filesystem has
    room for it (a size it refused once is not tried again). Never raises."""
    size = self._slot_size
    if not size or size in (self._ahead.size, self._ahead.refused):
      return
    try:
      sizes = list(self._slot_sizes().values())
      if (len(sizes) < self.num_slots and all(n == size for n in sizes)
          and shutil.disk_usage(self.root).free >= size):
        self._ahead.start(size)
    except (OSError, RuntimeError) as e:  # (RuntimeError: no thread to be had)
      logger.info("%s: no slot made ahead (%s)", self.root, e)

  def _create_slot(self, i: int, size: int) -> None:
    self._check_room(size)
    path = self._slot_path(i)
    fd = open_regular(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
      try:
        _allocate(fd, size, path)
      except BaseException:
        os.unlink(path)  # never a full-size sparse file left to be reused
        raise
      mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    finally:
      os.close(fd)
    # First touch here, not in the copy: every page mapped writable, in
    # chunks with the GIL released (its pages are allocated and zero
    # already: writing zeros over them, as this did, cost a pass over the slot).
    _arena._populate_now(mm)
    arr = np.frombuffer(mm, dtype=np.uint8)
    self._maps[i] = (mm, arr)
    self._inodes[i] = os.lstat(self._slot_path(i)).st_ino

  def held_bytes(self) -> int:
    """Bytes of every slot file this store holds now (RAM on a RAM disk)."""
    return sum(self._slot_sizes().values())

  def slot_buffer(self, slot: int) -> np.ndarray:
    """The writable bytes of ``slot`` (reserved by :meth:`reserve`; a new
    slot is made here: the drain's thread)."""
    if self._planned is not None and self._planned[0] == slot:
      self._make_planned(*self._planned)
    if slot not in self._maps:
      path = self._slot_path(slot)
      fd = open_regular(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
      try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid() or st.st_mode & 0o077:
          raise errors.UnsafeStoreError(
              f"{self._slot_path(slot)} is owned by uid {st.st_uid} with mode "
              f"{stat.S_IMODE(st.st_mode):o}; a slot must be this user's, mode 0600")
        if st.st_nlink > 1:  # another name shares it (a backup: cp -al): never rewrite it
          logger.warning("%s has %d links: replaced by a new file, the others keep its "
                         "bytes", path, st.st_nlink)
          os.close(fd)
          fd = -1
          os.unlink(path)
          self._create_slot(slot, st.st_size)
          return self._maps[slot][1]
        if st.st_blocks * 512 < st.st_size:  # sparse (an allocation cut short)
          _allocate(fd, st.st_size, path)
        mm = mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
      finally:
        if fd >= 0:
          os.close(fd)
      self._maps[slot] = (mm, np.frombuffer(mm, dtype=np.uint8))
      self._inodes[slot] = st.st_ino
    return self._maps[slot][1]

  def read_buffer(self, slot: int, size: int) -> np.ndarray:
    """Read-only bytes of ``slot``; CorruptSnapshotError if the file is now
    shorter than ``size`` or not a regular file. Checked on every read, also
    where this process holds a mapping (a file shrunk behind a mapping would
    raise SIGBUS on access)."""
    fd = open_regular(self._slot_path(slot))
    try:
      st = os.fstat(fd)
      if st.st_size < size:
        raise errors.CorruptSnapshotError(
            f"{self._slot_path(slot)} has {st.st_size} bytes, the manifest needs {size}")
      mine = self._maps.get(slot)
      if mine is not None and self._inodes.get(slot) == st.st_ino and mine[1].nbytes >= size:
        view = mine[1][:size]
      else:
        mm = mmap.mmap(fd, st.st_size, access=mmap.ACCESS_READ)
        view = np.frombuffer(mm, dtype=np.uint8)[:size]
    finally:
      os.close(fd)
    out = view.view()
    out.flags.writeable = False
    return out

  def _unmap(self, slot: int) -> None:
    self._maps.pop(slot, None)  # the mmap closes when the last numpy view is gone.

  def close(self) -> None:
    self._ahead.discard()
    self._planned = None
    self._maps.clear()

  @property
  def ahead_seconds(self) -> float:
    """Seconds spent making slots ahead, off the save's and the drain's threads."""
    return self._ahead.seconds

  def wipe(self) -> None:
    """Deletes every manifest, slot and the PROGRESS file (the memory of a
    lost host); the store stays usable and starts empty."""
    self._ahead.discard()
    self._planned = None
    self._maps.clear()
    for entry in os.scandir(self.root):
      if entry.is_file(follow_symlinks=False) or entry.is_symlink():
        os.unlink(entry.path)
    self._decoded.clear()

  # ------------------------------------------------------------ manifests
  def manifest_path(self, step: int, incarnation: int) -> Path:
    return self.root / f"step-{step:010d}-inc{incarnation}.manifest"

  def commit(self, manifest: Manifest) -> None:
    path = self.manifest_path(manifest.step, manifest.incarnation)
    st = write_atomic(path, encode(manifest),
                      before_rename=lambda: _faults.point("manifest", manifest.step))
    # The file version just written decodes to ``manifest`` (tested): the
    # retention scan that follows need not decode it again (costly for a
    # state of many leaves). Any later change to the file is a new
    # version, decoded and validated as usual. ``extra`` is the caller's
    # object: the store keeps its own copy, as a decode would give.
    self._decoded[path] = ((st.st_mtime_ns, st.st_size, st.st_ino), kept_copy(manifest))

  def delete(self, manifest: Manifest, reason: str) -> None:
    logger.debug("host %d: deleting snapshot of step %d (%s)", self.host, manifest.step,
                 reason)
    try:
      os.unlink(self.manifest_path(manifest.step, manifest.incarnation))
    except FileNotFoundError:
      pass

  def manifests(self) -> list[Manifest]:
    """Valid manifests of this run on this host, oldest first. The others are
    skipped with a logged reason (never deleted: they may be evidence)."""
    out = []
    try:
      found = scan(self.root, run_id=self.run_id, host=self.host, cache=self._decoded)
    except OSError as e:  # the directory gone or unreadable: nothing here can be used
      logger.warning("host %d: cannot list %s (%s): it holds no snapshot", self.host,
                     self.root, e)
      self._decoded.clear()
      return []
    for path, m, why in found:
      if m is None:
        logger.warning("ignoring %s: %s", path, why)
      else:
        out.append(m)
    return out

  # ------------------------------------------------------------- progress
  def write_progress(self, step: int, incarnation: int) -> None:
    try:
      write_atomic(self.root / "PROGRESS",
                   msgpack.packb({"step": step, "incarnation": incarnation}))
    except OSError as e:  # advisory (launch reads it): never fail a save for it
      logger.warning("host %d: progress not written (%s)", self.host, e)

  def read_progress(self) -> tuple[int, int]:
    """(newest step asked to save, its incarnation); NO_PROGRESS if none."""
    return read_progress(self.root)


def read_progress(root: os.PathLike[str] | str) -> tuple[int, int]:
  """A host store's PROGRESS: (newest step asked to save, its incarnation),
  NO_PROGRESS if absent or unreadable. Reads only; safe from another process."""
  try:
    doc = msgpack.unpackb(read_small(Path(root) / "PROGRESS", 4096), raw=False)
    step, inc = doc["step"], doc["incarnation"]
    if type(step) is not int or type(inc) is not int or not (
        0 <= step <= 2**48 and 0 <= inc <= 2**48):
      return NO_PROGRESS
    return step, inc
  except (OSError, ValueError, KeyError, TypeError, errors.SnapstoreError,
          msgpack.UnpackException):
    return NO_PROGRESS


def scan(root: Path, *, run_id: str, host: int,
         cache: dict[Path, tuple[tuple[int, int, int], Manifest | str]] | None = None
         ) -> list[tuple[Path, Manifest | None, str | None]]:
  """Every manifest file of one host store, oldest first: (path, manifest,
  None) if valid, else (path, None, why not). Valid: it reads, passes its
  checksum and validation, names this run, this host and the step and
  incarnation of its file name, and its slot file is a regular file. Reads
  only (``snapstore inspect`` uses it on stores it does not own). ``cache``
  keeps each file version's verdict (decoded once), for the files there now."""
  out: list[tuple[Path, Manifest | None, str | None]] = []
  seen: set[Path] = set()
  for entry in sorted(os.scandir(root), key=lambda e: e.name):
    named = _MANIFEST_RE.match(entry.name)
    if not named:
      continue
    path = Path(entry.path)
    seen.add(path)
    try:
      st = entry.stat(follow_symlinks=False)
      version = (st.st_mtime_ns, st.st_size, st.st_ino)
      cached = cache.get(path) if cache is not None else None
      if cached is not None and cached[0] == version:
        got = cached[1]
      else:
        try:
          got = decode(read_small(path, MAX_MANIFEST_BYTES), what=path.name)
        except errors.CorruptSnapshotError as e:
          got = str(e)
        if cache is not None:
          cache[path] = (version, got)
    except OSError as e:
      got = str(e)
    if isinstance(got, str):
      out.append((path, None, got))
      continue
    m = got
    if m.run_id != run_id:
      out.append((path, None, f"written by run {m.run_id!r}, this is run {run_id!r}"))
      continue
    if (m.store, m.step, m.incarnation) != (host, int(named[1]), int(named[2])):
      out.append((path, None, f"names host {m.store} step {m.step} incarnation "
                              f"{m.incarnation}, not what its name says"))
      continue
    try:
      slot_ok = stat.S_ISREG(os.lstat(root / f"slot-{m.slot}.bin").st_mode)
    except OSError:
      slot_ok = False
    if not slot_ok:
      out.append((path, None, f"its slot file slot-{m.slot}.bin is missing or not a "
                              "regular file"))
      continue
    out.append((path, m, None))
  if cache is not None:
    for gone in set(cache) - seen:
      del cache[gone]
  valid = sorted([e for e in out if e[1] is not None],
                 key=lambda e: (cast(Manifest, e[1]).step, cast(Manifest, e[1]).incarnation))
  return valid + [e for e in out if e[1] is None]


def _allocate(fd: int, size: int, path: Path) -> None:
  """Sizes ``fd`` to ``size`` bytes, every page allocated: a mapping of it
  is then written without a fault that could find no page (SIGBUS on a
  full RAM disk). Raises BudgetExceededError naming the space if the
  filesystem has no room."""
  try:
    os.ftruncate(fd, size)
    os.posix_fallocate(fd, 0, size)
  except OSError as e:
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
      raise errors.BudgetExceededError(
          f"{path}: no room for a slot of {size} bytes on its filesystem "
          f"({shutil.disk_usage(path.parent).free} bytes free): lower keep, set "
          "budget_bytes, or free the RAM disk.") from e
    raise
