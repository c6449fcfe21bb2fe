"""Ending a CPU collective that waits on a dead peer (gloo).

On GPU, JAX aborts the NCCL communicators when a process fails. XLA's CPU
communicators cannot be aborted (jaxlib: "Aborting communicator is not
implemented"), and a survivor blocked in a gloo collective whose data was to
come through the dead process waits out the whole collective timeout,
where a survivor that meets the death at a barrier sees it at once.

Gloo fails a collective at once when one of its connections closes. So each
process of an in-place job runs a :class:`Watchdog`: a thread that beats in
the coordination service every ``period_s`` (with a token of its process),
and, when this process has been inside one ``live()`` block for longer than
``after_s`` while some peer's beat is older than ``after_s`` (or for
``2 * period_s`` while a peer's token changed: its replacement is beating,
so it died), shuts down this process's gloo connections:
the ones accepted by its gloo listener and the ones to its peers' listeners
(each beat carries its process's listener ports). The blocked collective
raises ``Connection closed by peer`` and the step's failure path runs.

Every communicator the process holds is spent then, and so are its peers'
communicators with it. :class:`snapstore.recovery.InPlace` shuts them on
every failed step anyway (a communicator that failed mid-operation would
meet leftover bytes), and never uses a device group of an earlier order
again.

Beats compare wall clocks across processes: hosts must agree on the time to
well under ``after_s`` (NTP does). Linux only (``/proc``); elsewhere the
watchdog beats but cannot shut anything down, and the collective timeout
stays the bound.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping, Set as AbstractSet
from typing import Any

logger = logging.getLogger(__name__)

BEATS = "snapstore/beats"  # in the coordination service: process -> its last beat
_LISTEN = "0A"
_running: Watchdog | None = None  # this process's beating watchdog


def running() -> Watchdog | None:
  """This process's watchdog while it beats (CPU in-place jobs), else None."""
  return _running


class Silence:
  """Which processes of the membership are gone, judged from outside a
  ``live()`` block (a wait that is no collective, e.g. an Orbax barrier in
  the service).

  A process is gone when its beat's token differs from the one it had when
  the membership formed (``members``: it died and a replacement beats under
  its id), or when its last beat is older than ``after_s`` by this
  process's clock and has not changed here for ``after_s / 2`` (it hangs,
  or died and nothing beats for it yet): as the watchdog judges it, so
  clock skew alone cannot make a process gone."""

  def __init__(self, client: Any, after_s: float,
               members: Mapping[int, tuple[str, float]]) -> None:
    self._client, self.after_s, self._members = client, after_s, members
    self._seen: dict[int, tuple[float, float]] = {}  # process -> (its beat, when it changed)

  def of(self, processes: AbstractSet[int], *, one: bool = False) -> dict[int, float]:
    """The gone ones of ``processes``, each with the time of the last beat
    of the process that is gone (those that never beat are not gone).
    ``one``: read just that one's beat (``processes`` has one member), not
    every process's."""
    if one:
      (p,) = processes
      try:
        rows = [(f"{BEATS}/{p}", self._client.key_value_try_get(f"{BEATS}/{p}"))]
      except Exception:  # noqa: BLE001  (NOT_FOUND: it never beat)
        return {}
    else:
      rows = self._client.key_value_dir_get(BEATS)
    now, mono, out = time.time(), time.monotonic(), {}
    for key, raw in rows:
      p = int(key.rsplit("/", 1)[-1])
      if p not in processes:
        continue
      beat = json.loads(raw)
      t, token = float(beat["t"]), beat["process"]
      was = self._members.get(p)
      if was is not None and was[0] != token:
        out[p] = was[1]  # replaced: it died after its beat at the membership's start
        continue
      if self._seen.get(p, (None,))[0] != t:
        self._seen[p] = (t, mono)
      if now - t > self.after_s and mono - self._seen[p][1] >= self.after_s / 2:
        out[p] = t
    return out


@dataclasses.dataclass(frozen=True)
class Connection:
  fd: int
  inode: int
  local_port: int
  remote_port: int
  state: str  # /proc/net/tcp's hex state


