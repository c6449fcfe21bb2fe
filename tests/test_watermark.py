"""The job's retention watermark: a store never deletes the last step every
store holds before a newer one is held by every store (``snapstore._watermark``).

The unit tests play the records and the retention rules; the job tests run
real processes: a host SIGKILLed inside step K's replica exchange, its store
lost, while the others go on saving for two more steps (their train step needs
no other host, and the supervisor tears the job down 4 s later, as a scheduler
notices a lost host seconds later, not at once). Retention by each store's own
view then deleted step K - 1 on the hosts whose half of the exchange did not
touch the dead host, and the restart found nothing to restore.
"""

import json
import shutil
import uuid
from pathlib import Path

import numpy as np
import pytest

from snapstore import _planner, _watermark
from snapstore._manifest import Manifest
from snapstore.testing import Kill, launch


# ------------------------------------------------------------------ records
def agree(now, helds, learned=()):
  learned = list(learned) + [None] * (len(helds) - len(learned))
  recs = [_watermark.record(now, h, w) for h, w in zip(helds, learned, strict=True)]
  return _watermark.settle(now, _watermark.combine(recs))


def test_the_watermark_is_the_newest_step_every_store_holds():
  assert agree(10, [[7, 8, 9], [8, 9], [6, 8, 9]]) == 9
  assert agree(10, [[7, 8, 9], [8], [6, 8, 9]]) == 8
  assert agree(10, [[7, 8, 9], [7, 9], [8]]) is None  # no step held by all
  assert agree(10, [[9], []]) is None  # a store with nothing (a replacement)


def test_the_newest_learned_watermark_reaches_every_host():
  """A host that missed an agreement learns the newest any host learned,
  even where it holds nothing newer in common with the others."""
  assert agree(20, [[15, 16], [17], []], learned=[15, 12, None]) == 15
  assert agree(20, [[18, 19], [18, 19]], learned=[15, 15]) == 19


def test_buckets_that_collide_hide_a_step_never_invent_one():
  a, b = 0, next(s for s in range(1, 10_000)
                 if _watermark.bucket_of(s) == _watermark.bucket_of(0))
  # one store holds a (in the bucket), the other only b in the same bucket
  assert agree(b + 1, [[a], [b]]) is None
  assert agree(b + 1, [[a, b], [b]]) == b
  # six consecutive snapshot steps, at any fixed interval, never collide
  for every in (1, 2, 3, 5, 10, 16, 50, 64, 100, 128, 1000, 1024):
    for start in range(0, 3000, every):
      assert len({_watermark.bucket_of(start + every * i) for i in range(6)}) == 6


def test_steps_too_far_back_are_not_counted():
  assert agree(2**40, [[1], [1]]) is None
  assert _watermark.record(5, [6], None)[1:].tolist() == (
      [_watermark.NONE] * _watermark.BUCKETS + [-_watermark.FAR] * _watermark.BUCKETS)


# ---------------------------------------------------------------- retention
def manifest(step, slot, watermark=-1, incarnation=0):
  return Manifest(run_id="r", incarnation=incarnation, step=step, store=0, num_hosts=1,
                  tree_digest="", slot=slot, chunk_bytes=4096, leaves=(), pieces=(),
                  scalars={}, watermark=watermark)


def test_retention_keeps_the_watermark_past_keep():
  ms = [manifest(5, 0), manifest(6, 1), manifest(7, 2, watermark=5), manifest(8, 3, 5)]
  gone = {m.step for m, _ in _planner.retention(ms, 2, None)}
  assert gone == {6}  # 7 and 8 (keep 2) and 5, the last step every store held
  ms[-1] = manifest(8, 3, watermark=7)
  assert {m.step for m, _ in _planner.retention(ms, 2, None)} == {5, 6}


def test_a_watermark_this_store_does_not_hold_protects_nothing_extra():
  ms = [manifest(6, 1), manifest(7, 2), manifest(8, 3, watermark=5)]
  assert _planner.watermark_of(ms) is None
  assert {m.step for m, _ in _planner.retention(ms, 2, None)} == {6}


