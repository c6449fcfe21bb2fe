"""A restore returns its outcome; the manager alone writes its fencing state;
one error type per misuse (host-file store, one process, 8 CPU devices)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import snapstore
from snapstore import _restore
from tests.helpers import assert_bitwise_equal, host_copy, opts


def state_at(step):
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("d",))
  return {"w": jax.device_put(jnp.arange(16 * 8, dtype=jnp.float32).reshape(16, 8) + step,
                              NamedSharding(mesh, P("d"))),
          "step": step}


def abstract():
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                      if isinstance(x, jax.Array) else x, state_at(0))


def save_steps(mgr, steps, offset=0):
  refs = {}
  for s in steps:
    mgr.save(s, state_at(s + offset))
    refs[s] = host_copy(state_at(s + offset))
  mgr.wait_until_finished()
  return refs


def inputs_of(mgr):
  return _restore.Inputs(
      backend=mgr._backend, peers=mgr._peers, persistent=mgr.persistent, options=mgr.options,
      arenas=mgr._arenas, host=mgr.host, newest_step=mgr._newest_step,
      incarnation=mgr.incarnation)


def test_a_restore_returns_its_outcome_and_writes_nothing_into_the_manager(store_dir):
  with snapstore.SnapshotManager(opts(store_dir, keep=4)) as mgr:
    save_steps(mgr, [1, 2, 3])
    first = mgr.incarnation
    result, outcome = _restore.Restore(inputs_of(mgr), abstract(), 2, []).run()
    assert result.step == 2
    # step 3 of this incarnation is abandoned: saves continue as a new one
    assert outcome == _restore.Outcome(incarnation=first + 1, lineage_step=2)
    assert mgr.incarnation == first and mgr._lineage_step == 3  # untouched
    result, outcome = _restore.Restore(inputs_of(mgr), abstract(), None, []).run()
    assert outcome == _restore.Outcome(incarnation=first, lineage_step=3)


def test_a_fenced_older_incarnation_still_cannot_write(store_dir):
  """The manager applies the new branch's incarnation; a zombie of the old
  one that saves afterwards (later steps too) is fenced out of every restore."""
  with snapstore.SnapshotManager(opts(store_dir, keep=4)) as mgr:
    save_steps(mgr, [1, 2, 3])
    old = mgr.incarnation
    assert mgr.restore(abstract(), step=2).step == 2
    assert mgr.incarnation == old + 1  # applied by the manager
    refs = save_steps(mgr, [3, 4])
  with snapstore.SnapshotManager(opts(store_dir, incarnation=old, keep=4)) as zombie:
    save_steps(zombie, [4, 5], offset=1000)
  with snapstore.SnapshotManager(opts(store_dir, keep=4)) as mgr:
    assert 5 not in mgr.snapshot_steps()
    r = mgr.restore(abstract())
  assert r.step == 4 and r.source is snapstore.Source.SNAPSHOT
  assert_bitwise_equal(refs[4], r.state)


@pytest.mark.parametrize("step", ["2", 2.0, -1, True, 2**48 + 1])
def test_a_bad_step_is_one_error_in_save_and_restore(store_dir, step):
  with snapstore.SnapshotManager(opts(store_dir)) as mgr:
    save_steps(mgr, [1])
    for call in (lambda: mgr.save(step, state_at(2)), lambda: mgr.restore(abstract(), step=step)):
      with pytest.raises(snapstore.InvalidStepError, match="step must be an int") as e:
        call()
      assert isinstance(e.value, snapstore.SnapstoreError) and isinstance(e.value, ValueError)
    assert mgr.restore(abstract()).step == 1  # nothing changed


def test_a_closed_manager_raises_closed_error(store_dir):
  mgr = snapstore.SnapshotManager(opts(store_dir))
  save_steps(mgr, [1])
  mgr.close()
  mgr.close()  # idempotent
  for call in (lambda: mgr.save(2, state_at(2)), lambda: mgr.restore(abstract())):
    with pytest.raises(snapstore.ClosedError, match="closed") as e:
      call()
    assert isinstance(e.value, snapstore.SnapstoreError) and isinstance(e.value, RuntimeError)
