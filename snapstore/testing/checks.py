"""Checks a test of a snapshot makes: host copies of states, bitwise equality."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

__all__ = ["assert_bitwise_equal", "host_copy"]


def host_copy(tree: Any) -> Any:
  """A numpy copy of every array leaf (keys as key_data); scalars as they are."""
  def one(x):
    if isinstance(x, jax.Array):
      key = jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
      return np.array(jax.random.key_data(x) if key else x, copy=True)
    if isinstance(x, (np.ndarray, np.generic)):
      return np.array(x, copy=True)
    return x
  return jax.tree.map(one, tree)


def assert_bitwise_equal(expected: Any, actual: Any) -> None:
  """Same structure, same dtypes, same bytes in every leaf."""
  e_leaves, e_def = jax.tree_util.tree_flatten_with_path(host_copy(expected))
  a_leaves, a_def = jax.tree_util.tree_flatten_with_path(host_copy(actual))
  assert e_def == a_def, f"structure differs:\n{e_def}\n{a_def}"  # type: ignore[operator]
  for (path, e), (_, a) in zip(e_leaves, a_leaves, strict=True):
    name = jax.tree_util.keystr(path)
    if isinstance(e, np.ndarray):
      assert isinstance(a, np.ndarray), name
      assert e.dtype == a.dtype and e.shape == a.shape, (name, e.dtype, a.dtype)
      assert e.tobytes() == a.tobytes(), f"leaf {name} differs"
    else:
      assert type(e) is type(a) and e == a, (name, e, a)
