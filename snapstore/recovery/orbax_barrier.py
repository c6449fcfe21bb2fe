"""Orbax's async-commit barrier, made to give up when the job's members change.

An async Orbax save ends in a background thread that waits at a barrier of
every process (``async_write_complete``, then ``async_commit_complete``)
before process 0 commits the checkpoint. In a recoverable job
(:mod:`snapstore.recovery`) a process that dies before it gets there is
replaced under the same id, and the replacement never saved that step: the
coordination service's barrier then waits for it until Orbax's timeout (20
minutes), the survivors' next save waits for that thread, and the
replacement waits for them in the next save's first barrier. The job hangs.

:class:`Barrier` is Orbax's barrier function for one ``CheckpointManager``,
in the service's key-value store: every process writes its arrival, process
0 sees them all and writes ``done``, and every process waits for ``done`` in
one-second slices. A manager is bound to the job's membership when it is
made (:func:`snapstore._devices.membership`, set by ``InPlace.live()``); once
a process was replaced, each of its barriers raises :class:`Abandoned`, a
waiting one within a slice, so its save is never committed (a process may
have died before it wrote its shards) and its threads end. ``OrbaxTier``
then waits for them, drops the error and makes a new manager, on every
process at the same point, and the job goes on with the next save.

Orbax's other process syncs (``sync_global_processes``: the start and end
of every save, restores, directory creation), which it would hold in the
service's own barriers, go through :func:`install` to this process's
:class:`Barrier` of the current membership, on the main thread while a
watchdog beats: those barriers in the service do not end when a process
hangs or is replaced, and a survivor waiting in one would never reach the
step's failure path.

A process that hangs (alive, silent) before it reaches a barrier of a save
holds the others there, outside any collective, so the watchdog's abort
(:mod:`snapstore.recovery.watchdog`) cannot free them. While a watchdog beats, a barrier that
has waited the watchdog's ``after_s`` reads, once a second, the ``live()``
block's failure key (a process whose step failed will not come:
``PeerFailed``) and the beats: process 0 those of the processes that did
not arrive, the others process 0's and a ``failed`` key that process 0
writes. A process that is gone (:class:`snapstore.recovery.watchdog.Silence`: replaced, or
silent for twice ``after_s``, since the verdict fences it) ends the barrier
on every process with :class:`snapstore.recovery.MembersMissing` naming
it: the training loop reports it, the supervisor fences and replaces it,
and the job heals.
"""

from __future__ import annotations

import collections
import functools
import json
import threading
import time
from typing import Any

import jax

from .. import _devices, _jax_private
from ..errors import MembersMissing, PeerFailed
from . import watchdog

NAMESPACE = "snapstore/orbax"
SLICE_MS = 1000  # how often a waiting process checks the membership
POLL_S = 0.1  # how often process 0 counts the arrivals, at most (from 2 ms, doubling)
BEAT_CHECK_S = 1.0  # how often a long wait reads the beats
KEEP_S = 60.0  # how long process 0 keeps a completed barrier's keys (a waiter reads
               # `done` within a slice of it being written)


class Abandoned(RuntimeError):
  """A process of the save was replaced while the save waited: the save is
  not committed."""


def _client() -> Any:
  client = _jax_private.client()
  if client is None:
    raise RuntimeError("the Orbax barrier needs jax.distributed (snapstore.recovery)")
  return client


