"""The in-place loop helper: survivors keep running while the job heals.

:class:`InPlace` is what a training loop wraps each step in (see
:mod:`snapstore.recovery`): ``live()`` yields the devices of the current
membership in the agreed order, agrees at its exit whether every process
finished the step, and after a failure waits for the replacement (or, under
a :class:`ResizePolicy`, goes on with the live processes). The coordination
service's key-value store carries the protocol: the orders used, the process
whose step failed, resizes and departures.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import time
from collections.abc import Iterator
from typing import Any

import jax

from .. import _devices, _jax_private, _reports
from .._devices import failed_in_block as failed_in_block
from ..errors import MembersMissing, PeerFailed, RestartRequired
from . import watchdog
from .service import gloo_ports, service_ports

logger = logging.getLogger(__name__)

_ORDERS = "snapstore/orders"  # in the coordination service: every order used
_FAILED = "snapstore/failed"  # membership/block -> the process whose step failed
_LEFT = "snapstore/left"  # processes that reached close() and disconnected
_DONE = "snapstore/closing"  # processes that reached close()
DEFAULT_ABORT_AFTER_S = 3.0

MIN_HOSTS_ENV = "SNAPSTORE_MIN_HOSTS"  # InPlace's default min_hosts (launch --min-hosts)
REPLACEMENT_WAIT_ENV = "SNAPSTORE_REPLACEMENT_WAIT_S"  # ... and replacement_wait_s
_RESIZE = "snapstore/resize"  # membership -> the first block that runs without the missing


@dataclasses.dataclass(frozen=True)
class ResizePolicy:
  """When a job goes on with fewer processes than it started with.

  ``min_hosts`` None: never (survivors wait for a replacement, then the job
  restarts in full). Else, while at least ``min_hosts`` processes are live,
  the survivors wait ``replacement_wait_s`` for a replacement (0: not at
  all) and then go on without the missing ones: ``live()`` yields the live
  devices only, ``changed`` is set, and the state is restored onto the
  smaller mesh. A process that joins later (a replacement) is taken in at
  the next block: ``changed`` again, and the job is back to more hosts."""

  min_hosts: int | None = None
  replacement_wait_s: float = 0.0

  def __post_init__(self) -> None:
    if self.min_hosts is not None and self.min_hosts < 1:
      raise ValueError(f"min_hosts must be >= 1 or None, got {self.min_hosts!r}")
    if not 0.0 <= self.replacement_wait_s < float("inf"):
      raise ValueError("replacement_wait_s must be a finite number of seconds >= 0, got "
                       f"{self.replacement_wait_s!r}")

  @classmethod
  def from_env(cls, min_hosts: int | None, replacement_wait_s: float | None, *,
               hosts: int) -> ResizePolicy:
    """The policy given, else ``$SNAPSTORE_MIN_HOSTS`` and
    ``$SNAPSTORE_REPLACEMENT_WAIT_S`` (what ``snapstore launch --min-hosts``
    sets). ``min_hosts`` >= ``hosts`` is None: the job never runs short."""
    if min_hosts is None:
      raw = os.environ.get(MIN_HOSTS_ENV, "")
      if raw:
        if not raw.isdigit():
          raise ValueError(f"${MIN_HOSTS_ENV} must be a whole number, got {raw!r}")
        min_hosts = int(raw)
    if replacement_wait_s is None:
      raw = os.environ.get(REPLACEMENT_WAIT_ENV, "0")
      try:
        replacement_wait_s = float(raw)
      except ValueError:
        raise ValueError(f"${REPLACEMENT_WAIT_ENV} must be seconds, got {raw!r}") from None
    if min_hosts is not None and min_hosts >= hosts:
      min_hosts = None
    return cls(min_hosts, replacement_wait_s)


@dataclasses.dataclass
class Resize:
  """A membership of other processes than the last: ``kind`` "shrink" (the
  job goes on without ``lost``), "grow" (``joined`` came back) or "reform"
  (both); ``failed_at``: when the step that found it failed (or when it
  was seen, for a join); ``formed_at``: when the new membership's first
  block began; ``first_step_at``: when its first block after the restore
  ended (the first step on the new mesh)."""

  kind: str
  failed_at: float
  formed_at: float
  before: list[int]
  after: list[int]
  lost: list[int]
  joined: list[int]
  full: bool
  first_step_at: float | None = None

  def as_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


@dataclasses.dataclass
class Recovery:
  """One failure seen by this process and what followed."""

  error: str
  failed_at: float
  healed_at: float | None = None
  generation: int | None = None

  def as_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


class InPlace:
  """The membership of a multi-controller job, step by step (see the module doc).

  Args:
    max_failures: failed steps in a row on one membership (the job healed
      and failed again with the same processes) after which :meth:`failed`
      raises :class:`RestartRequired`. A failure on a new membership (a
      process died and was replaced) starts the count again: deaths are
      bounded by the supervisor's ``max_replacements``.
    wait_timeout_s: how long to wait for a replacement before giving up the
      same way (while fewer than ``min_hosts`` are live).
    min_hosts, replacement_wait_s: when the job goes on with fewer
      processes (:class:`ResizePolicy`); default from the environment,
      else never.
    abort_after_s (CPU): when this process has been inside one ``live()``
      block this long and a peer has been silent this long, a watchdog shuts
      down this process's gloo connections, so that a collective waiting on
      the dead peer fails now instead of at the collective timeout
      (:mod:`snapstore.recovery.watchdog`). It must exceed the longest a live process can go
      without running a Python thread. None: off.
  """

  def __init__(self, *, max_failures: int = 3, wait_timeout_s: float = 120.0,
               poll_s: float = 0.05, abort_after_s: float | None = DEFAULT_ABORT_AFTER_S,
               min_hosts: int | None = None, replacement_wait_s: float | None = None):
    from jax.experimental.multihost_utils import ProcessFailureError, live_devices
    client = _jax_private.client()
    if client is None:
      raise RuntimeError("join the job first (snapstore.recovery.initialize)")
    self._client = client
    self._live_devices = live_devices
    self.FAILURES: tuple[type[BaseException], ...] = (
        ProcessFailureError, MembersMissing, PeerFailed, jax.errors.JaxRuntimeError)
    self.max_failures, self.wait_timeout_s, self.poll_s = max_failures, wait_timeout_s, poll_s
    self._all = jax.devices()
    self.resize = ResizePolicy.from_env(min_hosts, replacement_wait_s,
                                        hosts=jax.process_count())
    self._shrunk: tuple[tuple[int, int], ...] | None = None  # the membership that may run short
    self._missing_since: tuple[tuple[tuple[int, int], ...], float] | None = None
    self._hosts: tuple[int, ...] = tuple(range(jax.process_count()))
    self.resizes: list[Resize] = []
    self._formed_at = time.time()  # when the current membership formed
    self._key: tuple[tuple[int, int], ...] | None = None
    self._entered: tuple[tuple[int, int], ...] | None = None
    self._block = 0
    self._dirty = True
    self._in_a_row = 0
    self._failed_key: tuple[tuple[int, int], ...] | None = None
    self._waiting_since: float | None = None
    self._body_failed = False  # the last failure came from inside a block
    self.generation = 0
    self.changed = False
    self.devices: list[jax.Device] = _devices.devices()
    self.recoveries: list[Recovery] = []
    self._block_since: float | None = None
    self._order_name: str | None = None  # the order of this membership, by name
    self._spent: set[str] = set()  # orders this process failed on: never again
    self.watchdog: watchdog.Watchdog | None = None
    if abort_after_s is not None and not abort_after_s > 0:
      raise ValueError(f"abort_after_s must be > 0 seconds or None, got {abort_after_s!r}")
    if self._all[0].platform == "cpu":
      self.watchdog = watchdog.Watchdog(
          self._client, jax.process_index(), jax.process_count(),
          after_s=DEFAULT_ABORT_AFTER_S if abort_after_s is None else abort_after_s,
          in_block=lambda: self._block_since, gloo_ports=gloo_ports(),
          spare_ports=service_ports())
      if abort_after_s is not None:
        self.watchdog.start()

  @contextlib.contextmanager
  def live(self) -> Iterator[list[jax.Device]]:
    """One step's worth of agreement with every live process. Yields every
    device of the job in the agreed order. The barrier is at the exit (and
    at a process's first entry): a process may die while the body runs.
    Raises :class:`MembersMissing` (inside the block: nothing ran) while a
    process is missing; on exit ``ProcessFailureError`` if one died, or
    :class:`PeerFailed` if the body raised on another process: a failure
    anywhere fails the step everywhere, so every process restores together."""
    self._body_failed = False
    with self._live_devices(self._all) as devices:
      live = self._live_devices.devices
      assert live is not None  # set on entering the block
      incarnations = dict(live)
      key = tuple(sorted((d.id, int(incarnations[d])) for d in devices))
      if key != self._entered:  # blocks are counted per membership, alike everywhere
        self._entered, self._block = key, 0
      self._block += 1
      failure = f"{_FAILED}/{hashlib.sha256(repr(key).encode()).hexdigest()}/{self._block}"
      if len(devices) < len(self._all) and not self._may_run_short(key, devices):
        gone = tuple(sorted({d.process_index for d in self._all}
                            - {d.process_index for d in devices}))
        raise MembersMissing(f"{len(self._all) - len(devices)} of {len(self._all)} "
                             f"devices are not live (processes {list(gone)})", gone)
      try:
        self.changed = self._dirty or key != self._key
        if key != self._key or self._order_name in self._spent:
          self.devices = self._order_for(key, incarnations)
          _devices.set_devices(self.devices)
          hosts = tuple(sorted({d.process_index for d in devices}))
          _devices.set_membership(hashlib.sha256(repr(key).encode()).hexdigest()[:16],
                                hosts if len(hosts) < jax.process_count() else None)
          if self.watchdog is not None:
            self.watchdog.watched = set(hosts)
            try:
              self.watchdog.remember_members()
            except Exception:  # noqa: BLE001  (beats unread: only staleness counts)
              self.watchdog.members = {}
          self.generation += 1
          self._key = key
          if hosts != self._hosts:
            self._resized(hosts)
          self._formed_at = time.time()
        if self.changed and self.recoveries and self.recoveries[-1].healed_at is None:
          self.recoveries[-1].healed_at = time.time()
          self.recoveries[-1].generation = self.generation
        self._dirty = False
        self._waiting_since = None
        self._block_since = time.monotonic()
        _devices.set_block_failure(failure)
        try:
          yield self.devices
        finally:
          self._block_since = None
          _devices.set_block_failure(None)
      except Exception:  # tell the others before the exit barrier
        self._body_failed = True
        with contextlib.suppress(Exception):
          self._client.key_value_set(failure, str(jax.process_index()))
        raise
    try:
      who = self._client.key_value_try_get(failure)
    except Exception:  # noqa: BLE001  (NOT_FOUND: the step succeeded everywhere)
      who = None
    if who is not None:
      raise PeerFailed(f"process {who} failed this step")
    if not self.changed:  # a step after the restore ran: the job is past the failure
      self._in_a_row = 0
      if self.resizes and self.resizes[-1].first_step_at is None:
        self.resizes[-1].first_step_at = time.time()
        if self._hosts[0] == jax.process_index():
          _reports.report_resize(self.resizes[-1].as_dict(), replace_last=True)

  @property
  def hosts(self) -> tuple[int, ...]:
    """The processes of the current membership (all of them unless the job
    runs short: :class:`ResizePolicy`)."""
    return self._hosts

  def _may_run_short(self, key: tuple[tuple[int, int], ...], devices: list[jax.Device]) -> bool:
    """Whether the job goes on without the missing processes (inside the
    block, so the same answer on every live process; see
    :class:`ResizePolicy`). Once the wait for a replacement is over, a
    process writes the decision for the next block in the service before
    it leaves this one: every process reads it only after that block's
    exit barrier, so all of them run short from the same block."""
    hosts = len({d.process_index for d in devices})
    if self.resize.min_hosts is None or hosts < self.resize.min_hosts:
      return False
    if key == self._shrunk:
      return True
    named = f"{_RESIZE}/{hashlib.sha256(repr(key).encode()).hexdigest()[:16]}"
    decided = self.resize.replacement_wait_s <= 0
    if not decided:
      try:
        decided = self._client.key_value_try_get(f"{named}/{self._block}") is not None
      except Exception:  # noqa: BLE001  (NOT_FOUND: not yet)
        decided = False
    if decided:
      self._shrunk = key
      return True
    if self._missing_since is None or self._missing_since[0] != key:
      self._missing_since = (key, time.monotonic())
    elif time.monotonic() - self._missing_since[1] >= self.resize.replacement_wait_s:
      with contextlib.suppress(Exception):  # ALREADY_EXISTS: another process wrote it
        self._client.key_value_set(f"{named}/{self._block + 1}", "1")
    return False

  def _resized(self, hosts: tuple[int, ...]) -> None:
    """Records a membership of other processes than the last one's."""
    before, self._hosts = self._hosts, hosts
    now = time.time()
    failed_at = (self.recoveries[-1].failed_at if self.recoveries
                 and self.recoveries[-1].healed_at is None else now)
    lost = sorted(set(before) - set(hosts))
    joined = sorted(set(hosts) - set(before))
    full = len(hosts) == jax.process_count()
    kind = ("grow" if joined and not lost else "shrink" if lost and not joined else "reform")
    self.resizes.append(Resize(kind, failed_at, now, list(before), list(hosts),
                               lost, joined, full))
    logger.warning("the job goes on with %d of %d processes (%s: lost %s, joined %s)",
                   len(hosts), jax.process_count(), kind, lost, joined)
    gone = sorted(set(range(jax.process_count())) - set(hosts))
    if gone:  # (a hung one still runs: the supervisor fences and replaces it; the
      # time: when it was last a member, so a replacement started since is not fenced)
      _reports.report_missing(gone, self._formed_at)
    if hosts[0] == jax.process_index():  # one writer
      _reports.report_resize(self.resizes[-1].as_dict())

  def _order_for(self, key: tuple[tuple[int, int], ...],
                 incarnations: dict[jax.Device, int]) -> list[jax.Device]:
    """The device order of membership ``key``. The job's first membership
    keeps JAX's default order (a job that never fails runs exactly as
    without in-place recovery); a later one (or the same one after a failed
    step) is drawn so that none of its device groups was used before."""
    # gloo keys communicators and their rendezvous by the ordered device
    # list alone, and XLA keeps them: a group last used with a dead process,
    # or one whose connections a failure shut (failed(), .watchdog), fails
    # forever, and one that failed mid-operation would meet leftover bytes.
    # The coordination service keeps every order, for processes that join.
    docs = {name.rsplit("/", 1)[-1]: json.loads(value)
            for name, value in self._client.key_value_dir_get(_ORDERS)}
    same = sorted(n for n, d in docs.items() if tuple(tuple(m) for m in d["members"]) == key)
    fresh = [n for n in same if n not in self._spent]
    by_id = {d.id: d for d in self._all}
    if fresh:  # another member of this membership chose already
      self._order_name = fresh[0]
      return [by_id[i] for i in docs[fresh[0]]["order"]]
    order = sorted(incarnations, key=lambda d: (d.process_index, d.id))  # JAX's
    if docs and _devices.rekey_needed(self._all[0].platform):
      # a draw every process makes alike, from the same orders
      stale = set().union(*(_devices.cliques(d["order"]) for d in docs.values()))
      fresh_order = _devices.rekeyed(incarnations, stale, {d.id for d in self._all})
      if fresh_order is None:
        raise _restart(f"no device order is left whose every group is new after "
                              f"{len(docs)} memberships; a full restart clears the old "
                              "communicators")
      order = fresh_order
    self._order_name = hashlib.sha256(repr((key, len(same))).encode()).hexdigest()
    with contextlib.suppress(Exception):  # ALREADY_EXISTS: another process wrote it
      self._client.key_value_set(f"{_ORDERS}/{self._order_name}", json.dumps(
          {"members": key, "order": [d.id for d in order]}))
    return order

  def close(self, timeout_s: float = 120.0) -> None:
    """The end of the job: waits for every process, then leaves in an order
    that strands no one. Recoverable processes skip JAX's own shutdown
    barrier, so without this the process hosting the service (process 0,
    unless the supervisor hosts it) could exit while others still talk to it,
    and they would abort. Raises ``TimeoutError`` naming the processes that
    did not reach it in ``timeout_s``."""
    if self.watchdog is not None:
      self.watchdog.stop()
    with contextlib.suppress(Exception):  # (only to name the late ones)
      self._client.key_value_set(f"{_DONE}/{jax.process_index()}", "1", allow_overwrite=True)
    short = len(self._hosts) < jax.process_count()  # (the others are gone)
    try:
      if short:
        self._client.wait_at_barrier(f"snapstore/done/{_devices.membership()}",
                                     int(timeout_s * 1000), list(self._hosts))
      else:
        self._client.wait_at_barrier("snapstore/done", int(timeout_s * 1000))
    except Exception as e:  # (the service's DEADLINE_EXCEEDED, or a death)
      raise TimeoutError(f"close(): process(es) {self._absent(_DONE)} did not reach the end "
                         f"of the job in {timeout_s:.0f} s (close(timeout_s=...)): "
                         f"{e}") from e
    if _jax_private.distributed_state().service is None:  # the service is elsewhere
      self._client.key_value_set(f"{_LEFT}/{jax.process_index()}", "1")
      jax.distributed.shutdown()
      return
    deadline = time.monotonic() + timeout_s  # the service is here: leave last
    while (len(self._client.key_value_dir_get(_LEFT)) < len(self._hosts) - 1
           and time.monotonic() < deadline):
      time.sleep(self.poll_s)
    if time.monotonic() >= deadline:
      logger.warning("close(): process(es) %s did not disconnect in %.0f s; the service "
                     "stops now", self._absent(_LEFT, but_me=True), timeout_s)
    time.sleep(0.5)  # their disconnect follows their key
    jax.distributed.shutdown()

  def _absent(self, where: str, *, but_me: bool = False) -> list[int]:
    """The processes without a key under ``where`` (none known: every one)."""
    try:
      there = {int(k.rsplit("/", 1)[-1]) for k, _ in self._client.key_value_dir_get(where)}
    except Exception:  # noqa: BLE001  (the service is gone)
      there = set()
    me = {jax.process_index()} if but_me else set()
    return sorted(set(range(jax.process_count())) - there - me)

  def failed(self, error: BaseException) -> None:
    """Call from the ``except job.FAILURES`` branch: the step is discarded,
    the next ``live()`` waits for the full job and sets ``changed``."""
    now = time.time()
    missing = next((e for e in (error, error.__cause__) if isinstance(e, MembersMissing)), None)
    body, self._body_failed = self._body_failed, False
    if missing is not None:
      self._waiting_since = self._waiting_since or now
      if missing.processes:
        # (a report names a process by its host: one last seen before its
        # replacement started is not about the replacement)
        _reports.report_missing(missing.processes, missing.since or self._waiting_since)
      if not body:  # live() found it at the entry: nothing ran, wait for the replacement
        if now - self._waiting_since > self.wait_timeout_s:
          raise _restart(f"no replacement joined in {self.wait_timeout_s:.0f} s: "
                                f"{error}") from error
        time.sleep(self.poll_s)
        return
      # (else the block's body found it, e.g. an Orbax barrier: the step failed)
    self._dirty = True
    if self._order_name is not None:
      self._spent.add(self._order_name)
    if self.watchdog is not None:
      # A communicator that failed mid-operation (or is still running one on
      # a background thread) must never carry the next collective: leftover
      # bytes would meet it (gloo aborts the process). Shut them all; the
      # next order uses only new groups (_order_for).
      self.watchdog.abort(f"step failed ({type(error).__name__})")
    if self._entered != self._failed_key:  # a new membership failed: count anew
      self._failed_key, self._in_a_row = self._entered, 0
    self._in_a_row += 1
    why = f"{type(error).__name__}: {str(error)[:200]}"
    if error.__cause__ is not None:  # (e.g. what made a process fail inside the block)
      why += f" (from {type(error.__cause__).__name__}: {str(error.__cause__)[:200]})"
    self.recoveries.append(Recovery(why, now))
    logger.warning("step failed (%s); waiting for the job to heal", self.recoveries[-1].error)
    if self._in_a_row >= self.max_failures:
      raise _restart(f"{self._in_a_row} failed steps in a row; the last: "
                            f"{self.recoveries[-1].error}") from error


def _restart(why: str) -> RestartRequired:
  """The error that ends in-place recovery here, its reason given to the
  supervisor first (``launch``'s incarnation report carries it)."""
  with contextlib.suppress(OSError):
    _reports.report_restart(why)
  return RestartRequired(why)
