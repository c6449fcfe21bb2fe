"""The devices of a multi-controller job, in the one order every process uses.

Every collective snapstore runs (manifest exchange, replica transfer, restore
exchange) builds its mesh from :func:`devices`. By default that is every
device sorted by (process, id). After an in-place recovery
(:mod:`snapstore.recovery`) it is a new order that all processes derive from
the same (device, process incarnation) pairs: gloo keys its communicators
(and their rendezvous keys in the coordination service) by the ordered list
of a collective's devices only, so a process that rejoined with the same id
would otherwise meet the dead process's communicator and fail forever, and
a survivors' communicator that failed mid-operation (or whose connections
the failure shut, :mod:`._abort`) would meet leftover bytes. The new order
is drawn so that every group along one axis of a mesh reshaped from it (up
to 3 axes), and the whole order, is new (:func:`rekeyed`); with 8 devices
that leaves two such orders after the first, then a full restart. Groups it
does not check (over two axes at once, transposed meshes) may meet an old
communicator: the step then keeps failing and
:class:`snapstore.recovery.RestartRequired` ends in a full restart, never in
a wrong state.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

import jax
import numpy as np

_order: tuple[jax.Device, ...] | None = None


def devices() -> list[jax.Device]:
  """Every device of the job, in the order all processes agree on."""
  if _order is not None:
    return list(_order)
  return sorted(jax.devices(), key=lambda d: (d.process_index, d.id))


def set_devices(order: Sequence[jax.Device] | None) -> None:
  """Sets the agreed order (None: back to the default)."""
  global _order
  _order = None if order is None else tuple(order)


def cliques(order: Sequence[int], max_dims: int = 3) -> set[tuple[int, ...]]:
  """Every ordered device group a collective can use on a mesh made by
  reshaping ``order`` (device ids) to any shape of up to ``max_dims`` axes."""
  out: set[tuple[int, ...]] = {tuple(order)}
  arr = np.asarray(order)
  for shape in _shapes(len(order), max_dims):
    grid = arr.reshape(shape)
    for axis, size in enumerate(shape):
      out.update(map(tuple, np.moveaxis(grid, axis, -1).reshape(-1, size).tolist()))
  return out


def _shapes(n: int, max_dims: int) -> list[tuple[int, ...]]:
  if n == 1 or max_dims == 0:
    return [()] if n == 1 else []
  return [(f, *rest) for f in range(2, n + 1) if n % f == 0
          for rest in _shapes(n // f, max_dims - 1)]


MAX_DRAWS = 20_000


def rekeyed(live: Mapping[jax.Device, int], used: set[tuple[int, ...]],
            new: set[int]) -> list[jax.Device] | None:
  """An order of the devices of ``live`` (device -> its process's
  incarnation, as ``live_devices`` reports it to every process alike) in
  which no device group (:func:`cliques`) that holds a ``new`` device (a
  replacement's) was ``used`` before: gloo would find the dead process's
  communicator (survivors) or its rendezvous keys (the replacement) under
  such a group and fail forever. Drawn from a generator seeded by ``live``,
  so every process draws the same; None if no draw of ``MAX_DRAWS`` fits
  (then only a full restart clears the old keys)."""
  key = repr(sorted((d.id, int(inc)) for d, inc in live.items())).encode()
  rng = np.random.default_rng(int.from_bytes(hashlib.sha256(key).digest()[:8], "little"))
  ordered = sorted(live, key=lambda d: d.id)
  for _ in range(MAX_DRAWS):
    order = [ordered[i] for i in rng.permutation(len(ordered))]
    if not any(new.intersection(c) and c in used for c in cliques([d.id for d in order])):
      return order
  return None
