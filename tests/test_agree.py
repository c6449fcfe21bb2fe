"""The sparse restore's agreement, needs and rounds, on one process (the real
collectives run in tests/test_multihost.py; the scale in benchmarks.scale)."""

import numpy as np
import pytest

from snapstore import _agree, _sparse
from snapstore._collective import NONE, bucket


def test_records_round_trip_and_the_freshest_agreed_step_wins():
  recs = [_agree.Record(h, s, 3, 0, 77) for h in range(3) for s in (10, 11)]
  recs = [r for r in recs if not (r.host == 2 and r.step == 11)]  # host 2 lost step 11
  rows = np.stack([_agree.encode_row([r for r in recs if r.host == h], 2).view(np.uint8)
                   for h in range(3)])
  back = _agree.decode_rows(rows, 2)
  assert sorted(back, key=lambda r: (r.host, r.step)) == sorted(
      recs, key=lambda r: (r.host, r.step))
  cands = _agree.candidates(back)
  assert [(c.step, c.holders) for c in cands] == [(11, (0, 1)), (10, (0, 1, 2))]
  assert [c.step for c in _agree.candidates(back, step=10)] == [10]


def test_a_step_whose_hosts_disagree_is_skipped_with_the_reason():
  recs = [_agree.Record(0, 5, 0, 0, 1), _agree.Record(1, 5, 0, 0, 2),
          _agree.Record(0, 4, 0, 0, 9), _agree.Record(1, 4, 0, 0, 9)]
  reasons = []
  assert [c.step for c in _agree.candidates(recs, reasons=reasons)] == [4]
  assert reasons == ["step 5: hosts disagree on the leaves, scalars or extra"]


def test_records_of_a_superseded_incarnation_are_fenced():
  # incarnation 1 restored step 5 and went on: incarnation 0's step 6 is abandoned
  recs = [_agree.Record(0, 6, 0, 0, 1), _agree.Record(0, 5, 1, 0, 2),
          _agree.Record(1, 6, 0, 0, 1), _agree.Record(1, 5, 1, 0, 2)]
  assert [(c.step, c.incarnation) for c in _agree.candidates(recs)] == [(5, 1)]


@pytest.mark.parametrize("values", [(0, 1, -1), (2**48, 7, -(2**48)), (-5, 3, 2**31 + 5)])
def test_min64_and_max64_are_exact_over_int32_reductions(values):
  other = (3, 2**40, -(2**47))

  class Two:
    def __init__(self):
      self.parts = []

    def reduce_min(self, mine):
      # what the other host puts in at the same call, computed as it would
      u = [int(v) + (1 << 60) for v in (self.sign * np.array(other, dtype=object))]
      if not self.parts:
        theirs = np.array([x >> 31 for x in u], np.int32)
      else:
        hi = self.parts[0]
        theirs = np.array([x & ((1 << 31) - 1) if (x >> 31) == int(h) else NONE
                           for x, h in zip(u, hi, strict=True)], np.int32)
      out = np.minimum(mine, theirs)
      self.parts.append(out)
      return out
  c = Two()
  c.sign = 1
  assert _agree.min64(c, values) == tuple(min(a, b) for a, b in zip(values, other, strict=True))
  c = Two()
  c.sign = -1
  assert _agree.max64(c, values) == tuple(max(a, b) for a, b in zip(values, other, strict=True))


def _planned(needs, holder, nbytes):
  cand = _agree.Candidate(1, 0, 0, (0,), False)
  return _sparse.Planned(cand, None, tuple(needs), tuple(holder), tuple(nbytes), (), ())


def test_rounds_send_and_receive_at_most_once_a_host_and_move_every_need_once():
  rng = np.random.default_rng(0)
  needs, holder, nbytes = [], [], []
  for i in range(200):
    dst = int(rng.integers(8))
    needs.append(_sparse.Need(dst, i, ((0, 1),)))
    holder.append(int((dst + rng.integers(1, 8)) % 8))
    nbytes.append(int(rng.integers(1, 50)) << 20)
  planned = _planned(needs, holder, nbytes)
  moved = []
  for r in _sparse.rounds(planned):
    assert len({b.src for b in r}) == len(r) and len({b.dst for b in r}) == len(r)
    for b in r:
      assert b.nbytes <= max(_sparse.BATCH_BYTES, max(nbytes[i] for i in b.needs))
      assert all(holder[i] == b.src and needs[i].needer == b.dst for i in b.needs)
      moved.extend(b.needs)
  assert sorted(moved) == list(range(200))


def test_a_need_no_host_holds_is_lost_or_a_parity_or_layout_fallback():
  specs = [type("S", (), {"path": "w"})()]
  needs = [_sparse.Need(1, 0, ((0, 4),))]
  cand = _agree.Candidate(3, 0, 0, (0, 2), False)
  assert _sparse.verdict(needs, np.array([2, NONE], np.int32), cand, 4, specs) == (3,)
  got = _sparse.verdict(needs, np.array([NONE, NONE], np.int32), cand, 4, specs)
  assert isinstance(got, _sparse.Lost) and "host 1's piece" in got.why and "'w'" in got.why
  got = _sparse.verdict(needs, np.array([NONE, 1], np.int32), cand, 4, specs)
  assert isinstance(got, _sparse.Fallback) and "target layout differs" in got.why
  parity = _agree.Candidate(3, 0, 0, (0, 2), True)
  got = _sparse.verdict(needs, np.array([NONE, NONE], np.int32), parity, 4, specs)
  assert isinstance(got, _sparse.Fallback) and "parity" in got.why


def test_a_header_that_does_not_match_the_agreed_digest_is_refused():
  import msgpack
  blob = msgpack.packb([[], [], None, 1 << 20, "d" * 32, 2], use_bin_type=True)
  header = _sparse.header_from(blob, _agree.digest_of(blob))
  assert header.chunk_bytes == 1 << 20 and header.num_hosts == 2
  with pytest.raises(ValueError, match="does not match the digest"):
    _sparse.header_from(blob, _agree.digest_of(blob) ^ 1)


def test_collective_buckets_grow_by_at_most_an_eighth():
  for n in range(1, 1 << 16, 37):
    assert n <= bucket(n) <= max(64, n + n // 8)


def test_scale_benchmark_one_host_lost_only_its_replacement_receives_its_share(tmp_path):
  from benchmarks import scale
  out = scale.main(["--sizes", "8", "16", "--cases", "none", "one", "two",
                    "--redundancy", "replicas", "--out", str(tmp_path / "s.json")])
  rows = {(r["n"], r["case"]): r for r in out["rows"]}
  for n in (8, 16):
    assert rows[(n, "none")]["verdict"] == "snapshot"
    assert set(rows[(n, "none")]["state_received"].values()) == {0}
    one = rows[(n, "one")]
    assert one["verdict"] == "snapshot"
    got = one["state_received"]
    lost = n // 2
    # its share, less the replicated leaves counted once a device in the share
    assert 0 < one["state_share_bytes"] - got[lost] < 4096, (got, one["state_share_bytes"])
    assert all(v == 0 for h, v in got.items() if h != lost)
    assert rows[(n, "two")]["verdict"] == "persistent"  # a host and its keeper lost
    assert rows[(n, "one")]["payload_received_max"] < 1 << 20