def test_a_new_snapshot_evicts_anything_but_the_watermark():
  ms = [manifest(5, 0), manifest(6, 1), manifest(7, 2)]
  assert _planner.free_slot(ms, 3, watermark=5) == (1, ms[1])
  assert _planner.free_slot(ms, 3, watermark=None) == (0, ms[0])
  assert _planner.free_slot(ms, 4, watermark=5) == (3, None)
  # no watermark: never the newest
  assert [m.step for m in _planner.evictable(ms, None)] == [5, 6]
  assert [m.step for m in _planner.evictable(ms, 6)] == [5, 7]


def test_a_manifest_with_a_watermark_after_its_step_is_corrupt():
  from snapstore._manifest import validate
  with pytest.raises(ValueError, match="watermark"):
    validate(manifest(5, 0, watermark=6))


# ----------------------------------------- the protocol, hosts played here
class Host:
  """One host's store in the protocol model: its manifests (retention and
  eviction by the real rules), the watermark it learned."""

  def __init__(self, h, keep):
    self.h, self.keep, self.ms, self.learned = h, keep, [], None

  def steps(self):
    return {m.step for m in self.ms}

  def commit(self, step, watermark):
    slot, evict = _planner.free_slot(self.ms, self.keep + 1, watermark)
    if evict is not None:
      self.ms.remove(evict)
    self.ms = [m for m in self.ms if m.slot != slot]
    self.ms.append(manifest(step, slot, -1 if watermark is None else watermark))
    for m, _ in _planner.retention(self.ms, self.keep, None):
      self.ms.remove(m)


def play(seed, *, agree_first, hosts=4, keep=2, steps=12):
  """A job of ``hosts`` with ring replicas (host h's pieces also in h + 1's
  store): host ``dead`` dies inside step ``k``'s exchange, after its part
  went out; from then on each survivor's exchange and commit succeed or
  fail at random (a half that did not touch the dead host can succeed), as
  does its part of the agreement at ``k``; later agreements fail (a member
  is gone). ``agree_first`` False plays the rule before the watermark: each
  store by its own view, commits with no agreement. Returns (k, the steps
  restorable once the dead host's store is lost)."""
  rng = np.random.default_rng(seed)
  k, dead = int(rng.integers(3, steps - 2)), int(rng.integers(hosts))
  js = [Host(h, keep) for h in range(hosts)]
  for s in range(1, steps + 1):
    alive = [j for j in js if not (j.h == dead and s > k)]
    if agree_first:
      recs = [_watermark.record(s, sorted(j.steps()), j.learned) for j in js]
      reduced = _watermark.combine(recs)
      learns = [j for j in alive if s < k or (s == k and rng.random() < 0.7)]
      for j in learns:
        j.learned = _watermark.settle(s, reduced)
    else:
      learns = alive  # (no agreement: every live host goes on)
    for j in learns:
      if s < k or (s == k and j.h != dead and rng.random() < 0.7) or (
          s > k and not agree_first and rng.random() < 0.6):
        j.commit(s, j.learned if agree_first else None)
  lost = js[dead]
  def complete(s):
    return all((j is not lost and s in j.steps())
               or (js[(j.h + 1) % hosts] is not lost and s in js[(j.h + 1) % hosts].steps())
               for j in js)
  return k, [s for s in range(1, steps + 1) if complete(s)]


def test_the_last_step_every_store_held_survives_any_partial_failure():
  """500 random failure patterns through the real retention and eviction
  rules: with the watermark a step >= k - 1 always survives the loss of
  the host that died inside step k's exchange."""
  for seed in range(500):
    k, ok = play(seed, agree_first=True)
    assert ok and max(ok) >= k - 1, (seed, k, ok)


def test_retention_by_each_stores_own_view_loses_every_step():
  """The same patterns under the rule before the watermark: some leave
  nothing restorable (the survivors that went on deleted the last step
  every store held)."""
  lost = [seed for seed in range(500) if not play(seed, agree_first=False)[1]]
  assert len(lost) > 10, lost


