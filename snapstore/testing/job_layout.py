"""A simulated N-host job's saved layout and its hosts' manifests.

The state is a MaxText-like unscanned llama (500 leaves: 165 params, Adam
mu/nu, step, count, rng, two scalars), every array FSDP-sharded over all
``LOCAL * N`` devices (``LOCAL`` a host), one failure domain a host.
:class:`Layout` gives each host's manifest of a step as a host-files drain
makes it (replicas or parity) and :func:`targets_of` the targets a host
restores into, without devices: what :mod:`snapstore._multihost.agree` and
:mod:`snapstore._multihost.sparse` read. With :mod:`.lockstep` it plays the
hosts of a job of thousands in one process (``benchmarks.scale``, the
sparse restore's tests).
"""

from __future__ import annotations

import math
from typing import Any

LOCAL = 4
CHUNK = 16 << 20
STEPS = (1000, 1100)
D, QH, KVH, HD, MLP, VOCAB, LAYERS = 8192, 64, 8, 128, 28672, 128256, 18


# ------------------------------------------------------------------ layout
def _params() -> list[tuple[str, tuple[int, ...], int]]:
  out: list[tuple[str, tuple[int, ...], int]] = [
      ("params/token_embedder/embedding", (VOCAB, D), 1)]
  for i in range(LAYERS):
    p = f"params/decoder/layers_{i}"
    out += [(f"{p}/mlp/wi_0/kernel", (D, MLP), 0), (f"{p}/mlp/wi_1/kernel", (D, MLP), 0),
            (f"{p}/mlp/wo/kernel", (MLP, D), 1), (f"{p}/post_norm/scale", (D,), 0),
            (f"{p}/pre_norm/scale", (D,), 0), (f"{p}/attn/key/kernel", (D, KVH, HD), 0),
            (f"{p}/attn/out/kernel", (QH, HD, D), 2), (f"{p}/attn/query/kernel", (D, QH, HD), 0),
            (f"{p}/attn/value/kernel", (D, KVH, HD), 0)]
  return [*out, ("params/decoder/norm/scale", (D,), 0),
          ("params/decoder/logits/kernel", (D, VOCAB), 0)]


