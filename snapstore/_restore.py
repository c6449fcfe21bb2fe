"""One restore: from the freshest snapshot the stores hold whole, down to
the persistent tier.

:class:`Restore` is one ``SnapshotManager.restore`` call: its target, the
notes and timings it reports, and one method per attempt, in order:

1. ``snapstore._multihost.sparse`` (multi-controller jobs): each host plans from its own
   metadata and the few facts the hosts agree on (:mod:`snapstore._multihost.peers`); it may
   decline, naming why, and the full exchange follows;
2. ``_snapshot``: every store's manifests, the freshest complete step
   read and placed; a bad copy is noted and another copy, else an older
   step, is tried;
3. ``_persistent``: the newest committed Orbax step, or an error that says
   what was found and that nothing was deleted.

The manager keeps what outlives a call (its stores, peers, incarnation).
A restore gets them as values (:class:`Inputs`) and returns, beside its
result, what it decided that outlives it (:class:`Outcome`: the incarnation
saves continue as, the step the new lineage starts from, the domains whose
store raised on read); the manager alone applies it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import jax

from . import _arena, _multihost, _planner, _switch, errors
from ._assemble import Assembler
from ._manifest import copy_extra
from ._tree import check_compatible, check_targets, flatten
from .metrics import RestoreResult, Source

if TYPE_CHECKING:
  from ._arena import ArenaCache
  from ._backends import Backend
  from ._persistent import OrbaxTier
  from .options import SnapshotOptions

logger = logging.getLogger(__name__)

#: what :meth:`Restore._sparse` returns where stores must go home first
ADOPT = "adopt: stores of other indices go home first"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Inputs:
  """What a restore reads: the manager's stores, peers and persistent tier,
  and its fencing state as it stands (``newest_step``: the newest step any
  save of this process named; ``incarnation``: the one saves go out as)."""

  backend: Backend[Any]
  peers: _multihost.Solo | _multihost.Distributed
  persistent: OrbaxTier | None
  options: SnapshotOptions
  arenas: ArenaCache
  host: int
  newest_step: int
  incarnation: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class Outcome:
  """What a restore decided that outlives it, for the manager to apply:
  the incarnation saves continue as (agreed by every host; a new one if
  the restored step starts a new branch), the step the new lineage starts
  from (None: nothing was restored), and, on a single controller, the
  domains whose store raised on read (to forget) and the domains that were
  active before (to set again: whether a domain is up is the elastic
  manager's to say)."""

  incarnation: int
  lineage_step: int | None = None
  lost_domains: tuple[int, ...] = ()
  active_domains: tuple[int, ...] | None = None


def settle(finish: Callable[[], errors.DrainFailedError | None]) -> list[str]:
  """Waits for the snapshot in flight (``finish``: the manager's, which
  returns its failure or raises it); a failed one is noted for the
  restore's notes, not raised."""
  try:
    failed = finish()
  except errors.DrainFailedError as e:  # e.g. its slice died mid-copy
    failed = e
  if failed is None:
    return []
  logger.warning("the snapshot in flight was not completed and is not used: %s", failed)
  return [f"the snapshot in flight was not completed and is not used: {failed}"]


class Restore:
  """One restore of ``abstract_state``'s layout (``step``: that step only).
  :meth:`run` returns the result and the :class:`Outcome`; if it raises,
  ``outcome`` is what it had decided by then (the agreed incarnation, the
  domains found lost), still to apply."""

  def __init__(self, inputs: Inputs, abstract_state: Any, step: int | None,
               notes: list[str]) -> None:
    self.inputs, self.step, self.notes = inputs, step, notes
    self.outcome = Outcome(incarnation=inputs.incarnation)
    self.faulting_at_start = _arena.faulting_seconds()
    self.t0 = time.perf_counter()
    self.timings: dict[str, float] = {}
    self.target_specs, self.targets, self.treedef = flatten(abstract_state)
    check_targets(self.target_specs, self.targets)
    self.exchange = ""  # how the hosts' metadata met ("sparse", "full: why")
    self.adoptions = 0  # rounds of stores sent home (.hostfiles.adopt)

  @contextlib.contextmanager
  def _timed(self, key: str, *, add: bool = False) -> Iterator[None]:
    """Sets ``timings[key]`` to the block's seconds (``add``: adds them)."""
    t = time.perf_counter()
    try:
      yield
    finally:
      self.timings[key] = (self.timings.get(key, 0.0) if add else 0.0) + (
          time.perf_counter() - t)

  @property
  def incarnation(self) -> int:
    return self.outcome.incarnation

  def _decide(self, **changes: Any) -> None:
    self.outcome = dataclasses.replace(self.outcome, **changes)

  def run(self) -> tuple[RestoreResult, Outcome]:
    """The restore; the result and what the manager is to apply."""
    result = self._run()
    return result, self.outcome

  def _run(self) -> RestoreResult:
    inp, step = self.inputs, self.step
    local = inp.backend.manifests()
    with self._timed("scan_persistent"):
      persistent_steps = [s for s in (inp.persistent.committed_steps() if inp.persistent
                                      else []) if step is None or s == step]
    adopting = self.adoptions < 2 and inp.backend.adoption_pending()
    values = (max([inp.newest_step] + [m.step for m in local]), self.incarnation,
              -(persistent_steps[-1] if persistent_steps else -1), int(adopting))
    if isinstance(inp.peers, _multihost.Distributed):
      sparse = self._sparse(inp.peers, local, persistent_steps, values)
      if isinstance(sparse, RestoreResult):
        return sparse
      if sparse is ADOPT:  # stores found under other indices go home, then again
        self.adoptions += 1
        with self._timed("adopt", add=True):
          self.notes.extend(inp.backend.repatriate(inp.peers.collective))
        return self._run()
      self.exchange = f"full: {sparse}"
      self.notes.append(f"every host's manifests are exchanged: {sparse}")
      logger.info(self.notes[-1])
    with self._timed("scan_exchange"):
      # Every store's manifests; with them, in the same exchange, one
      # incarnation for everyone from here (a replacement that joined a
      # running job may not know the one the others reached), the newest step
      # any process saw, and one view of the persistent tier (the oldest
      # newest-commit: commits only grow), so every process picks the same
      # source.
      manifests, (newest, incarnation, neg_latest, _) = inp.peers.gather_manifests(
          local, values)
      self._decide(incarnation=incarnation)
      persistent_steps = [s for s in persistent_steps if s <= -neg_latest]
    self.timings["scan"] = time.perf_counter() - self.t0
    # A restore of many leaves makes tens of thousands of objects, and the
    # arrays it returns outlive young collections, so full collections would
    # run during it (``benchmarks.capture`` counts them). Paused as a save
    # is (``pause_gc``).
    with _switch.collections_paused(inp.options.pause_gc):
      found, manifests, why = self._snapshot(manifests, persistent_steps, newest)
    if found is not None:
      return found
    self.notes.extend(why[:1])  # why the freshest snapshot step was not usable
    result = self._persistent(persistent_steps, newest)
    self._branch_from(result.step, manifests)
    return result

  def _sparse(self, peers: _multihost.Distributed, local: Sequence[Any],
              persistent_steps: list[int], values: tuple[int, int, int, int]
              ) -> RestoreResult | str:
    """A multi-host restore from each host's own metadata
    (:meth:`snapstore._multihost.peers.Distributed.restore`); or why every host's manifests
    must be exchanged instead."""
    inp = self.inputs
    with _switch.collections_paused(inp.options.pause_gc):
      got = peers.restore(inp.backend, inp.arenas, local, self.target_specs, self.targets,
                          step=self.step, values=values, persistent_steps=persistent_steps)
    if got.adopt:
      return ADOPT
    self._decide(incarnation=got.incarnation)
    self.timings.update(got.timings)
    self.timings["scan"] = self.timings["scan_persistent"] + self.timings["scan_exchange"]
    self.notes.extend(got.notes)
    if got.fallback is not None:
      return got.fallback
    self.exchange = "sparse"
    persistent_steps = [s for s in persistent_steps if s <= got.persistent_latest]
    if got.plan is not None and got.leaves is not None:
      self.timings["read"] = sum(self.timings.get(k, 0.0)
                                 for k in ("read_verify", "read_agree", "read_place"))
      result = self._result(got.plan.step, got.leaves, copy_extra(got.plan.extra),
                            Source.SNAPSHOT, got.newest,
                            dict(got.read, exchanged=got.read["received"] + got.read["sent"]))
    else:
      self.notes.extend(got.reasons[:1])  # why the freshest snapshot step was not usable
      result = self._persistent(persistent_steps, got.newest)
    new = peers.branch(local, result.step, self.incarnation)
    if new != self.incarnation:
      logger.info("restored step %d: saves continue as incarnation %d (a new branch)",
                  result.step, new)
      self._decide(incarnation=new)
    return result

  def _snapshot(self, manifests: Any, persistent_steps: list[int], newest: int
                ) -> tuple[RestoreResult | None, Any, list[str]]:
    """The freshest snapshot step the stores hold whole, read and placed:
    each bad copy found is noted and another copy or an older step tried.
    Returns (the result or None, the manifests left, why the freshest step
    was not usable); None where none is, or the persistent tier is newer."""
    inp = self.inputs
    bad: set[_planner.CopyKey] = set()
    while True:
      reasons: list[str] = []
      with self._timed("plan", add=True):
        plan = _planner.choose(manifests, step=self.step, bad=bad, prefer_store=inp.host,
                               reasons=reasons)
      if plan is None or (persistent_steps and persistent_steps[-1] > plan.step):
        return None, manifests, reasons
      check_compatible(plan.specs, self.target_specs, step=plan.step)
      t = time.perf_counter()
      assembler = Assembler(plan, inp.backend, arenas=inp.arenas)
      got = inp.peers.assemble(assembler, self.target_specs, self.targets)
      for key, why in got.bad.items():  # one note per bad copy found
        if key not in assembler.bad or assembler.bad[key].lost_store is None:
          self.notes.append(f"step {plan.step}: {why}; using another copy or an older step")
          logger.warning(self.notes[-1])
      bad.update(got.bad)
      manifests = self._forget_unreadable(assembler, manifests)
      if got.leaves is None:
        continue
      self.timings["read"] = time.perf_counter() - t
      self.timings.update(got.timings)
      read = {"snapshot": assembler.bytes_read}
      if inp.peers.multi_host:
        read["exchanged"] = got.bytes_exchanged
      if assembler.bytes_rebuilt:
        read["rebuilt"] = assembler.bytes_rebuilt
      result = self._result(plan.step, got.leaves, copy_extra(plan.extra), Source.SNAPSHOT,
                            newest, read)
      self._branch_from(result.step, manifests)
      return result, manifests, reasons

  def _persistent(self, persistent_steps: list[int], newest: int) -> RestoreResult:
    """The newest committed persistent step, or the error that says what the
    restore found."""
    tier, step, notes = self.inputs.persistent, self.step, self.notes
    if not persistent_steps or tier is None:
      where = tier.directory if tier else "no persistent tier"
      what = f"step {step}" if step is not None else "any step"
      seen = f" What the restore found: {'; '.join(notes[-3:])}." if notes else ""
      raise (errors.StepNotFoundError if step is not None else errors.NothingToRestoreError)(
          f"no complete snapshot of {what} in {self.inputs.backend.describe()} and no committed "
          f"checkpoint in {where}.{seen} Nothing was deleted; start a new run, or "
          "point the store (HostFiles.dir), run_id and persistent at the run to resume.")
    pstep = persistent_steps[-1]
    notes.append(f"no complete snapshot at or after step {pstep}; "
                 "restoring from the persistent tier")
    logger.info(notes[-1])
    with self._timed("read"):
      check_compatible(tier.saved_specs(pstep), self.target_specs, step=pstep)
      before = tier.bytes_read
      leaves, extra = tier.restore(pstep, self.target_specs, self.targets)
    return self._result(pstep, leaves, extra, Source.PERSISTENT, max(newest, pstep),
                        {"persistent": tier.bytes_read - before})

  def _result(self, step: int, leaves: list[Any], extra: Any, source: Source, newest: int,
              read: dict[str, int]) -> RestoreResult:
    """The result of restoring ``step``; it starts the manager's lineage."""
    self.timings["total"] = time.perf_counter() - self.t0
    self.timings["first_touch"] = _arena.faulting_seconds() - self.faulting_at_start
    self._decide(lineage_step=step)
    return RestoreResult(
        step=step, state=jax.tree_util.tree_unflatten(self.treedef, leaves), extra=extra,
        source=source, rewind_steps=newest - step, newest_step=newest, bytes_read=read,
        timings=self.timings, notes=tuple(self.notes), exchange=self.exchange)

  def _forget_unreadable(self, assembler: Assembler, manifests: list[Any]) -> list[Any]:
    """Single controller: a store whose memory raised DATA_LOSS on read
    (its slice's memory is gone, as Pathways says it) is a lost domain:
    the next plan uses the others only, and the outcome names it for the
    manager to forget. The domain stays active if it was: whether it is up
    is the elastic manager's to say, and a later snapshot writes to it
    again. The manifests left to plan from."""
    lost = sorted(assembler.lost_stores)
    if not lost or self.inputs.peers.multi_host:
      return manifests
    why = next(str(e) for e in assembler.bad.values() if e.lost_store == lost[0])
    self.notes.append(f"step {assembler.plan.step}: the stores of domains {lost} raised on "
                      f"read ({why}): treated as lost; planning from the others")
    logger.warning(self.notes[-1])
    if self.outcome.active_domains is None and not self.outcome.lost_domains:
      live = getattr(self.inputs.backend, "live", None)
      if live is not None:
        self._decide(active_domains=tuple(live()))
    self._decide(lost_domains=tuple(sorted({*self.outcome.lost_domains, *lost})))
    gone = set(self.outcome.lost_domains)
    return [m for m in manifests if m.store not in gone]

  def _branch_from(self, step: int, manifests: Sequence[Any]) -> None:
    """Restoring ``step`` when this incarnation already saved later steps
    starts a new branch: later saves take a new incarnation, which fences
    the abandoned steps (:func:`._planner.fence`). Every host decides the
    same (same gathered manifests)."""
    if any(m.incarnation == self.incarnation and m.step > step for m in manifests):
      self._decide(incarnation=max(m.incarnation for m in manifests) + 1)
      logger.info("restored step %d: saves continue as incarnation %d (a new branch)",
                  step, self.incarnation)