class Saving(Host):
  """A host of the model that saves as ``Saver`` does: ``overlap`` (3 slots
  or more) evicts by the last capture's agreement and starts one on what it
  holds after, read at the next capture; else (or after a failed read) it
  agrees and reads before evicting. The commit of an overlapped capture
  deletes nothing but superseded snapshots (``Header.retain``)."""

  def __init__(self, h, keep, overlap):
    super().__init__(h, keep)
    self.overlap, self.agreeing, self.fresh = overlap, False, True

  def evict(self, watermark):
    slot, evict = _planner.free_slot(self.ms, self.keep + 1, watermark)
    if evict is not None:
      self.ms.remove(evict)
    self.ms = [m for m in self.ms if m.slot != slot]
    return slot

  def add(self, step, slot, retain):
    self.ms.append(manifest(step, slot, -1 if self.learned is None else self.learned))
    for m, _ in (_planner.retention(self.ms, self.keep, None) if retain else ()):
      self.ms.remove(m)


def play_saves(seed, keep, *, fail=True, steps=16, hosts=4):
  """One job of :class:`Saving` hosts (a random mix of the two modes where
  ``keep`` allows, harsher than a job, whose options pick one for every
  host): after step ``k`` each part of each agreement, each
  capture and each commit fail at random (``fail``), and host ``dead``
  stops, its stale record still counted. Yields after every step."""
  rng = np.random.default_rng(seed)
  k, dead = int(rng.integers(3, 10)), int(rng.integers(hosts))
  def ok(s):
    return not fail or s < k or rng.random() < 0.7
  js = [Saving(h, keep, keep >= 2 and (not fail or rng.random() < 0.7)) for h in range(hosts)]
  last = None  # the reduction the last capture started
  for s in range(1, steps):
    recs, saving = [], []
    for j in js:
      if fail and j.h == dead and s > k:
        recs.append(_watermark.record(s, sorted(j.steps()), j.learned))
        continue
      if j.agreeing:  # the last capture's agreement, read now
        j.fresh = ok(s)
        if not j.fresh:  # StoreError: nothing evicted or saved; its next agreement starts
          recs.append(_watermark.record(s, sorted(j.steps()), j.learned))
          continue
        j.agreeing, j.learned = False, _watermark.settle(s - 1, last)
      if j.overlap:
        slot = j.evict(j.learned)
        recs.append(_watermark.record(s, sorted(j.steps()), j.learned))
        j.agreeing = True
        saving.append((j, slot))
      else:
        recs.append(_watermark.record(s, sorted(j.steps()), j.learned))
        j.fresh = ok(s)
        if j.fresh:
          saving.append((j, None))
    last = _watermark.combine(recs)
    for j, slot in saving:
      if slot is None:
        j.learned = _watermark.settle(s, last)
        slot = j.evict(j.learned)
      if ok(s):
        j.add(s, slot, retain=not j.agreeing)
    yield s, js


@pytest.mark.parametrize("keep", [1, 2, 3])
def test_every_store_holds_the_newest_watermark_any_host_learned(keep):
  """The invariant behind it, against a harsh adversary: every host's part
  of each agreement, capture and commit fail at random after step k, the
  dead host's stale record still counts, and hosts that overlap the
  agreement with the step mix with hosts that do not. After every step,
  the newest watermark any host learned is a step every store holds."""
  for seed in range(400):
    for s, js in play_saves(seed, keep):
      learned = [j.learned for j in js if j.learned is not None]
      assert not learned or all(max(learned) in j.steps() for j in js), (keep, seed, s)


@pytest.mark.parametrize("keep", [2, 3])
def test_an_overlapped_agreement_moves_on_every_save(keep):
  """With no failure the overlapped agreement, read a capture later, names
  the step two saves back, and each store holds its newest ``keep``, the
  watermark and no more than ``keep + 1`` (its slots)."""
  for s, js in play_saves(0, keep, fail=False):
    for j in js:
      assert len(j.steps()) <= keep + 1, (s, j.ms)
      if s > 2:
        assert j.learned == s - 2 and set(range(s - keep + 1, s + 1)) <= j.steps(), (s, j.ms)


# ------------------------------------------------------------ a real job
STEPS = 8
KILL = 5  # host 1 dies inside step 5's replica exchange