def connections() -> list[Connection]:
  """This process's TCP sockets (IPv4 and IPv6), from ``/proc``; [] elsewhere."""
  fds: dict[str, int] = {}
  try:
    names = os.listdir("/proc/self/fd")
  except OSError:
    return []
  for name in names:
    with contextlib.suppress(OSError):
      target = os.readlink(f"/proc/self/fd/{name}")
      if target.startswith("socket:["):
        fds[target[8:-1]] = int(name)
  out = []
  for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
    try:
      with open(table) as f:
        rows = f.read().splitlines()[1:]
    except OSError:
      continue
    for row in rows:
      cols = row.split()
      if len(cols) > 9 and cols[9] in fds:
        out.append(Connection(fds[cols[9]], int(cols[9]), int(cols[1].rsplit(":", 1)[1], 16),
                              int(cols[2].rsplit(":", 1)[1], 16), cols[3]))
  return out


def listening_ports() -> set[int]:
  return {c.local_port for c in connections() if c.state == _LISTEN}


def shut_down(own_ports: AbstractSet[int], peer_ports: AbstractSet[int], *,
              spare: AbstractSet[int] = frozenset()) -> int:
  """Shuts down every connected socket of this process accepted on one of
  ``own_ports`` or connected to one of ``peer_ports``, but none with either
  end on a ``spare`` port (the coordination service's); returns how many."""
  done = 0
  for c in connections():
    if (c.state == _LISTEN or not (c.local_port in own_ports or c.remote_port in peer_ports)
        or spare & {c.local_port, c.remote_port}):
      continue
    try:
      fd = os.dup(c.fd)
    except OSError:
      continue  # closed since it was listed
    if os.fstat(fd).st_ino != c.inode:  # the number was reused since: not ours to shut
      os.close(fd)
      continue
    s = socket.socket(fileno=fd)
    try:
      s.shutdown(socket.SHUT_RDWR)  # acts on the socket, not on this fd: gloo sees it
      done += 1
    except OSError:
      pass  # not connected any more
    finally:
      s.close()
  return done


