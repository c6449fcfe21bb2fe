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
made (:func:`snapstore._group.membership`, set by ``InPlace.live()``); once
a process was replaced, each of its barriers raises :class:`Abandoned`, a
waiting one within a slice, so its save is never committed (a process may
have died before it wrote its shards) and its threads end. ``OrbaxTier``
then waits for them, drops the error and makes a new manager, on every
process at the same point, and the job goes on with the next save.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import jax

from . import _group

NAMESPACE = "snapstore/orbax"
SLICE_MS = 1000  # how often a waiting process checks the membership
POLL_S = 0.1  # how often process 0 counts the arrivals


class Abandoned(RuntimeError):
  """A process of the save was replaced while the save waited: the save is
  not committed."""


def _client() -> Any:
  from jax._src import distributed
  client = distributed.global_state.client
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

  def __init__(self) -> None:
    self.members = _group.membership()
    self._lock = threading.Lock()
    self._uses: dict[str, int] = {}
    self._previous: list[str] = []  # the last barrier process 0 completed: garbage at the next

  def stale(self) -> bool:
    return _group.membership() != self.members

  def __call__(self, *, key: str, timeout_ms: int) -> None:
    """Returns once every process called it with ``key``. Raises
    :class:`Abandoned` when the membership changed, ``TimeoutError`` after
    ``timeout_ms``, naming the processes that did not arrive."""
    if self.stale():
      raise Abandoned(f"Orbax barrier {key!r}: a process was replaced since this save "
                      "began; the save is not committed")
    client = _client()
    with self._lock:
      n = self._uses[key] = self._uses.get(key, 0) + 1
    where = f"{NAMESPACE}/{self.members or 'first'}/{key}/{n}"
    me, count = jax.process_index(), jax.process_count()
    client.key_value_set(f"{where}/in/{me}", "1")
    deadline = time.monotonic() + timeout_ms / 1000
    while True:
      arrived: set[int] = set()
      if me == 0:
        arrived = {int(k.rsplit("/", 1)[-1])
                   for k, _ in client.key_value_dir_get(f"{where}/in/")}
        if len(arrived) >= count:
          client.key_value_set(f"{where}/done", "1")
          with self._lock:  # every process is past the one before
            for old in self._previous:
              client.key_value_delete(old)
            self._previous[:] = [where]
          return
        time.sleep(POLL_S)
      else:
        try:
          client.blocking_key_value_get(f"{where}/done", SLICE_MS)
          return
        except jax.errors.JaxRuntimeError:
          pass  # (DEADLINE_EXCEEDED: not yet; anything else ends at the deadline)
      if self.stale():
        if me == 0:
          client.key_value_delete(where)
        raise Abandoned(f"Orbax barrier {key!r}: a process was replaced while this save "
                        "waited; the save is not committed")
      if time.monotonic() > deadline:
        late = sorted(set(range(count)) - arrived) if me == 0 else "(process 0 knows which)"
        raise TimeoutError(f"Orbax barrier {key!r}: process(es) {late} did not arrive in "
                           f"{timeout_ms / 1000:.0f} s")