def run_job(tmp_path, redundancy, in_place=False):
  out = tmp_path / "out"
  out.mkdir()
  store = Path("/dev/shm") / f"snapstore-wm-{uuid.uuid4().hex[:8]}"
  try:
    incs = launch("tests._watermark_worker",
                  ["--steps", str(STEPS), "--store", str(store), "--out", str(out),
                   "--redundancy", redundancy],
                  num_hosts=4, devices_per_host=2, store_dir=store, run_id="job",
                  kills=[Kill(host=1, step=KILL, phase="replica", lose_store=True)],
                  log_dir=out, timeout_s=240, in_place=in_place,
                  teardown_delay_s=0.0 if in_place else 4.0,
                  env={"XLA_FLAGS": "--xla_cpu_collective_timeout_seconds=2"})
  finally:
    shutil.rmtree(store, ignore_errors=True)
  last = len(incs) - 1
  return incs, [json.loads((out / f"inc{last}-host{h}.json").read_text())
                for h in range(4)], out


@pytest.mark.slow
@pytest.mark.parametrize("redundancy", ["replica", "parity"])
def test_a_kill_inside_a_replica_exchange_leaves_a_complete_step(tmp_path, redundancy):
  """Host 1 dies inside step 5's replica exchange and its store is lost;
  the others go on saving steps 6-8 for 4 s. Every host of the restarted
  job restores the same step >= 4 from RAM, bitwise the state computed
  there; nothing is found missing."""
  incs, reports, out = run_job(tmp_path, redundancy)
  assert [i.killed for i in incs] == [[1], []], [i.killed for i in incs]
  before = [json.loads((out / f"inc0-host{h}.json").read_text()) for h in (0, 2, 3)]
  # the construction: the survivors went past the dead host's step
  assert max(r.get("trained", 0) for r in before) >= KILL + 1, before
  step = _one_restored_step(reports)
  # the watermark the stores kept is in the metrics of the restarted job
  assert all(r["metrics"]["watermark"] >= step for r in reports), reports


@pytest.mark.slow
@pytest.mark.parametrize("redundancy", ["replica", "parity"])
def test_in_place_a_kill_inside_a_replica_exchange_heals_from_a_complete_step(
    tmp_path, redundancy):
  """The same kill in place, in live() blocks of 3 steps: the survivors'
  block goes on past the dead host's step until its collectives fail; host
  1 is replaced with an empty store, and every host (the replacement from
  its peers) restores the same step >= 4, bitwise."""
  incs, reports, _ = run_job(tmp_path, redundancy, in_place=True)
  # (a slow replacement may itself be replaced: host 1 alone, in place)
  assert len(incs) == 1 and {r["host"] for r in incs[0].replaced} == {1}, [
      i.as_dict() for i in incs]
  _one_restored_step(reports)
  assert len(reports[0]["restores"]) == 2, reports[0]  # the start, and the heal
  # the construction: a survivor's block failed at or past the dead host's step
  assert max(r.get("failed_at", [0])[0] for r in reports if r["host"] != 1) >= KILL, reports


def _one_restored_step(reports):
  steps = {r["restore"]["step"] for r in reports}
  assert len(steps) == 1, reports
  (step,) = steps
  assert step is not None and KILL - 1 <= step <= STEPS, reports
  for r in reports:
    assert r["restore"]["source"] == "snapshot" and r["restore"]["bitwise"], r
    assert r["trained"] == STEPS, r
  return step


def test_the_supervisor_refuses_a_negative_teardown_delay():
  with pytest.raises(ValueError, match="teardown_delay_s"):
    launch("x", [], num_hosts=1, devices_per_host=1, store_dir="/tmp/x", run_id="r",
           teardown_delay_s=-1)


