"""The sparse restore's agreement, needs and rounds, on one process (the real
collectives run in tests/test_multihost.py; the scale in benchmarks.scale, whose
smoke test is in tests/test_benchmarks.py)."""

import dataclasses

import numpy as np
import pytest

from snapstore import _planner
from snapstore._multihost import agree, moves, sparse
from snapstore._multihost.collective import NONE, bucket, gather_blobs
from snapstore._planner import REBUILT
from snapstore.testing.job_layout import STEPS, Layout, targets_of
from snapstore.testing.lockstep import lockstep


def _hosts(n, fn):
  return lockstep(n, list(range(n)), fn)


@pytest.fixture(scope="module")
def manifest():
  return Layout(2).manifest(0, 1, 0, parity=False)


def _m(base, host, step, inc=0, **kw):
  return dataclasses.replace(base, store=host, step=step, incarnation=inc, **kw)


def _cands(n, stores, **kw):
  def one(coll):
    reasons = []
    got = [(c.step, c.incarnation, tuple(c.holders.tolist())) for c in
           agree.candidates(coll, stores[coll.host], reasons=reasons, **kw)]
    return got, reasons
  out = _hosts(n, one)
  assert all(o == out[0] for o in out)  # every host draws the same
  return out[0]


def test_the_freshest_step_first_with_the_hosts_that_hold_it(manifest):
  stores = [[_m(manifest, h, s) for s in (10, 11) if not (h == 2 and s == 11)]
            for h in range(3)]
  got, reasons = _cands(3, stores)
  assert got == [(11, 0, (0, 1)), (10, 0, (0, 1, 2))] and reasons == []
  assert _cands(3, stores, step=10)[0] == [(10, 0, (0, 1, 2))]
  assert _cands(3, stores, step=12)[0] == []


def test_a_step_whose_hosts_disagree_is_skipped_with_the_reason(manifest):
  stores = [[_m(manifest, h, 4), _m(manifest, h, 5, extra={"host": h})] for h in range(2)]
  got, reasons = _cands(2, stores)
  assert [g[0] for g in got] == [4]
  assert reasons == ["step 5: hosts disagree on the leaves, scalars or extra"]


@pytest.mark.parametrize("change", [{"extra": {"host": 1}}, {"num_hosts": 3}])
def test_the_sparse_and_the_full_restore_refuse_the_same_disagreement(manifest, change):
  """One rule (``_planner.shared_content``): what the hosts agree on in the
  sparse restore is what the planner compares over gathered manifests."""
  ms = [_m(manifest, 0, 5), _m(manifest, 1, 5, **change)]
  why = "step 5: hosts disagree on the leaves, scalars or extra"
  assert _cands(2, [[ms[0]], [ms[1]]]) == ([], [why])
  reasons = []
  assert _planner.plan_step(5, ms, reasons=reasons) is None and reasons == [why]
  assert _planner.plan_step(5, [ms[0], _m(manifest, 1, 5)]) is not None


def test_a_step_a_newer_incarnation_abandoned_is_fenced(manifest):
  # incarnation 1 restored step 5 and went on (host 0); host 1 still holds
  # incarnation 0's steps 4 and 6: 6 is abandoned, 4 is not
  stores = [[_m(manifest, 0, 5, 1), _m(manifest, 0, 7, 1)],
            [_m(manifest, 1, 4, 0), _m(manifest, 1, 6, 0)]]
  got, reasons = _cands(2, stores)
  assert got == [(7, 1, (0,)), (5, 1, (0,)), (4, 0, (1,))]
  assert any("step 6: superseded by incarnation 1" in r for r in reasons), reasons


def test_restoring_before_this_incarnation_s_newest_step_starts_a_new_one(manifest):
  stores = [[_m(manifest, h, s, 2) for s in (5, 6)] for h in range(2)]
  assert _hosts(2, lambda c: agree.branch(c, stores[c.host], 5, 2)) == [3, 3]
  assert _hosts(2, lambda c: agree.branch(c, stores[c.host], 6, 2)) == [2, 2]


@pytest.mark.parametrize("values", [(0, 1, -1), (2**48, 7, -(2**48)), (-5, 3, 2**31 + 5)])
def test_min64_and_max64_are_exact_over_int32_reductions(values):
  other = (3, 2**40, -(2**47))
  pick = lambda c: values if c.host == 0 else other  # noqa: E731
  lo = tuple(min(a, b) for a, b in zip(values, other, strict=True))
  hi = tuple(max(a, b) for a, b in zip(values, other, strict=True))
  assert _hosts(2, lambda c: agree.min64(c, pick(c))) == [lo, lo]
  assert _hosts(2, lambda c: agree.max64(c, pick(c))) == [hi, hi]


