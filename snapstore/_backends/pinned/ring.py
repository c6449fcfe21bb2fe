"""The pinned-host store's failure domains in ring order, and which domain
keeps each copy of a leaf's pieces (computed from its layout alone, once a
leaf: the same every save)."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence

import jax

from ..._index import Index
from ..._placement import HolderLayout, ring_keepers
from ..._tree import Piece, piece_of


class Ring:
  """Failure domains in ring order, and each device's place in its domain."""

  def __init__(self, slices: Mapping[int, Sequence[jax.Device]]):
    self.slices = {k: list(v) for k, v in slices.items()}
    self.order = sorted(self.slices)
    self._where = {d: (k, i) for k, devs in self.slices.items() for i, d in enumerate(devs)}
    self.domain_of = {d: k for d, (k, _) in self._where.items()}
    self._by_id = {d.id: d for d in self._where}
    self._key = tuple((k, tuple(d.id for d in self.slices[k])) for k in self.order)

  def __hash__(self) -> int:
    return hash(self._key)

  def __eq__(self, other: object) -> bool:
    return isinstance(other, Ring) and self._key == other._key

  def device(self, device_id: int) -> jax.Device:
    return self._by_id[device_id]

  def domain(self, device: jax.Device) -> int:
    return self._where[device][0]

  def shifted(self, device: jax.Device, k: int) -> jax.Device | None:
    """The device at the same place ``k`` domains further on the ring."""
    d, pos = self._where[device]
    target = self.slices[self.order[(self.order.index(d) + k) % len(self.order)]]
    return target[pos] if pos < len(target) else None


@functools.lru_cache(maxsize=1 << 16)
def copy_of(leaf: int, index: Index, nbytes: int, owner: int) -> tuple[Piece, int]:
  """(piece, owner domain), one object for the run (see :func:`snapstore._tree.piece_of`)."""
  return piece_of(leaf, index, nbytes), owner


@functools.lru_cache(maxsize=4096)
def structure(layout: HolderLayout, device_ids: tuple[int, ...], ring: Ring, replicas: int
               ) -> tuple[dict[tuple[Index, int], int], tuple[tuple[Index, int], ...],
                          dict[tuple[Index, int], tuple[int, jax.Device, int]]]:
  """A leaf's copies, from its layout alone (the same every save):
  (index, domain) -> owner domain for each copy kept (:func:`ring_keepers`);
  each index's owner shard position; and where each copy comes from
  (``_LeafPlacement.copies`` of :mod:`.capture`): the domain's own shard, else the shard of the
  nearest domain back on the ring that holds the index, kept by the device
  at the same place in the domain."""
  keep: dict[tuple[Index, int], int] = {}
  owners: list[tuple[Index, int]] = []
  copies: dict[tuple[Index, int], tuple[int, jax.Device, int]] = {}
  n = len(ring.order)
  for index, held in layout:
    at_of = dict(held)
    owner = min(at_of)
    owners.append((index, at_of[owner]))
    for t in ring_keepers(at_of, ring.order, replicas):
      keep[(index, t)] = owner
      if t in at_of:
        copies[(index, t)] = (at_of[t], ring.device(device_ids[at_of[t]]), 0)
        continue
      pos = ring.order.index(t)
      k = next(k for k in range(1, n) if ring.order[(pos - k) % n] in at_of)
      at = at_of[ring.order[(pos - k) % n]]
      there = ring.shifted(ring.device(device_ids[at]), k) or ring.slices[t][0]
      copies[(index, t)] = (at, there, k)
  return keep, tuple(owners), copies
