"""The store interface: what :class:`SnapshotManager` asks of a backend.

Public (``snapstore.Backend``) and provisional in 0.x: it may change in a
minor release while the in-place and Pathways paths settle.

A backend holds one or more *stores* (a process's host store; or, on a single
controller, one store per failure domain), each with its manifests. The
manager has its store value (``SnapshotOptions.store``, :mod:`snapstore.stores`)
build a backend once, at construction, and from then on talks to it only
through :class:`Backend`:

* ``capture`` on the training thread: take the state out of reach of the next
  step, reserve room (may evict, may raise ``BudgetExceededError``);
* ``drain`` on the background thread: copy, checksum, commit the manifests,
  then apply retention (:func:`._planner.retention`, a pure function of the
  manifests);
* ``manifests``: the inventory restore plans from;
* ``fetch`` / ``check`` / ``place_leaf`` (:class:`._assemble.PieceSource`):
  one verified piece copy for the single assembler (``fetch`` returns memory
  of its own; ``check`` verifies in place);
* ``forget_domains`` / ``set_active_domains``: failure domains lost, or up.

A new backend is a store value whose ``build`` returns it
(:class:`StoreSpec`), and passes
:mod:`snapstore.testing.backend_suite` (the conformance suite): its test
module subclasses ``BackendSuite``, declares its store value (``make_store``)
and supplies its backdoor (``flip``); ``tests/test_backends.py`` does so for
each backend here, ``tests/test_memory_backend.py`` for one of the tests' own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from concurrent import futures
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

from .. import _planner
from .._assemble import PieceSource
from .._manifest import Manifest
from .._tree import LeafSpec, tree_digest
from ..options import SnapshotOptions

if TYPE_CHECKING:
  from collections.abc import Mapping

  import jax

# read_progress() of a store that was never asked to save.
NO_PROGRESS = (-1, -1)


@dataclasses.dataclass(frozen=True)
class Header:
  """The manifest fields a snapshot's stores share (the manager fills them)."""

  run_id: str
  incarnation: int
  step: int
  num_hosts: int
  tree_digest: str
  chunk_bytes: int
  leaves: tuple[LeafSpec, ...]
  extra: Any
  # the job's retention watermark (:mod:`.._watermark`), agreed at capture
  watermark: int = -1
  # False while the agreement this capture started is in flight: its record
  # names steps this store holds, kept until it is read (the next capture
  # evicts); the commit then deletes only superseded snapshots. Not stored.
  retain: bool = True

  @classmethod
  def for_snapshot(cls, options: SnapshotOptions, *, incarnation: int, step: int,
                   num_hosts: int, specs: Sequence[LeafSpec], extra: Any) -> Header:
    """The header of ``step``'s snapshot of a state flattened to ``specs``
    (the one place its fields are filled: the manager's saves, the
    backend suite's)."""
    return cls(run_id=options.run_id, incarnation=incarnation, step=step,
               num_hosts=num_hosts, tree_digest=tree_digest(specs),
               chunk_bytes=options.chunk_bytes, leaves=tuple(specs), extra=extra)

  @property
  def kept_step(self) -> int | None:
    """The step a new snapshot must not evict (None: the store's newest)."""
    return self.watermark if self.watermark >= 0 else None

  def fields(self) -> dict[str, Any]:
    """The fields as keyword arguments of ``Manifest`` (shallow)."""
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
            if f.name != "retain"}


class Pending(Protocol):
  """A captured snapshot waiting for its drain (opaque to the manager)."""

  header: Header


#: A backend's own kind of :class:`Pending`: what its ``capture`` returns is
#: what its ``drain`` takes.
PendingT = TypeVar("PendingT", bound=Pending)


class Store(Protocol):
  """One store's manifests, as retention needs them."""

  num_slots: int

  def manifests(self) -> list[Manifest]: ...

  def delete(self, manifest: Manifest, reason: str) -> None: ...


@runtime_checkable
class StoreSpec(Protocol):
  """A store value of one's own: builds the backend a
  :class:`~snapstore.SnapshotManager` keeps its snapshots in (the built-in
  values, :mod:`snapstore.stores`, are built by :func:`snapstore._backends.build`).
  Called once, by the manager's constructor (collective on a
  multi-controller job: every process builds its own)."""

  def build(self, options: SnapshotOptions, *, host: int, num_hosts: int,
            slices: Mapping[int, Sequence[jax.Device]] | None,
            pool: futures.Executor) -> Backend[Any]:
    """The backend for this store.

    Args:
      options: the manager's options (``run_id``, ``keep``, ``chunk_bytes``...).
      host: this process's index; num_hosts: the processes of the job.
      slices: single controller only: failure domain -> its devices (None:
        one store for this process).
      pool: the manager's copy threads, for the backend's copies.

    Returns:
      A :class:`Backend`.

    Raises:
      ValueError: this store cannot serve this job (say why, and what to use).
    """
    ...


