"""Stores of other host indices found on this machine: claimed, adopted, sent home.

Each process of a multi-controller job keeps its snapshots in
``<dir>/<run_id>/host-<its index>``. A restart need not give a process the
index it had on its machine (a JobSet recreates every pod and the scheduler
places them again; a launcher numbers processes as they start): every
machine then still holds a complete store, under another index's name.

* At open each process claims its own store: an exclusive ``flock`` on its
  directory, held while the manager lives (:func:`lock`); a process that
  dies drops it with its file descriptors.
* At a restore, each process says whether it sees a store of this run that
  no live process has claimed (:func:`unclaimed`): one more value in the
  restore's first agreement, so a job with none pays nothing more. If any
  host sees one, every host takes those it sees (:func:`adopt`; every
  process of the job has claimed its own by then: each made its manager
  before the restore's first collective), and the adopted snapshots are
  sent to the process whose index they carry, one permute a round
  (:func:`repatriate`). Each process then holds its own store as if it
  had never moved, and the restore goes on as usual: lost machines,
  replicas and parity as ever. Two processes on one machine never both
  adopt one store (the lock); a store whose old process still runs (a hung
  host, fenced) stays locked by it and is never adopted.
* An adopted store is deleted once the job has agreed a newer step that
  every store holds (the retention watermark), never before
  (:func:`release`).
"""

from __future__ import annotations

import dataclasses
import fcntl
import logging
import os
import re
import shutil
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import msgpack
import numpy as np

from ... import _planner
from ..._manifest import Manifest, decode, encode
from ..._multihost import Collective, gather_blobs, slot_bytes
from .store import HostStore

logger = logging.getLogger(__name__)

_HOST_RE = re.compile(r"^host-(\d{1,9})$")
#: bytes a permute round carries at most (a store's snapshots take several)
CHUNK_BYTES = 64 << 20


#: the descriptors of the locks this process holds (a forked child closes
#: its copies: a lock lives while any descriptor of its open file does)
_HELD: set[int] = set()


def _close_in_child() -> None:
  for fd in list(_HELD):
    try:
      os.close(fd)
    except OSError:
      pass
  _HELD.clear()


os.register_at_fork(after_in_child=_close_in_child)


def lock(path: Path, *, tries: int = 1, wait_s: float = 0.05) -> int | None:
  """An exclusive, non-blocking ``flock`` on directory ``path``: its file
  descriptor, or None if another open file holds it (or ``path`` is gone),
  after ``tries`` tries ``wait_s`` apart (another process's probe,
  :func:`unclaimed`, holds it for a moment)."""
  try:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
  except OSError:
    return None
  for i in range(tries):
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
      if i + 1 < tries:
        time.sleep(wait_s)
      continue
    _HELD.add(fd)
    return fd
  os.close(fd)
  return None


def unlock(fd: int) -> None:
  _HELD.discard(fd)
  try:
    os.close(fd)  # (the lock goes with the last descriptor of its open file)
  except OSError:
    pass


def host_dirs(run_dir: Path) -> Iterator[tuple[int, Path]]:
  """(index, directory) of every ``host-<index>`` store under ``run_dir``."""
  try:
    names = os.listdir(run_dir)
  except OSError:
    return
  for name in sorted(names):
    m = _HOST_RE.match(name)
    if m and (run_dir / name).is_dir() and not (run_dir / name).is_symlink():
      yield int(m.group(1)), run_dir / name


def unclaimed(run_dir: Path, mine: set[int]) -> list[int]:
  """The stores under ``run_dir`` other than ``mine`` (this process's own,
  adopted, or refused ones) that no open file locks now (each tried and let
  go at once)."""
  out = []
  for q, path in host_dirs(run_dir):
    if q in mine:
      continue
    fd = lock(path)
    if fd is not None:
      unlock(fd)
      out.append(q)
  return out


@dataclasses.dataclass
class Adopted:
  """A store of another index this process holds (locked), and whether its
  snapshots went home."""

  store: HostStore
  fd: int
  newest: tuple[int, int]  # (incarnation, step) of its newest valid snapshot; (-1, -1): none
  seen: tuple[int, int]    # its PROGRESS when adopted: a change means a writer
  sent: bool = False
  floor: int | None = None  # deleted once a watermark passes this (set when sent)