class Barrier:
  """Orbax's ``BarrierSyncFn`` for one ``CheckpointManager``, made in one
  membership: the n-th call with a key meets the n-th call of the other
  processes' managers of that membership. Once the membership changes,
  every call raises :class:`Abandoned` (a waiting one within a second), so
  the manager's threads end; ``OrbaxTier`` then makes a new manager, on
  every process alike."""

  def __init__(self, scope: str = "") -> None:
    self.members = _devices.membership()
    # who meets here: the current members (all processes but while the job
    # runs short); the lowest of them leads, as process 0 does in full
    self.processes = _devices.processes() or tuple(range(jax.process_count()))
    self._scope = f"{scope}/" if scope else ""
    self._lock = threading.Lock()
    self._uses: dict[str, int] = {}
    self._completed: collections.deque[tuple[str, float]] = collections.deque()  # process 0

  def stale(self) -> bool:
    return _devices.membership() != self.members

  def __call__(self, *, key: str, timeout_ms: int) -> None:
    """Returns once every process called it with ``key``. Raises
    :class:`Abandoned` when the membership changed,
    :class:`snapstore.recovery.MembersMissing` when a process that did not
    arrive is gone, :class:`snapstore.recovery.PeerFailed` when a process's
    step failed in this ``live()`` block (module doc), ``TimeoutError``
    after ``timeout_ms``, naming the processes that did not arrive."""
    if self.stale():
      raise Abandoned(f"Orbax barrier {key!r}: a process was replaced since this save "
                      "began; the save is not committed")
    client = _client()
    with self._lock:
      n = self._uses[key] = self._uses.get(key, 0) + 1
    where = f"{NAMESPACE}/{self.members or 'first'}/{self._scope}{key}/{n}"
    me, lead = jax.process_index(), self.processes[0]
    client.key_value_set(f"{where}/in/{me}", "1")
    began = time.monotonic()
    deadline = began + timeout_ms / 1000
    dog = watchdog.running()
    # (a verdict here fences the process: twice the silence of a watchdog abort)
    silence = (watchdog.Silence(client, 2 * dog.after_s, dog.members)
               if dog is not None else None)
    checked, poll = began, 0.002
    while True:
      arrived: set[int] = set()
      if me == lead:
        arrived = {int(k.rsplit("/", 1)[-1])
                   for k, _ in client.key_value_dir_get(f"{where}/in/")}
        if arrived >= set(self.processes):
          client.key_value_set(f"{where}/done", "1")
          now = time.monotonic()
          with self._lock:  # a waiter of one completed KEEP_S ago has long seen it
            self._completed.append((where, now))
            while self._completed and now - self._completed[0][1] > KEEP_S:
              client.key_value_delete(self._completed.popleft()[0])
          return
        time.sleep(poll)
        poll = min(POLL_S, 2 * poll)
      else:
        try:
          client.blocking_key_value_get(f"{where}/done", SLICE_MS)
          return
        except jax.errors.JaxRuntimeError:
          pass  # (DEADLINE_EXCEEDED: not yet; anything else ends at the deadline)
      if self.stale():
        if me == lead:
          client.key_value_delete(where)
        raise Abandoned(f"Orbax barrier {key!r}: a process was replaced while this save "
                        "waited; the save is not committed")
      now = time.monotonic()
      if (silence is not None and now - began >= silence.after_s / 2
          and now - checked >= BEAT_CHECK_S):
        checked = now
        self._give_up_if_gone(client, where, key, me, lead, arrived, silence)
      if time.monotonic() > deadline:
        late = (sorted(set(self.processes) - arrived) if me == lead
                else f"(process {lead} knows which)")
        raise TimeoutError(f"Orbax barrier {key!r}: process(es) {late} did not arrive in "
                           f"{timeout_ms / 1000:.0f} s")

  def _give_up_if_gone(self, client: Any, where: str, key: str, me: int, lead: int,
                       arrived: set[int], silence: watchdog.Silence) -> None:
    """Raises ``MembersMissing`` if a process this barrier waits for is gone
    (the lead judges those that did not arrive, and tells the rest under
    ``{where}/failed``; the others judge the lead), ``PeerFailed`` if a
    process's step failed in this ``live()`` block (it will not come)."""
    who = _devices.failed_in_block(client)
    if who is not None:
      raise PeerFailed(f"process {who} failed this step while the others waited at Orbax "
                       f"barrier {key!r}")
    if me == lead:
      gone = silence.of(set(self.processes) - arrived)
      if gone:
        client.key_value_set(f"{where}/failed", json.dumps(sorted(gone.items())),
                             allow_overwrite=True)
    else:
      try:
        gone = dict(json.loads(client.key_value_try_get(f"{where}/failed")))
      except Exception:  # noqa: BLE001  (NOT_FOUND: none yet)
        gone = silence.of({lead}, one=True)
    if gone:
      raise MembersMissing(f"Orbax barrier {key!r}: process(es) {sorted(gone)} are gone "
                           "(hung, or replaced) and did not arrive",
                           tuple(sorted(gone)), since=min(gone.values()))


_sync: dict[str | None, Barrier] = {}  # the current membership -> its barrier of Orbax's syncs
_sync_lock = threading.Lock()


def _sync_barrier(original: Any, processes: Any, *, key: str, timeout_ms: int) -> None:
  """Orbax's ``sync_global_processes`` over the current members (every
  process, or those the job runs on while short): on the main thread
  while a watchdog beats (CPU), in the current membership's
  :class:`Barrier` (a new one per membership, its counts fresh on every
  process alike); elsewhere Orbax's own (``original``), over the members:
  a background thread may outlive its membership, and its late call would
  miscount the next one's, and without beats a gone process cannot be told."""
  if watchdog.running() is None or threading.current_thread() is not threading.main_thread():
    if processes is None and _devices.processes() is not None:
      processes = set(_devices.processes() or ())
    original(processes=processes)(key=key, timeout_ms=timeout_ms)
    return
  name = _devices.membership()
  with _sync_lock:
    barrier = _sync.get(name)
    if barrier is None:
      _sync.clear()
      barrier = _sync[name] = Barrier("sync")
  barrier(key=key, timeout_ms=timeout_ms)


def install() -> None:
  """Routes Orbax's process syncs over all processes, or over the current
  members, in this process through :func:`_sync_barrier` (another subset
  keeps Orbax's own). For recoverable jobs
  (``snapstore.recovery.initialize``); idempotent."""
  try:
    from orbax.checkpoint._src.multihost import multihost
  except ImportError:  # (no Orbax: nothing to route)
    return
  original = multihost.get_barrier_sync_fn
  if getattr(original, "snapstore", False):
    return

  def get_barrier_sync_fn(*, processes: Any = None) -> Any:
    members = _devices.processes()
    if jax.process_count() > 1 and (
        processes is None or (members is not None and set(processes) == set(members))):
      return functools.partial(_sync_barrier, original, processes)
    return original(processes=processes)

  get_barrier_sync_fn.snapstore = True  # type: ignore[attr-defined]
  multihost.get_barrier_sync_fn = get_barrier_sync_fn
