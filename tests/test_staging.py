"""On-device staging of a capture (``SnapshotOptions.stage_on_device``).

On CPU devices staging is a host copy, so the staged path runs here through
both backends (the pinned-host one as on an accelerator: puts to
``pinned_host`` and on-device sums); the state given to ``save`` is donated to the
next step at once, and the restore must still be bitwise the saved step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import snapstore
from snapstore import _staging
from snapstore.testing.backend_suite import abstract
from snapstore.testing.checks import assert_bitwise_equal, host_copy
from tests.helpers import opts


def _state():
  mesh = jax.make_mesh((8,), ("d",))
  s = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
  return {"w": jax.device_put(jnp.arange(64 * 1024, dtype=jnp.float32), s),
          "b": jax.device_put(jnp.ones((8, 16), jnp.bfloat16), s), "step": 0,
          "key": jax.random.key(3)}


_donating_step = jax.jit(lambda s: {**s, "w": s["w"] * 2 + 1, "b": s["b"] + 1},
                         donate_argnums=0)


@pytest.mark.parametrize("store", [snapstore.StoreKind.HOST_FILES,
                                   snapstore.StoreKind.PINNED_HOST])
def test_a_staged_capture_survives_the_next_step_donating_the_state(store_dir, store):
  slices = ({0: jax.devices()[:4], 1: jax.devices()[4:]}
            if store is snapstore.StoreKind.PINNED_HOST else None)
  o = opts(store_dir, store=store, stage_on_device=True,
           **({"pinned_checksum": "device"} if slices else {}))
  with snapstore.SnapshotManager(o, slices=slices) as mgr:
    state = _state()
    want, want_sharding = host_copy(state), state["w"].sharding
    assert mgr.save(1, state)
    # one shard of each staged leaf per device: 64K/8 float32 + one bf16 row of 16
    assert mgr.metrics.staged_bytes == 8 * 1024 * 4 + 16 * 2
    state = _donating_step(state)  # the saved buffers are donated now
    assert state["w"].sharding == want_sharding
    r = mgr.restore(abstract(_state()))
  assert r.step == 1
  assert_bitwise_equal(r.state, want)


def test_nothing_is_staged_by_default(store_dir):
  with snapstore.SnapshotManager(opts(store_dir)) as mgr:
    assert mgr.save(1, _state())
    assert mgr.metrics.staged_bytes == 0


def test_a_staging_failure_saves_from_the_state_itself(store_dir, monkeypatch, caplog):
  def fail(arrays):
    raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: out of memory staging")
  monkeypatch.setattr(_staging, "_copy", fail)
  with snapstore.SnapshotManager(opts(store_dir, stage_on_device=True)) as mgr:
    state = _state()
    want = host_copy(state)
    assert mgr.save(1, state)
    assert mgr.metrics.staged_bytes == 0 and mgr.metrics.store_failures == 0
    assert not mgr._saver.stager.on  # not tried again
    r = mgr.restore(abstract(_state()))
  assert "staging the capture in device memory failed" in caplog.text
  assert_bitwise_equal(r.state, want)


def test_stage_on_device_takes_a_bool(store_dir):
  with pytest.raises(ValueError, match="stage_on_device"):
    snapstore.SnapshotOptions(store_dir=store_dir, stage_on_device="yes")  # type: ignore[arg-type]