def adopt(run_dir: Path, mine: set[int], held: Mapping[int, Adopted], *, run_id: str,
          keep: int, refused: set[int]) -> dict[int, Adopted]:
  """Locks and opens every store under ``run_dir`` other than ``mine``,
  ``held`` and ``refused`` that no live process has claimed; one that
  cannot be read joins ``refused`` (never tried again by this process)."""
  out: dict[int, Adopted] = {}
  for q, path in host_dirs(run_dir):
    if q in mine or q in held or q in refused:
      continue
    fd = lock(path)
    if fd is None:
      continue
    try:
      store = HostStore(path, run_id=run_id, host=q, keep=keep, budget_bytes=None)
      valid = _planner.fence([m for m in store.manifests() if m.run_id == run_id])
      seen = store.read_progress()
    except Exception as e:  # noqa: BLE001 - an unusable store is not adopted
      logger.warning("the store %s was left unadopted: %s", path, e)
      unlock(fd)
      refused.add(q)
      continue
    newest = max(((m.incarnation, m.step) for m in valid), default=(-1, -1))
    out[q] = Adopted(store, fd, newest, seen)
    logger.info("adopted the store of host %d (%s): %d snapshots, newest step %d", q, path,
                len(valid), newest[1])
  return out


def drop(held: dict[int, Adopted], q: int) -> None:
  """Lets go of an adopted store, leaving it as it is."""
  a = held.pop(q)
  a.store.close()
  unlock(a.fd)


def settle(held: dict[int, Adopted], restored: int | None) -> None:
  """The restore after a repatriation chose ``restored`` (None: a step of
  the persistent tier): the stores sent home go once a newer step than it
  is held by every store."""
  for a in held.values():
    if a.sent and a.floor is None:
      a.floor = -1 if restored is None else min(restored, a.newest[1])


def release(held: dict[int, Adopted], watermark: int | None) -> list[int]:
  """Deletes each adopted store that went home once ``watermark`` (a step
  every store holds) passes its floor (:func:`settle`): never before, and
  never one whose PROGRESS moved since it was adopted (a live writer that
  could not claim it: it is let go instead). Returns the indices deleted."""
  out = []
  for q, a in list(held.items()):
    if a.floor is None or watermark is None or watermark <= a.floor:
      continue
    if a.store.read_progress() != a.seen:
      logger.warning("the adopted store %s changed since it was adopted: a process writes "
                     "to it; it is kept", a.store.root)
      drop(held, q)
      continue
    root = a.store.root
    a.store.close()
    shutil.rmtree(root, ignore_errors=True)
    unlock(a.fd)
    del held[q]
    out.append(q)
    logger.info("deleted the adopted store of host %d (%s): step %d is held by every store",
                q, root, watermark)
  return out


# ------------------------------------------------------------- sending home
def payload(store: HostStore, run_id: str) -> tuple[list[np.ndarray], int]:
  """A store's valid snapshots as segments to send (a header, then each
  snapshot's slot bytes, views of its files) and their total length; a
  snapshot that cannot be read is left out (the receiver's checksums judge
  the rest). Never raises: a failure here would leave the others waiting."""
  rows: list[tuple[Manifest, np.ndarray]] = []
  try:
    valid = _planner.fence([m for m in store.manifests() if m.run_id == run_id])
  except Exception as e:  # noqa: BLE001 - nothing to send, said so
    logger.warning("the adopted store %s cannot be listed: %s", store.root, e)
    valid = []
  for m in valid:
    try:
      rows.append((m, store.read_buffer(m.slot, slot_bytes(m))))
    except Exception as e:  # noqa: BLE001 - that snapshot stays behind
      logger.warning("step %d of the adopted store %s is left behind: %s", m.step,
                     store.root, e)
  views = [v for _, v in rows]
  header = msgpack.packb([[encode(m), int(v.nbytes)] for m, v in rows])
  head = np.frombuffer(len(header).to_bytes(8, "little") + header, np.uint8)
  segments = [head, *views]
  return segments, sum(int(s.nbytes) for s in segments)


def chunk(segments: list[np.ndarray], at: int, n: int) -> np.ndarray:
  """Bytes ``at:at + n`` of the segments end to end."""
  out = np.empty(n, np.uint8)
  filled, start = 0, 0
  for s in segments:
    end = start + s.nbytes
    if end > at and start < at + n:
      lo, hi = max(at, start) - start, min(at + n, end) - start
      out[filled:filled + hi - lo] = s.reshape(-1)[lo:hi]
      filled += hi - lo
    start = end
  return out[:filled]


def unpack(data: np.ndarray) -> list[tuple[Manifest, np.ndarray]]:
  """The snapshots :func:`payload` sent: (manifest, slot bytes) each."""
  n = int.from_bytes(data[:8].tobytes(), "little")
  rows = msgpack.unpackb(data[8:8 + n].tobytes())
  out, at = [], 8 + n
  for blob, size in rows:
    out.append((decode(blob), data[at:at + size]))
    at += size
  return out


