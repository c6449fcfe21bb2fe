"""MaxText's own elastic training (single controller, Pathways) recovering
from per-slice RAM snapshots: real MaxText 0.2.5 (tiny decoder) on 8 CPU
devices as 2 virtual slices, in one process per job, slice 1 lost with
pathwaysutils' ``DeviceLossSimulator``, what its store held raising DATA_LOSS
when read (``benchmarks._maxtext_elastic`` says what else is simulated, and
what is not exercised).

MaxText's default mesh here is fsdp over all 8 devices: no piece has a
data-parallel twin in the other slice, so every piece of the lost slice comes
from its cross-slice copy in slice 0's pinned host memory.

Needs MaxText (Python >= 3.12); skipped without it.
"""

import random

import pytest

pytest.importorskip(
    "maxtext", reason="MaxText is not installed (Python >= 3.12: pip install --no-deps -r "
           "requirements/maxtext-0.2.5-cpu.txt)")

from benchmarks.maxtext import run_elastic

pytestmark = pytest.mark.slow  # real MaxText jobs: the full suite only

STEPS = 9
PERIOD = 3  # MaxText's own Orbax checkpoint period
# Pause-resume: slice 1 lost after a seeded step, and again two steps later
# with the only surviving copy of a piece of that step spoiled (never on
# MaxText's period: there its Orbax step would rightly win).
FIRST = random.Random(37).choice([s for s in range(2, STEPS - 3) if (s + 2) % PERIOD])
SECOND = FIRST + 2


@pytest.fixture(scope="module")
def work(tmp_path_factory):
  return tmp_path_factory.mktemp("mt-elastic")


@pytest.fixture(scope="module")
def uninterrupted(work):
  """MaxText alone, elastic on, no fault."""
  r = run_elastic(work, "ref", steps=STEPS, period=PERIOD, snapshots=False,
                  cache_dir=work / "jc")
  assert r["elastic"] == [] and str(STEPS - 1) in r["digests"]
  return r


def final(report):
  return report["digests"][str(STEPS - 1)]


def same_losses(report, reference):
  """Every loss the run logged (a later attempt's overwrites an earlier
  one's) equals the reference's, and at least half the steps logged one
  (MaxText buffers its metrics: an event drops the buffered ones)."""
  logged = report["losses"]
  assert len(logged) >= STEPS // 2, sorted(logged)
  for s, loss in logged.items():
    assert loss == reference["losses"][s], s


def forgotten_at_the_event(report):
  """No restore read the lost slice's store: the hook forgot it when the
  event came (reading it raises, and the restore would say so)."""
  for e in report["elastic"]:
    said = [*(e["restore"]["notes"] or ()), e["restore"]["why"] or ""]
    assert not any("raised on read" in n for n in said), e
    assert e["first_new_step"] == (e["restore"]["step"] or 0) + 1, e


def events(report):
  return [(e["kind"], e["lost_slices"], e["active_slices"], e["restore"]["source"],
           e["restore"]["step"], e["steps_lost"]) for e in report["elastic"]]


def test_pause_resume_restores_from_the_surviving_slice_and_a_bad_copy_is_never_used(
    work, uninterrupted):
  """Slice 1 is lost after step FIRST, then after step SECOND. The first
  restore is step FIRST from RAM (rewind 0). Before the second, a byte of
  slice 0's copy of a slice-1 piece of step SECOND is flipped: that step has
  no good copy left, and the step before is restored (rewind 1), never the
  bad bytes. Every loss after and the final state equal the uninterrupted
  run's, bitwise."""
  r = run_elastic(work, "pause", steps=STEPS, period=PERIOD, snapshots=True,
                  cache_dir=work / "jc", lose=[FIRST, SECOND], flip=[SECOND])
  assert r["store"] == "pinned_host"
  assert [f.get("flipped") is not None for f in r["worker"]["faults"]] == [False, True]
  assert events(r) == [("slice_down", [1], [0, 1], "snapshot", FIRST, 0),
                       ("slice_down", [1], [0, 1], "snapshot", SECOND - 1, 1)]
  notes = r["elastic"][1]["restore"]["notes"]
  assert any("checksum mismatch" in n and f"step {SECOND}" in n for n in notes), notes
  forgotten_at_the_event(r)
  same_losses(r, uninterrupted)
  assert final(r) == final(uninterrupted)


def test_without_cross_slice_copies_maxtexts_orbax_restores_with_the_reason(
    work, uninterrupted):
  r = run_elastic(work, "norep", steps=STEPS, period=PERIOD, snapshots=True,
                  cache_dir=work / "jc", lose=[4], replicas=0)
  ((kind, lost, _, source, step, steps_lost),) = events(r)
  assert (kind, lost, source, step, steps_lost) == ("slice_down", [1], "maxtext", 3, 1)
  assert "no complete snapshot" in r["elastic"][0]["restore"]["why"]
  forgotten_at_the_event(r)
  same_losses(r, uninterrupted)
  assert final(r) == final(uninterrupted)


def test_replica_resize_then_scale_up_equals_maxtext_alone_and_scale_up_rewinds_0(work):
  """Slice 1 lost after step 4: MaxText goes on on slice 0 (4 devices);
  slice 1 returns at step 6, a checkpoint-period step, where MaxText
  signals the scale-up right after its Orbax save: the hook snapshots step
  6 first, so the scale-up rewinds 0. The reference is MaxText alone saving
  Orbax every step on the same schedule: equal bitwise."""
  kw = dict(steps=STEPS, cache_dir=work / "jc", resize=True, lose=[4], back=6)
  ours = run_elastic(work, "resize", period=PERIOD, snapshots=True, **kw)
  alone = run_elastic(work, "resize-alone", period=1, snapshots=False, **kw)
  expected = [("slice_down", [1], [0], "snapshot", 4, 0),
              ("scale_up", [], [0, 1], "snapshot", 6, 0)]
  assert events(ours) == expected
  forgotten_at_the_event(ours)
  assert events(alone) == [(*e[:3], "maxtext", *e[4:]) for e in expected]
  assert final(ours) == final(alone)
  same_losses(ours, alone)
