"""Shared test helpers (the bitwise checks are shipped: snapstore.testing.checks)."""

from __future__ import annotations

from typing import Any

import jax

from snapstore.testing.checks import assert_bitwise_equal, host_copy

__all__ = ["assert_bitwise_equal", "host_copy", "shardings"]


def shardings(tree: Any) -> list[Any]:
  return [getattr(x, "sharding", None) for x in jax.tree.leaves(tree)]