class Watchdog:
  """Beats for this process and ends its collectives when a peer went silent
  while this process is stuck in a block (module docstring).

  ``in_block()`` returns the ``time.monotonic()`` at which this process
  entered its current ``live()`` block, or None outside one.
  ``gloo_ports``: this process's gloo listener ports.
  """

  def __init__(self, client: Any, process_id: int, processes: int, *, after_s: float,
               in_block: Callable[[], float | None], gloo_ports: set[int],
               spare_ports: AbstractSet[int] = frozenset(), period_s: float = 0.25) -> None:
    if not after_s > period_s:
      raise ValueError(f"after_s ({after_s}) must exceed the beat period ({period_s})")
    self._client, self._id, self._processes = client, process_id, processes
    self.after_s, self.period_s = after_s, period_s
    self.replaced_after_s = min(after_s, 2 * period_s)
    self._in_block, self.gloo_ports = in_block, set(gloo_ports)
    self.spare_ports = set(spare_ports)
    self._changed: dict[str, tuple[Any, float]] = {}  # peer -> (its beat, when it changed)
    self._fired_for: float | None = None
    self._started, self._started_mono = time.time(), time.monotonic()
    self._failing = ""
    self.aborts: list[dict[str, Any]] = []
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, name="snapstore-watchdog", daemon=True)
    # A token per process: a replacement beats under the same id.
    self._beat = {"ports": sorted(self.gloo_ports),
                  "process": f"{socket.gethostname()}/{os.getpid()}/{time.time_ns()}"}
    self._block: tuple[float | None, dict[str, str]] = (None, {})
    self._peer_ports: set[int] = set()
    #: process -> (its beat token, beat time) when the current membership formed
    self.members: dict[int, tuple[str, float]] = {}
    #: the processes of the current membership (None: every one): a job
    #: running on fewer hosts is not stuck on the one it left behind
    self.watched: AbstractSet[int] | None = None

  def start(self) -> Watchdog:
    """Starts beating and watching (:meth:`abort` works without it). The
    first beat is written before this returns: a replacement's new token is
    in the service before it can join a membership, so its peers' blocks
    start out knowing it (else they would take it for a new death)."""
    global _running
    self._write_beat()
    self._thread.start()
    _running = self
    return self

  def stop(self) -> None:
    global _running
    if _running is self:
      _running = None
    self._stop.set()
    if self._thread.is_alive():
      self._thread.join(timeout=5 * self.period_s + 5)  # an RPC may hang: do not

  def _run(self) -> None:
    while not self._stop.wait(self.period_s):
      try:
        self.check()
        self._failing = ""
      except Exception as e:  # noqa: BLE001  (the service is gone, or leaving)
        if repr(e) != self._failing:  # once per kind, not every beat
          logger.warning("watchdog of process %d: %r", self._id, e)
          self._failing = repr(e)

  def check(self) -> None:
    """One beat, and the stuck-and-gone test; the thread calls it."""
    self._write_beat()
    since = self._in_block()
    if since is None or since == self._fired_for:
      return
    stuck = time.monotonic() - since
    if stuck < self.replaced_after_s and self._block[0] == since:
      return  # a block that runs its usual course reads nothing
    now, peer_ports = time.time(), set()
    last = dict.fromkeys(map(str, range(self._processes)), self._started)  # none yet: since
    tokens: dict[str, str] = {}                                  # this watchdog started
    mono = time.monotonic()
    watched = self.watched
    if watched is not None:
      last = {p: t for p, t in last.items() if int(p) in watched}
    for key, raw in self._client.key_value_dir_get(BEATS):
      beat, peer = json.loads(raw), key.rsplit("/", 1)[-1]
      if watched is not None and int(peer) not in watched:
        continue
      last[peer], tokens[peer] = float(beat["t"]), beat["process"]
      peer_ports.update(beat["ports"])
      if self._changed.get(peer, (None,))[0] != beat["t"]:
        self._changed[peer] = (beat["t"], mono)
    self._peer_ports = peer_ports  # for abort(), from failed() too
    if self._block[0] != since:  # who was in the job when this block began
      self._block = (since, tokens)
      return
    # A replacement beats under its predecessor's id: a new token proves the
    # death, so it needs no long wait; silence might be a stall, so it does.
    gone: dict[str, str | float] = {
        peer: "replaced" for peer, token in tokens.items()
        if peer != str(self._id) and self._block[1].get(peer, token) != token}
    if stuck >= self.after_s:  # old by its clock, and unchanged here for a while:
      gone.update({peer: round(now - t, 2) for peer, t in last.items()  # clock skew alone
                   if peer != str(self._id) and peer not in gone     # cannot fire it
                   and now - t > self.after_s
                   and mono - self._changed.get(peer, (None, self._started_mono))[1]
                   >= self.after_s / 2})
    if not gone:
      return
    self._fired_for = since
    self.abort(f"stuck {stuck:.1f} s in a step while process(es) {gone} are gone")

  def remember_members(self) -> None:
    """Notes every process's beat token now: a new membership formed (each
    member beat before it joined), for :class:`Silence` to tell a
    replacement's beat from its predecessor's."""
    self.members = {int(k.rsplit("/", 1)[-1]): (b["process"], float(b["t"]))
                    for k, b in ((k, json.loads(raw))
                                 for k, raw in self._client.key_value_dir_get(BEATS))}

  def _write_beat(self) -> None:
    self._client.key_value_set(f"{BEATS}/{self._id}",
                               json.dumps({**self._beat, "t": time.time()}),
                               allow_overwrite=True)

  def abort(self, why: str) -> None:
    """Shuts down this process's gloo connections: every collective waiting
    on one fails now, and every communicator is spent."""
    n = shut_down(self.gloo_ports, self._peer_ports - self.gloo_ports,
                  spare=self.spare_ports)
    self.aborts.append({"at": time.time(), "why": why, "sockets": n})
    logger.warning("process %d: %s; shut down %d gloo connections", self._id, why, n)