class Backend(PieceSource, Protocol[PendingT]):
  """Where snapshots live (provisional in 0.x). Not thread-safe: the manager
  calls ``capture``, ``manifests``, ``fetch`` and the domain calls from the
  training thread and ``drain`` from its one drain thread, never both at
  once."""

  @property
  def spec(self) -> Any:
    """The store value that built it (``Auto()`` resolved: ``HostFiles`` or
    ``PinnedHost``); ``SnapshotManager.store`` returns it."""

  def store_ids(self) -> list[int]:
    """The stores this process holds (process index, or failure domains)."""

  def describe(self) -> str:
    """Where the snapshots are, for messages (``/dev/shm/snapstore/run``)."""

  def read_progress(self) -> tuple[int, int]:
    """(newest step asked to save, its incarnation) over the stores held,
    :data:`NO_PROGRESS` if none."""

  def write_progress(self, step: int, incarnation: int) -> None: ...

  def capture(self, header: Header, specs: Sequence[LeafSpec], leaves: Sequence[Any], *,
              replicas: int) -> PendingT:
    """Takes the state out of reach of the next step, with ``replicas``
    cross-domain copies of pieces that have no twin there, and reserves room
    for it. Training thread; collective on a multi-controller job."""

  def drain(self, pending: PendingT) -> int:
    """Copies, checksums and commits ``pending``, then applies retention.
    Returns the bytes stored. Drain thread."""

  def manifests(self) -> list[Manifest]:
    """Every manifest of this run in the stores held, oldest first."""

  def held_steps(self) -> list[list[int]]:
    """Per store that snapshots go to now, the steps it holds complete
    (valid, not superseded): what the job's retention watermark is agreed
    from (:mod:`.._watermark`). Training thread."""

  def forget_domains(self, domains: Sequence[int], reason: str) -> None:
    """The host memory of ``domains`` is gone: drop what their stores held
    and stop writing to them."""

  def set_active_domains(self, domains: Sequence[int]) -> None:
    """Snapshots go to these domains only, until the next call."""

  def adoption_pending(self) -> bool:
    """Whether this process holds stores of other indices whose snapshots
    must go home before a restore plans (host files: :mod:`.hostfiles.adopt`)."""

  def repatriate(self, coll: Any) -> list[str]:
    """Sends them home. Collective, where any host's :meth:`adoption_pending`."""

  def restore_done(self, step: int | None) -> None:
    """The job restored ``step`` (None: from the persistent tier)."""

  def watermark_moved(self, watermark: int | None) -> None:
    """The job agreed ``watermark``, a step every store holds (training thread)."""

  def ahead_seconds(self) -> float:
    """Seconds spent so far making memory for coming saves on threads of the
    backend's own (host files: the next slot, :mod:`.hostfiles.slots`).
    Optional: a backend without it reports 0."""

  def close(self) -> None: ...


class ProgressInMemory:
  """A store's progress kept in this process (its snapshots die with it)."""

  _progress: tuple[int, int] = NO_PROGRESS

  def write_progress(self, step: int, incarnation: int) -> None:
    self._progress = (step, incarnation)

  def read_progress(self) -> tuple[int, int]:
    return self._progress


def retain(store: Store, keep: int, carries: Callable[[int], bool] | None = None, *,
           superseded_only: bool = False) -> None:
  """Applies :func:`._planner.retention` to one store: the newest ``keep``
  and the job's watermark (the newest manifest names it), and one slot free
  for the next snapshot; or, ``superseded_only``, deletes only what a newer
  incarnation superseded (:attr:`Header.retain`)."""
  manifests = store.manifests()
  keep = len(manifests) if superseded_only else min(keep, max(store.num_slots - 1, 1))
  for m, why in _planner.retention(manifests, keep, carries):
    store.delete(m, why)


def progress_of(stores: Sequence[Any]) -> tuple[int, int]:
  """The newest progress over ``stores`` (each with ``read_progress``)."""
  got = [s.read_progress() for s in stores]
  return (max((p[0] for p in got), default=NO_PROGRESS[0]),
          max((p[1] for p in got), default=NO_PROGRESS[1]))


class DomainStores:
  """The part of a backend that is the same for every kind: a dict of
  stores by id (process index or failure domain), the domains that are down,
  progress, inventory. Backends derive from it and add capture, drain and
  fetch."""

  def __init__(self, stores: dict[int, Any], *, run_id: str):
    self.stores = stores
    self.run_id = run_id
    self._down: set[int] = set()

  def store_ids(self) -> list[int]:
    return sorted(self.stores)

  def read_progress(self) -> tuple[int, int]:
    return progress_of(list(self.stores.values()))

  def write_progress(self, step: int, incarnation: int) -> None:
    for sid, store in self.stores.items():
      if sid not in self._down:
        store.write_progress(step, incarnation)

  def manifests(self) -> list[Manifest]:
    """Every manifest of this run in the stores held (another run's are
    never restored)."""
    return [m for st in self.stores.values() for m in st.manifests()
            if m.run_id == self.run_id]

  def held_steps(self) -> list[list[int]]:
    return [sorted({m.step for m in _planner.fence(
                        [m for m in self.stores[k].manifests() if m.run_id == self.run_id])})
            for k in self.live()]

  def holds(self, store: int) -> bool:
    return store in self.stores

  def live(self) -> list[int]:
    """The stores that snapshots go to now."""
    return [k for k in sorted(self.stores) if k not in self._down]

  def forget_domains(self, domains: Sequence[int], reason: str) -> None:
    for d in domains:
      if d in self.stores:
        self.stores[d].wipe()
      self._down.add(d)

  def set_active_domains(self, domains: Sequence[int]) -> None:
    self._down = set(self.stores) - set(domains)

  def adoption_pending(self) -> bool:
    return False  # (stores of one kind with no other index's to adopt)

  def repatriate(self, coll: Any) -> list[str]:
    return []

  def restore_done(self, step: int | None) -> None:
    pass

  def watermark_moved(self, watermark: int | None) -> None:
    pass

  def ahead_seconds(self) -> float:
    return 0.0

  def close(self) -> None:
    for store in self.stores.values():
      store.close()