def test_gather_blobs_lays_the_senders_blobs_end_to_end():
  blobs = [b"", b"ab", b"", b"\x00\x01\x02" * 50, b"z"]
  got = _hosts(5, lambda c: gather_blobs(c, blobs[c.host]))
  assert got == [blobs] * 5
  assert _hosts(3, lambda c: gather_blobs(c, b"")) == [[b""] * 3] * 3


def _planned(needs, holder, nbytes):
  cand = agree.Candidate(1, 0, 0, np.array([0]), False)
  return sparse.Planned(cand, None, tuple(needs), tuple(holder), tuple(nbytes), (), ())


def test_rounds_send_and_receive_at_most_once_a_host_and_move_every_need_once():
  rng = np.random.default_rng(0)
  needs, holder, nbytes = [], [], []
  for i in range(200):
    dst = int(rng.integers(8))
    needs.append(sparse.Need(dst, i, ((0, 1),)))
    holder.append(int((dst + rng.integers(1, 8)) % 8))
    nbytes.append(int(rng.integers(1, 50)) << 20)
  planned = _planned(needs, holder, nbytes)
  moved = []
  for r in moves.rounds(planned):
    assert len({b.src for b in r}) == len(r) and len({b.dst for b in r}) == len(r)
    for b in r:
      assert b.nbytes <= max(moves.BATCH_BYTES, max(it.nbytes for it in b.items))
      assert all(holder[it.ref] == b.src and needs[it.ref].needer == b.dst for it in b.items)
      moved.extend(it.ref for it in b.items)
  assert sorted(moved) == list(range(200))


def test_a_need_no_host_holds_is_lost_or_rebuilt_or_a_layout_fallback():
  specs = [type("S", (), {"path": "w"})()]
  needs = [sparse.Need(1, 0, ((0, 4),))]
  cand = agree.Candidate(3, 0, 0, np.array([0, 2]), False)
  assert sparse.verdict(needs, np.array([2, NONE], np.int32), cand, 4, specs) == (3,)
  got = sparse.verdict(needs, np.array([NONE, NONE], np.int32), cand, 4, specs)
  assert isinstance(got, sparse.Lost) and "host 1's piece" in got.why and "'w'" in got.why
  got = sparse.verdict(needs, np.array([NONE, 1], np.int32), cand, 4, specs)
  assert isinstance(got, sparse.Fallback) and "target layout differs" in got.why
  parity = agree.Candidate(3, 0, 0, np.array([0, 2]), True)
  got = sparse.verdict(needs, np.array([NONE, NONE], np.int32), parity, 4, specs)
  assert got == (REBUILT,)  # its stripes are asked next (_rebuild)


def test_a_header_that_does_not_match_the_agreed_digest_is_refused():
  import msgpack
  blob = msgpack.packb([[], [], None, 1 << 20, "d" * 32, 2], use_bin_type=True)
  header = sparse.header_from(blob, agree.digest_of(blob))
  assert header.chunk_bytes == 1 << 20 and header.num_hosts == 2
  with pytest.raises(ValueError, match="does not match the digest"):
    sparse.header_from(blob, agree.digest_of(blob) ^ 1)