# ---------------------------------------------------------------- one process
def test_inspect_shows_the_watermark_and_why_each_step_is_kept(store_dir, capsys):
  """keep=1 on one host: the store holds the newest step and the last one
  the job agreed on (one slot more than keep, none more than before)."""
  import jax.numpy as jnp

  import snapstore
  from snapstore import cli
  from tests.helpers import only_store, opts
  with snapstore.SnapshotManager(opts(store_dir, keep=1, run_id="wm")) as mgr:
    for step in (1, 2, 3):
      mgr.save(step, {"w": jnp.full((64,), step, jnp.float32)})
      mgr.wait_until_finished()
    assert mgr.snapshot_steps() == [2, 3]
    assert mgr.metrics.watermark == 2
    assert len(list(only_store(mgr).root.glob("slot-*.bin"))) == 2
  assert cli.main(["inspect", str(store_dir / "wm")]) == 0
  report = json.loads(capsys.readouterr().out)
  assert report["watermarks"] == {"0": 2}
  kept = {r["step"]: r["kept"] for r in report["manifests"]}
  assert kept[2].startswith("the job's watermark") and kept[3].startswith("newer"), kept


def test_with_replicas_every_other_snapshot_only_carriers_become_the_watermark(store_dir):
  """replica_interval=2: only the steps that carried their replicas count,
  and a capture right after one that carried none agrees nothing anew (no
  collective): the last watermark stands, and is kept."""
  import jax.numpy as jnp

  import snapstore
  from tests.helpers import opts
  with snapstore.SnapshotManager(opts(store_dir, keep=1, replica_interval=2)) as mgr:
    seen = []
    for step in range(1, 8):
      mgr.save(step, {"w": jnp.full((64,), step, jnp.float32)})
      mgr.wait_until_finished()
      seen.append((mgr.metrics.watermark, mgr.snapshot_steps()))
  # carriers are the even steps; step 6's capture agreed nothing (5 carried none)
  assert seen[4:] == [(4, [4, 5]), (4, [4, 6]), (6, [6, 7])], seen


def test_a_failed_read_saves_and_deletes_nothing_and_the_next_agreement_still_starts(
    store_dir):
  """The agreement started at step 3's capture fails when step 4 reads it:
  step 4 takes no snapshot and deletes nothing (counted), yet starts its own
  agreement like every other process would (one reduction a capture: the
  job's collectives stay in one order), and step 5 saves again."""
  import jax
  import jax.numpy as jnp

  import snapstore
  from tests.helpers import opts
  with snapstore.SnapshotManager(opts(store_dir, keep=2, run_id="wm")) as mgr:
    started = []
    real = mgr._saver.reduce_min

    def reduce_min(values):
      started.append(len(started) + 1)  # the step whose capture starts it
      read = real(values)
      if len(started) == 3:
        def read():
          raise jax.errors.JaxRuntimeError("a peer is gone")
      return read
    mgr._saver.reduce_min = reduce_min
    held = {}
    for step in range(1, 7):
      mgr.save(step, {"w": jnp.full((64,), step, jnp.float32)})
      mgr.wait_until_finished()
      held[step] = mgr.snapshot_steps()
    assert started == [1, 2, 3, 4, 5, 6]
    assert mgr.metrics.store_failures == 1
    # nothing deleted at 4; 5 learns step 3 (held by every store at 4's capture)
    assert held == {1: [1], 2: [1, 2], 3: [1, 2, 3], 4: [1, 2, 3], 5: [2, 3, 5],
                    6: [3, 5, 6]}, held


@pytest.mark.parametrize("keep, budget, held, mark", [
    (2, None, [3, 4, 5], 3),      # overlapped: the agreement read a capture later
    (2, 1 << 30, [4, 5], 4),      # a budget may leave 2 slots: read before evicting
    (1, None, [4, 5], 4)])        # 2 slots: read before evicting
def test_the_options_alone_choose_when_the_agreement_is_read(store_dir, keep, budget, held,
                                                              mark):
  """Every process picks the same mode (their collectives must come in one
  order), from ``keep`` and the store's ``budget_bytes`` alone."""
  import jax.numpy as jnp

  import snapstore
  from tests.helpers import opts
  with snapstore.SnapshotManager(opts(store_dir, keep=keep, budget_bytes=budget)) as mgr:
    for step in range(1, 6):
      mgr.save(step, {"w": jnp.full((64,), step, jnp.float32)})
      mgr.wait_until_finished()
    assert (mgr.snapshot_steps(), mgr.metrics.watermark) == (held, mark)
