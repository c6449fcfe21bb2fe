"""Leaves and pieces: what save reads off a state, through the caches that
make a save of hundreds of leaves cheap (paths per tree structure, specs per
leaf type, shard positions per sharding)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from snapstore import errors
from snapstore._tree import LeafKind, addressable_pieces, flatten

SPECS = [P(), P("x"), P("y"), P("x", "y"), P(None, "y"), P("y", "x")]


@pytest.fixture(scope="module")
def mesh() -> Mesh:
  return Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("x", "y"))


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_each_distinct_shard_once_with_its_own_bytes(mesh, spec):
  sharding = NamedSharding(mesh, spec)
  for seed in (1, 2):  # the second array hits the caches built by the first
    host = np.random.default_rng(seed).standard_normal((8, 12)).astype(np.float32)
    arr = jax.device_put(host, sharding)
    got = addressable_pieces(3, arr)
    want = {tuple((s.start or 0, s.stop or n) for s, n in zip(idx, host.shape, strict=True))
            for idx in sharding.devices_indices_map(host.shape).values()}
    assert {p.index for p, _ in got} == want
    assert len(got) == len(want)
    for piece, data in got:
      assert piece.leaf == 3
      window = tuple(slice(a, b) for a, b in piece.index)
      np.testing.assert_array_equal(np.asarray(data), host[window])
      assert piece.nbytes == host[window].nbytes


def test_a_scalar_leaf_is_one_piece(mesh):
  arr = jax.device_put(jnp.float32(2.5), NamedSharding(mesh, P()))
  [(piece, data)] = addressable_pieces(0, arr)
  assert piece.index == () and float(np.asarray(data)) == 2.5


def test_specs_follow_each_leaf_under_one_structure():
  first = {"a": jnp.zeros((2, 3), jnp.float32), "k": jax.random.key(0), "n": 3}
  second = {"a": jnp.zeros((4,), jnp.int8), "k": jax.random.key(1), "n": 4}
  s1, leaves1, t1 = flatten(first)
  s2, leaves2, t2 = flatten(second)
  assert t1 == t2 and [s.path for s in s1] == [s.path for s in s2] == ["a", "k", "n"]
  assert (s1[0].dtype, s1[0].shape) == ("float32", (2, 3))
  assert (s2[0].dtype, s2[0].shape) == ("int8", (4,))
  assert s1[1].kind is s2[1].kind is LeafKind.KEY and s1[1].key_impl == "threefry2x32"
  assert leaves2[2] == 4 and leaves1[2] == 3


def test_a_structure_refused_once_is_refused_every_time():
  bad = {"a/b": jnp.zeros(2), "a": {"b": jnp.zeros(2)}}
  for _ in range(2):
    with pytest.raises(errors.UnsupportedLeafError, match="share the key path"):
      flatten(bad)
  for _ in range(2):  # a spec refused for its dtype, under a structure already seen
    with pytest.raises(errors.UnsupportedLeafError, match="'a'"):
      flatten({"a": np.zeros(2, np.dtype("U3"))})


def test_a_shard_is_checked_against_its_device_not_trusted_by_position(mesh, monkeypatch):
  from snapstore import _tree
  sharding = NamedSharding(mesh, P("x", "y"))
  host = np.arange(8 * 12, dtype=np.float32).reshape(8, 12)
  arr = jax.device_put(host, sharding)
  true = _tree.positions(arr)
  ids = sorted(true)
  lying = {d: true[ids[(k + 1) % len(ids)]] for k, d in enumerate(ids)}  # off by one
  monkeypatch.setitem(_tree._POSITIONS, sharding, lying)
  for piece, data in addressable_pieces(0, arr):
    window = tuple(slice(a, b) for a, b in piece.index)
    np.testing.assert_array_equal(np.asarray(data), host[window])


@pytest.mark.parametrize("shard_list", [True, False], ids=["jax-shard-list", "per-shard-calls"])
def test_shards_of_a_mesh_in_any_device_order_hold_their_own_bytes(shard_list, monkeypatch):
  """Devices in a shuffled order: each piece's data is its own region,
  read from JAX's list of single-device arrays or shard by shard."""
  from snapstore import _tree
  if not shard_list:
    monkeypatch.setattr(_tree, "_shards", lambda arr: None)
  order = np.random.default_rng(7).permutation(8)
  mesh = Mesh(np.array(jax.devices()[:8])[order].reshape(4, 2), ("x", "y"))
  host = np.arange(8 * 6, dtype=np.int32).reshape(8, 6)
  arr = jax.device_put(host, NamedSharding(mesh, P("x", "y")))
  got = addressable_pieces(0, arr)
  assert len(got) == 8
  for piece, data in got:
    window = tuple(slice(a, b) for a, b in piece.index)
    np.testing.assert_array_equal(np.asarray(data), host[window])
