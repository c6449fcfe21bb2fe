"""Bad input to save and restore gets a SnapstoreError that names the step,
leaf or option, and loses nothing (one host, 8 CPU devices)."""

import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import snapstore
from tests.helpers import assert_bitwise_equal, opts


def _state():
  mesh = Mesh(np.array(jax.devices()), ("x",))
  return {"w": jax.device_put(jnp.arange(64, dtype=jnp.float32),
                              NamedSharding(mesh, P("x"))),
          "b": jnp.ones((3,), jnp.float32), "step": 1}


def test_saving_an_older_step_than_the_last_is_refused_and_a_restore_starts_over(store_dir):
  state = _state()
  with snapstore.SnapshotManager(opts(store_dir)) as mgr:
    mgr.save(5, state)
    with pytest.raises(snapstore.StepOrderError, match=r"step 3 after step 5.*restore"):
      mgr.save(3, state)
    mgr.wait_until_finished()
    assert mgr.restore(state).step == 5  # nothing of step 3 was written
    mgr.save(6, state)
    mgr.wait_until_finished()
    assert mgr.restore(state, step=5).step == 5  # back to 5: a new lineage
    mgr.save(6, state)  # allowed again, as the new branch's next step
    mgr.wait_until_finished()
    got = mgr.restore(state)
  assert got.step == 6
  assert_bitwise_equal(state, got.state)


def test_saving_a_deleted_buffer_names_the_leaf(store_dir):
  state = _state()
  state["b"].delete()  # what a donation to a jitted step leaves behind
  with snapstore.SnapshotManager(opts(store_dir)) as mgr:
    with pytest.raises(snapstore.DeletedLeafError, match=r"step 2: leaf 'b' .*deleted"):
      mgr.save(2, state)
    assert mgr.snapshot_steps() == []


def test_restoring_onto_a_sharding_that_does_not_divide_a_leaf_names_it(store_dir):
  state = _state()
  mesh = Mesh(np.array(jax.devices()), ("x",))
  with snapstore.SnapshotManager(opts(store_dir)) as mgr:
    mgr.save(1, state)
    mgr.wait_until_finished()
    target = dict(state, b=jax.ShapeDtypeStruct((3,), jnp.float32,
                                                sharding=NamedSharding(mesh, P("x"))))
    with pytest.raises(snapstore.TreeMismatchError, match=r"b.*cannot hold shape \[3\]") as e:
      mgr.restore(target)
    assert "b" in e.value.leaf
    assert mgr.restore(state).step == 1  # nothing lost


@pytest.mark.parametrize("step", ["2", 2.0, -1, True])
def test_a_step_that_is_no_int_is_refused_as_such(store_dir, step):
  state = _state()
  with snapstore.SnapshotManager(opts(store_dir)) as mgr:
    mgr.save(2, state)
    mgr.wait_until_finished()
    with pytest.raises(snapstore.InvalidStepError, match="step must be an int"):
      mgr.restore(state, step=step)
    assert mgr.restore(state, step=2).step == 2


def test_close_releases_the_last_restore_s_slot_mappings(store_dir):
  state = _state()
  mgr = snapstore.SnapshotManager(opts(store_dir))
  mgr.save(1, state)
  mgr.wait_until_finished()
  mgr.restore(state)
  backend = mgr._backend
  assert backend._views  # the restore mapped its slot
  mgr.close()
  assert not backend._views
  gc.collect()