def receive(own: HostStore, data: np.ndarray) -> tuple[list[int], list[str]]:
  """Writes each snapshot of ``data`` (:func:`payload`'s) into ``own`` (a
  slot of its own, the manifest last); those it already holds are skipped.
  Returns (the steps written, why any was not). Never raises: the job's
  other processes go on with their collectives."""
  try:
    got = unpack(data)
    have = {(m.step, m.incarnation) for m in own.manifests()}
  except Exception as e:  # noqa: BLE001 - nothing written, said so
    return [], [f"the snapshots sent home could not be read: {e}"]
  out, why = [], []
  for m, part in sorted(got, key=lambda x: x[0].step):
    if (m.step, m.incarnation) in have or m.store != own.host:
      continue
    try:
      slot = own.reserve(m.step, int(part.nbytes))
      own.slot_buffer(slot)[:part.nbytes] = part
      own.commit(dataclasses.replace(m, slot=slot))
    except Exception as e:  # noqa: BLE001 - this one not written (its checksums judge the rest)
      why.append(f"step {m.step} sent home was not written: {e}")
      continue
    out.append(m.step)
  return out, why


def repatriate(coll: Collective, own: HostStore, held: dict[int, Adopted], run_id: str,
               refused: set[int]) -> list[str]:
  """Sends the snapshots of every adopted store to the process whose index
  it carries, and writes those of this process's own index that others
  adopted into ``own``. Collective: every process calls it, holding
  adopted stores or not. Where two machines hold a store of one index, the
  one with the newer step is sent. Returns notes of what moved here."""
  n, me = coll.num_hosts, coll.host  # (an index >= n: a host the job no longer has)
  sending: dict[int, list[np.ndarray]] = {}
  offers = []
  for q, a in sorted(held.items()):
    if a.sent or q >= n:
      continue
    sending[q], size = payload(a.store, run_id)
    offers.append([q, *a.newest, size])
  # (every process sends a blob, empty list or not: who takes part is who sent)
  blobs = gather_blobs(coll, msgpack.packb(offers))
  here = {p for p, blob in enumerate(blobs) if blob}
  # index -> (holder, (incarnation, step) of its newest snapshot, bytes)
  chosen: dict[int, tuple[int, tuple[int, int], int]] = {}
  for p in sorted(here):
    for q, inc, step, size in msgpack.unpackb(blobs[p]):
      if q != p and q in here and (q not in chosen or (inc, step) > chosen[q][1]):
        chosen[q] = (p, (inc, step), size)
  notes = []
  for round_ in _rounds(sorted((p, q, size) for q, (p, _, size) in chosen.items())):
    got = _permute_round(coll, round_, sending)
    if got is not None:
      p = next(p for p, q, _ in round_ if q == me)
      steps, why = receive(own, got)
      notes.append(f"the snapshots of steps {steps} of host {me}'s store came from host {p}, "
                   "which found them on its machine")
      notes.extend(why)
      logger.info("; ".join(notes[-1 - len(why):]))
  for q in list(held):  # those sent go once a newer step is held; the rest are let go
    if chosen.get(q, (None,))[0] == me:
      held[q].sent = True
    elif not held[q].sent:  # (not sent: no host of that index here, or a newer copy won)
      drop(held, q)
      refused.add(q)
  return notes


def _rounds(moves: list[tuple[int, int, int]]) -> list[list[tuple[int, int, int]]]:
  """``moves`` (holder, index, bytes) in rounds where each process sends one
  and receives one at most (a permute each); the same on every process."""
  out = []
  while moves:
    srcs: set[int] = set()
    dsts: set[int] = set()
    this, rest = [], []
    for p, q, size in moves:
      if p in srcs or q in dsts:
        rest.append((p, q, size))
      else:
        srcs.add(p)
        dsts.add(q)
        this.append((p, q, size))
    out.append(this)
    moves = rest
  return out


def _permute_round(coll: Collective, round_: list[tuple[int, int, int]],
                   sending: Mapping[int, list[np.ndarray]]) -> np.ndarray | None:
  """One round's stores, in chunks of at most :data:`CHUNK_BYTES`: the bytes
  this process received (None if it receives none)."""
  me = coll.host
  pairs = [(p, q) for p, q, _ in round_]
  width = max(1, min(CHUNK_BYTES, max(size for _, _, size in round_)))
  out_q = next(((q, size) for p, q, size in round_ if p == me), None)
  in_size = next((size for _, q, size in round_ if q == me), None)
  recv = np.empty(in_size, np.uint8) if in_size is not None else None
  for at in range(0, max(size for _, _, size in round_), width):
    mine = (chunk(sending[out_q[0]], at, min(width, out_q[1] - at))
            if out_q is not None and at < out_q[1] else None)
    got = coll.permute(pairs, mine, width)
    if recv is not None and got is not None and at < recv.size:
      n = min(width, recv.size - at)
      recv[at:at + n] = got[:n]
  return recv
