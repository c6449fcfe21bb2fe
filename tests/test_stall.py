"""The supervisor's stall watch (snapstore.testing.stall), on made-up progress."""

import pytest

from snapstore.testing.stall import StallPolicy, StallWatch

NONE = (-1, -1)


def _watch(**policy) -> StallWatch:
  w = StallWatch(StallPolicy(**policy))
  w.event(0.0)
  return w


def test_the_first_reading_is_a_baseline_and_start_up_gets_its_allowance():
  w = _watch()
  w.observe({0: (7, 0), 1: NONE}, 1.0)  # (a store left from an earlier incarnation)
  assert not w.stepping and w.period_s() == 120.0
  assert w.stalled_for(120.0) is None and w.stalled_for(121.0) == pytest.approx(121.0)
  assert w.phase().startswith("start-up")


def test_the_training_period_follows_the_median_step():
  w = _watch()
  w.observe({0: NONE, 1: NONE}, 0.5)
  for i in range(1, 12):  # a step every 5 s, after a first one that took 30 s to compile
    w.observe({0: (i, 0), 1: (i, 0)}, 30.0 + 5.0 * (i - 1))
  assert w.stepping and w.median_step_s == pytest.approx(5.0)
  assert w.period_s() == pytest.approx(100.0)  # 20 x 5 s, over the 60 s floor
  assert w.stalled_for(80.0 + 100.0) is None and w.stalled_for(80.0 + 101.0) is not None
  assert w.phase() == "training: no host went past step 11 ({0: 11, 1: 11})"


def test_a_process_start_or_exit_restarts_the_clock_with_the_start_up_allowance():
  w = _watch(min_s=10.0)
  w.observe({0: NONE}, 0.1)
  for i in range(1, 5):
    w.observe({0: (i, 0)}, float(i))
  assert w.period_s() == 20.0  # 20 x 1 s, over the 10 s floor
  w.event(50.0)
  assert not w.stepping and w.period_s() == 120.0 and w.stalled_for(100.0) is None


def test_a_fixed_period_and_bad_policies():
  assert _watch(period_s=5.0).period_s() == 5.0
  for bad in ({"period_s": 0.0}, {"min_s": float("nan")}, {"steps": -1.0},
              {"startup_s": float("inf")}):
    with pytest.raises(ValueError, match="StallPolicy"):
      StallPolicy(**bad)