def test_collective_buckets_grow_by_at_most_an_eighth():
  for n in range(1, 1 << 16, 37):
    assert n <= bucket(n) <= max(64, n + n // 8)


@pytest.mark.parametrize("shift", [1, 2])
def test_keepers_are_found_whatever_domain_size_the_save_used(shift):
  """Saved with failure domains of ``shift`` hosts (the ring keeps host h's
  replicas on h + shift), restored by a job that knows nothing of it: every
  piece of the lost host comes from its keeper, found by the holders'
  minimum, not derived from options (no full exchange is needed)."""
  n, lost = 8, 4
  layout = Layout(n)
  stores = {h: [] if h == lost else [layout.manifest(h, s, i, parity=False, shift=shift)
                                     for i, s in enumerate(STEPS)] for h in range(n)}

  def one(coll):
    cand = next(agree.candidates(coll, stores[coll.host]))
    return sparse.plan(coll, sparse.manifests_at(stores[coll.host], cand), cand,
                        layout.specs, targets_of(layout, coll.host))
  got = _hosts(n, one)
  assert all(isinstance(p, sparse.Planned) for p in got)
  p = got[0]
  assert {nd.needer for nd in p.needs} == {lost}
  sharded = {i for i, a in enumerate(layout.axes) if a is not None}
  from_keeper = {p.holder[i] for i, nd in enumerate(p.needs) if nd.pos in sharded}
  assert from_keeper == {(lost + shift) % n}
  assert {p.holder[i] for i, nd in enumerate(p.needs) if nd.pos not in sharded} == {lost + 1}


def _offer(stripe, block, members, layout=None, usable=True, length=24):
  return [stripe, block, list(members), length, usable, layout]


def test_a_stripe_rebuilds_with_one_lost_member_and_every_other_block():
  from snapstore._multihost import rebuild
  members = (0, 1, 2, 3)
  layout = [[[0, [[m * 2, m * 2 + 2]]]] for m in members]  # one piece a member
  rows = {1: [_offer(7, 1, members, layout)], 2: [_offer(7, 2, members)],
          3: [_offer(7, 3, members)]}
  got, why = rebuild.decide(5, rows, {0}, [(0, 0, ((0, 2),))], num_leaves=1)
  assert why is None and [(s.stripe, s.lost, s.needers) for s in got] == [(7, 0, (0,))]
  # host 0's piece needed by host 2 instead (the target order moved it)
  got, _ = rebuild.decide(5, rows, {0}, [(2, 0, ((0, 2),))], num_leaves=1)
  assert got[0].needers == (2,)


def test_a_stripe_that_cannot_rebuild_says_why_naming_its_group():
  from snapstore._multihost import rebuild
  members = (0, 1, 2, 3)
  layout = [[[0, [[m * 2, m * 2 + 2]]]] for m in members]
  want = [(0, 0, ((0, 2),))]
  two = {1: [_offer(7, 1, members)], 3: [_offer(7, 3, members)]}
  _, why = rebuild.decide(5, two, {0, 2}, want, num_leaves=1)
  assert why == ("step 5: the group of hosts [0, 1, 2, 3] (stripe 7) lost hosts [0, 2]; "
                 "parity rebuilds one lost host of a group")
  bad = {1: [_offer(7, 1, members, layout)], 2: [_offer(7, 2, members, usable=False)],
         3: [_offer(7, 3, members)]}
  _, why = rebuild.decide(5, bad, {0}, want, num_leaves=1)
  assert "parity blocks of hosts [2] are unusable" in why
  broken = {1: [_offer(7, 1, members, [[[9, [[0, 2]]]]] * 4)], 2: [_offer(7, 2, members)],
            3: [_offer(7, 3, members)]}
  _, why = rebuild.decide(5, broken, {0}, want, num_leaves=1)
  assert "layout is malformed" in why and "leaf 9" in why
  ok = {1: [_offer(7, 1, members, layout)], 2: [_offer(7, 2, members)],
        3: [_offer(7, 3, members)]}
  _, why = rebuild.decide(5, ok, {0}, [(0, 0, ((4, 6),))], num_leaves=1)
  assert "no surviving copy or parity stripe of host 0's piece" in why


def test_offers_that_disagree_on_a_stripe_lose_the_step_on_every_host():
  from snapstore._multihost import rebuild
  members = (0, 1, 2, 3)
  want = [(0, 0, ((0, 2),))]
  twice = {1: [_offer(7, 1, members)], 2: [_offer(7, 1, members)], 3: [_offer(7, 3, members)]}
  other = {1: [_offer(7, 1, members)], 2: [_offer(7, 2, (0, 1, 2, 5))]}
  for rows in (twice, other):
    _, why = rebuild.decide(5, rows, {0}, want, num_leaves=1)
    assert why == "step 5: the parity blocks of stripe 7 disagree on its layout"


def test_a_live_host_s_bad_copy_is_rebuilt_from_its_stripe():
  """No host lost; host 2's own copy of one protected piece failed its check
  (parity: no other copy): its stripe rebuilds it for host 2, not an older
  step."""
  n = 4
  layout = Layout(n)
  stores = {h: [layout.manifest(h, s, i, parity=True) for i, s in enumerate(STEPS)]
            for h in range(n)}
  leaf = next(i for i, a in enumerate(layout.axes) if a is not None)
  region = layout.index(leaf, 4 * 2 + 1)  # host 2's second device
  bad = {(2, STEPS[-1], leaf, region)}

  def one(coll):
    cand = next(agree.candidates(coll, stores[coll.host]))
    return sparse.plan(coll, sparse.manifests_at(stores[coll.host], cand), cand,
                        layout.specs, targets_of(layout, coll.host), bad=bad)
  got = _hosts(n, one)
  assert all(isinstance(p, sparse.Planned) for p in got), got
  p = got[0]
  assert [(nd.needer, nd.region, nd.own_bad) for nd in p.needs] == [(2, region, True)]
  assert p.holder == (REBUILT,)
  (st,) = p.stripes
  assert st.needers == (2,) and st.layout.members[st.lost] == 2
  assert (leaf, region) in st.layout.pieces[st.lost]