class Layout:
  """The saved (and target) layout of an N-host job."""

  def __init__(self, n: int):
    from snapstore._tree import LeafKind, LeafSpec
    self.n, devices = n, LOCAL * n
    arrays = []
    for path, shape, axis in _params():
      for prefix in ("", "opt/mu/", "opt/nu/"):
        s = list(shape)
        s[axis] = -(-s[axis] // devices) * devices
        arrays.append((prefix + path, tuple(s), axis))
    arrays.sort()
    self.specs: list[Any] = [LeafSpec(p, LeafKind.ARRAY, "float32", s) for p, s, _ in arrays]
    self.axes: list[int | None] = [a for _, _, a in arrays]
    for path, kind, dtype, shape in (("opt/count", LeafKind.ARRAY, "int32", ()),
                                     ("rng", LeafKind.KEY, "uint32", (2,)),
                                     ("step", LeafKind.ARRAY, "int32", ())):
      self.specs.append(LeafSpec(path, kind, dtype, shape,
                                 "threefry2x32" if kind is LeafKind.KEY else ""))
      self.axes.append(None)
    self.scalars = {}
    for name, value in (("data/epoch", 3), ("data/tokens", 123_456_789_012)):
      self.scalars[len(self.specs)] = value
      self.specs.append(LeafSpec(name, LeafKind.SCALAR))
      self.axes.append(None)

  def index(self, leaf: int, device: int) -> tuple[tuple[int, int], ...]:
    shape, axis = self.specs[leaf].shape, self.axes[leaf]
    if axis is None:
      return tuple((0, d) for d in shape)
    k = shape[axis] // (LOCAL * self.n)
    return tuple((device * k, (device + 1) * k) if a == axis else (0, d)
                 for a, d in enumerate(shape))

  def arrays(self) -> list[int]:
    from snapstore._tree import LeafKind
    return [i for i, s in enumerate(self.specs) if s.kind is not LeafKind.SCALAR]

  def manifest(self, host: int, step: int, slot: int, *, parity: bool, shift: int = 1) -> Any:
    """Host ``host``'s manifest of ``step``, as a host-files drain makes it:
    its own pieces, then (replicas) those of the host ``shift`` before it
    (one domain a host: 1), owner that host;
    (parity) one block a local device instead."""
    from snapstore._checksum import ChecksumKind
    from snapstore._index import align
    from snapstore._manifest import (
      PARITY_LEAF,
      Manifest,
      member_length,
      pad4_sum,
      piece_row,
      split_parity,
    )
    from snapstore._tree import tree_digest
    rows, off, crc = [], 0, ChecksumKind.CRC32C
    def add(leaf: int, index: Any, owner: int) -> None:
      nonlocal off
      nb = math.prod(b - a for a, b in index) * self.specs[leaf].np_dtype.itemsize
      rows.append(piece_row(leaf, index, off, nb, (0,) * max(1, -(-nb // CHUNK)), owner, crc))
      off += align(nb)
    for leaf in self.arrays():
      first = LOCAL * host
      devs = [first] if self.axes[leaf] is None else range(first, first + LOCAL)
      for d in devs:
        add(leaf, self.index(leaf, d), host)
    prev = (host - shift) % self.n  # (shift: the ring's, hosts_per_domain at save)
    parity_of = {}
    if parity:  # k=3: groups of 4 hosts; a stripe a local device position
      g = host // 4 * 4
      members = tuple(range(g, g + 4))
      sharded = [leaf for leaf in self.arrays() if self.axes[leaf] is not None]
      for j in range(LOCAL):
        layout = tuple(tuple((leaf, self.index(leaf, LOCAL * m + j)) for leaf in sharded)
                       for m in members)
        used = pad4_sum([math.prod(b - a for a, b in idx) * 4 for _, idx in layout[0]])
        length = member_length(used, 3)
        key = (LOCAL * g + j, host - g)
        rows.append(piece_row(PARITY_LEAF, (key,), off, length // 3,
                              (0,) * max(1, -(-(length // 3) // CHUNK)), host, crc))
        off += align(length // 3)
        parity_of[key] = (members, layout, length)
    else:
      for leaf in self.arrays():
        if self.axes[leaf] is not None:
          for d in range(LOCAL * prev, LOCAL * prev + LOCAL):
            add(leaf, self.index(leaf, d), prev)
    table, par = split_parity(rows, parity_of)
    return Manifest(run_id="scale", incarnation=0, step=step, store=host, num_hosts=self.n,
                    tree_digest=tree_digest(self.specs), slot=slot, chunk_bytes=CHUNK,
                    leaves=tuple(self.specs), pieces=table, scalars=dict(self.scalars),
                    extra={"data": {"epoch": 3, "index": 987654}}, parity=par)


class FakeDevice:
  def __init__(self, i: int):
    self.id, self.process_index = i, i // LOCAL


class FakeSharding:
  """What the restore asks of a target's sharding: this host's devices'
  indices (the full map is never asked for)."""

  def __init__(self, layout: Layout, host: int, axis: int | None):
    self.layout, self.host, self.axis = layout, host, axis
    self._key = (layout.n, host, axis)

  def __hash__(self) -> int:
    return hash(self._key)

  def __eq__(self, other: object) -> bool:
    return isinstance(other, FakeSharding) and other._key == self._key

  def addressable_devices_indices_map(self, shape: tuple[int, ...]) -> dict[Any, Any]:
    out = {}
    for d in range(LOCAL * self.host, LOCAL * self.host + LOCAL):
      if self.axis is None:
        out[FakeDevice(d)] = tuple(slice(None) for _ in shape)
      else:
        k = shape[self.axis] // (LOCAL * self.layout.n)
        out[FakeDevice(d)] = tuple(slice(d * k, (d + 1) * k) if a == self.axis else slice(None)
                                   for a in range(len(shape)))
    return out


class Target:
  def __init__(self, sharding: FakeSharding | None):
    self.sharding = sharding


def targets_of(layout: Layout, host: int) -> list[Any]:
  from snapstore._tree import LeafKind
  return [None if s.kind is LeafKind.SCALAR else Target(FakeSharding(layout, host, a))
          for s, a in zip(layout.specs, layout.axes, strict=True)]

