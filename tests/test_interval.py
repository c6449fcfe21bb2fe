"""``interval=AutoInterval(...)``: the Young/Daly rule, and the interval a manager
chooses from what it measures (1 for a tiny state, more for a costly one)."""

import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import snapstore
from snapstore._interval import young_daly_steps


@pytest.mark.parametrize("cost,mtbf,step", [(0.01, 3600.0, 0.3), (2.0, 86400.0, 3.0),
                                            (1e-4, 1.0, 0.05), (0.5, 10.0, 0.001)])
def test_rule_is_young_daly_in_whole_steps(cost, mtbf, step):
  assert young_daly_steps(cost, mtbf, step) == max(1, math.floor(math.sqrt(2 * cost * mtbf)
                                                                  / step))


def test_rule_grows_with_cost_and_mtbf_and_shrinks_with_step():
  base = young_daly_steps(0.05, 3600, 0.3)
  assert young_daly_steps(0.2, 3600, 0.3) > base
  assert young_daly_steps(0.05, 4 * 3600, 0.3) > base
  assert young_daly_steps(0.05, 3600, 1.2) < base
  assert young_daly_steps(0.0, 3600, 0.3) == 1


def run_auto(store_dir, state, step_fn, steps, mtbf):
  opts = snapstore.SnapshotOptions(store=snapstore.HostFiles(dir=store_dir),
                                   interval=snapstore.AutoInterval(mtbf))
  saved = 0
  with snapstore.SnapshotManager(opts) as mgr:
    for s in range(steps):
      state = step_fn(state)
      saved += mgr.save(s, state)
    mgr.wait_until_finished()
    return mgr.metrics, saved


def test_auto_interval_is_1_for_a_tiny_state_and_grows_for_a_costly_one(store_dir):
  tiny = {"w": jnp.ones((16,), jnp.float32)}

  def slow_step(s):
    time.sleep(0.05)  # a step much longer than the snapshot
    return jax.tree.map(lambda x: x + 1, s)
  # MTBF 0.1 s: interval 1 holds while a save costs under ~50 ms (a loaded
  # CI machine's save of 64 bytes stays far below), not ~5 ms as at 1 s.
  m, saved = run_auto(store_dir / "tiny", tiny, slow_step, 30, mtbf=0.1)
  assert m.interval == 1 and saved == 30, m.interval_reason
  assert "Young/Daly" in m.interval_reason

  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("d",))
  big = {"w": jax.device_put(jnp.ones((32 << 20) // 4, jnp.float32),
                             jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d")))}
  fast = jax.jit(lambda s: jax.tree.map(lambda x: x * 1.0001, s))
  m, saved = run_auto(store_dir / "big", big, fast, 60, mtbf=1.0)
  assert m.interval > 1 and saved < 60, m.interval_reason
  # the rule, applied to what it measured, is what it chose
  assert f"every {m.interval} steps" in m.interval_reason


def test_auto_needs_an_mtbf():
  with pytest.raises(TypeError, match="host_mtbf_s"):
    snapstore.AutoInterval()  # type: ignore[call-arg]
  with pytest.raises(TypeError, match="AutoInterval"):
    snapstore.SnapshotOptions(interval="auto")


def simulate(schedule, steps, *, step_s, blocking_s, drain_s, slowdown_s):
  """A training loop on a made-up clock: a snapshot blocks ``blocking_s``, its
  drain runs ``drain_s`` behind it, and a step it overlaps takes ``slowdown_s``
  longer. Returns the steps snapshotted."""
  now, busy_until, taken = 0.0, 0.0, []
  for step in range(steps):
    if schedule.due(step, now, busy_until):
      taken.append(step)
      schedule.on_snapshot(step, blocking_s)
      now += blocking_s
      busy_until = now + drain_s
      schedule.on_drain(drain_s)
    now += step_s + (slowdown_s if busy_until > now else 0.0)
  return taken


def test_auto_goes_back_to_every_step_when_the_overlapped_drain_slows_no_step():
  from snapstore._interval import YoungDalySchedule
  # A staged capture: save blocks 10 ms, the drain takes 300 ms behind a 400 ms
  # step and slows none. The first estimate counts the whole drain (no step
  # without one is seen yet at interval 1), so the interval grows; once steps of
  # both kinds are seen, the measured cost is the 10 ms and the rule says 1.
  sched = YoungDalySchedule(job_mtbf_s=20.0)
  taken = simulate(sched, 120, step_s=0.4, blocking_s=0.01, drain_s=0.3, slowdown_s=0.0)
  assert young_daly_steps(0.31, 20.0, 0.4) > 1 == young_daly_steps(0.01, 20.0, 0.4)
  assert sched.interval == 1, sched.reason
  assert taken[-20:] == list(range(100, 120)), taken  # every step at the end
  assert "measured slowdown 0.0000" in sched.reason

  # The same drain slowing each step it overlaps by 100 ms costs ~110 ms a
  # snapshot: the interval stays where that cost puts it.
  slow = YoungDalySchedule(job_mtbf_s=20.0)
  simulate(slow, 120, step_s=0.4, blocking_s=0.01, drain_s=0.3, slowdown_s=0.1)
  assert slow.interval == young_daly_steps(0.11, 20.0, 0.4) > 1, slow.reason
