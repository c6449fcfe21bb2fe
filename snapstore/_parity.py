"""Parity snapshots: one failure domain of a group lost, its pieces rebuilt.

The failure domains form groups of ``k + 1`` in ring order. A *stripe* is the
``k + 1`` devices at the same position (host position in its domain, local
device) in each domain of a group; its *members*, in domain order. Each
member's *buffer* is its shards of the protected leaves, in leaf order, each
padded to 4 bytes, the whole padded to ``L``, a multiple of ``4 k``, and read
as uint32 words in ``k`` sub-blocks of ``L / k`` bytes.

Member ``j`` keeps parity block ``P_j``: the sum modulo 2**32 of sub-block
``(j - d - 1) mod (k + 1)`` of every other member ``d`` (RAID-5 rotation).
Losing member ``x``: its sub-block ``s`` is in ``P_j``, ``j = (x + s + 1) mod
(k + 1)``, a surviving member; so ``sub_x[s] = P_j - sum of the other
survivors' sub-blocks in P_j``. Each domain keeps ``1 / k`` of its own bytes
extra, instead of the full copy a replica costs.

Both directions are sums: the parity is ``k`` jitted collective permutes
around each group, over the job's agreed device order, each member adding
what it receives (XLA carries the bytes, as it does for replicas; each device
sends ``L`` bytes, what a replica sends); a rebuild is one sum over hosts
(:func:`snapstore._multihost.exchange.sum_words`) where each survivor contributes its words
negated, or plain numpy where one process holds every store.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ._index import Index, nbytes as index_nbytes, normalize
from ._manifest import PARITY_LEAF, member_length, pad4, pad4_sum

__all__ = [
  "OPS",
  "PARITY_LEAF",
  "PARITY_PATH",
  "StripeMembers",
  "Stripes",
  "contribution",
  "encode",
  "evenly_sharded",
  "groups_error",
  "layout",
  "slice_stripes",
  "split",
  "stripes",
]

#: What a parity block's crc32c is seeded with (with its (stripe, block)).
PARITY_PATH = "<parity>"


def sub_block(j: int, d: int, n: int) -> int:
  """Which sub-block of member ``d`` parity block ``P_j`` sums (``j != d``)."""
  return (j - d - 1) % n


@dataclasses.dataclass(frozen=True)
class Stripes:
  """The (stripe, member) arrangement of a job's devices for group size ``k``."""

  k: int
  grid: np.ndarray  # [stripe, member] -> jax.Device

  @property
  def n(self) -> int:
    return self.k + 1

  @functools.cached_property
  def where(self) -> dict[jax.Device, tuple[int, int]]:
    return {d: (s, m) for (s, m), d in np.ndenumerate(self.grid)}

  @functools.cached_property
  def mesh(self) -> Mesh:
    return Mesh(self.grid, ("stripe", "member"))

  def stripe_id(self, s: int) -> int:
    """A stripe's name in manifests: its first member's device id."""
    return int(self.grid[s, 0].id)


def groups_error(num_domains: int, k: int) -> str | None:
  """Why ``k`` does not fit ``num_domains`` domains, or None."""
  if num_domains > 1 and num_domains % (k + 1):
    return (f"redundancy=Parity(k={k}) puts the failure domains in groups of "
            f"{k + 1}; this job has {num_domains}. Pick k + 1 dividing "
            f"{num_domains} (e.g. Parity(k={num_domains - 1})), or Replicas(n).")
  return None


def stripes(devices: Sequence[jax.Device], domains: Mapping[int, int], k: int) -> Stripes:
  """Stripes over ``devices``: groups of ``k + 1`` consecutive domains (sorted
  ids); within a group, the hosts at one position of each domain and their
  local devices (by id) at one position. Raises ValueError if the domains do
  not form whole groups or differ in size."""
  by_domain: dict[int, list[int]] = collections.defaultdict(list)
  for h in sorted(domains):
    by_domain[domains[h]].append(h)
  keys = sorted(by_domain)
  why = groups_error(len(keys), k)
  if why:
    raise ValueError(why)
  if len({len(v) for v in by_domain.values()}) != 1:
    raise ValueError("parity needs failure domains of equal size, got "
                     f"{ {d: len(v) for d, v in by_domain.items()} }")
  local: dict[int, list[jax.Device]] = collections.defaultdict(list)
  for d in sorted(devices, key=lambda d: d.id):
    local[d.process_index].append(d)
  rows = []
  n = k + 1
  for g in range(len(keys) // n):
    group = keys[g * n:(g + 1) * n]
    for pos in range(len(by_domain[group[0]])):
      hosts = [by_domain[dom][pos] for dom in group]
      for i in range(len(local[hosts[0]])):
        rows.append([local[h][i] for h in hosts])
  return _stripes(rows, k)


def _stripes(rows: Sequence[Sequence[jax.Device]], k: int) -> Stripes:
  grid = np.empty((len(rows), k + 1), dtype=object)
  for s, row in enumerate(rows):
    for m, d in enumerate(row):
      grid[s, m] = d
  return Stripes(k, grid)


def slice_stripes(slices: Mapping[int, Sequence[jax.Device]], k: int) -> Stripes | None:
  """Single controller: stripes over failure domains given as slices (domain
  -> its devices, in order); None if they do not form whole groups of
  ``k + 1`` of equal size (the caller keeps full replicas then)."""
  keys = sorted(slices)
  n = k + 1
  if len(keys) < n or len(keys) % n or len({len(slices[d]) for d in keys}) != 1:
    return None
  rows = [[slices[d][i] for d in keys[g * n:(g + 1) * n]]
          for g in range(len(keys) // n) for i in range(len(slices[keys[0]]))]
  return _stripes(rows, k)


# ------------------------------------------------------------ device side
def _words(x: jax.Array) -> jax.Array:
  """A shard's bytes, padded to 4, as uint32 words."""
  b = (x.astype(jnp.uint8) if x.dtype == jnp.bool_
       else jax.lax.bitcast_convert_type(x, jnp.uint8)).reshape(-1)
  if b.size % 4:
    b = jnp.concatenate([b, jnp.zeros(4 - b.size % 4, jnp.uint8)])
  return jax.lax.bitcast_convert_type(b.reshape(-1, 4), jnp.uint32)


#: How :func:`encode` may compute the parity (``benchmarks.parity`` times each):
#: ``"sum"`` (kept): ``k`` collective permutes around the group, each member
#: adding what it receives (member ``d`` sends sub-block ``r - 1`` to member
#: ``d + r`` in round ``r``, so no data-dependent gather); ``"xor"``: the same
#: ring with XOR; ``"sum_reduce_scatter"``: one ``psum_scatter`` of a
#: ``(k + 1)``-block contribution over the member axis.
OPS = ("sum", "xor", "sum_reduce_scatter")


_AXIS = "snapstore_parity"


@functools.lru_cache(maxsize=32)
def _encode_fn(mesh: Mesh, k: int, length: int, op: str,
               rounds: tuple[tuple[tuple[int, int], ...], ...]) -> Any:
  """The parity program on a 1-axis ``mesh`` (the ring ops: ``rounds[r - 1]``
  are round ``r``'s (from, to) positions) or on the stripes' 2-axis mesh
  (``sum_reduce_scatter``)."""
  n, words = k + 1, length // 4
  axes = mesh.axis_names if op == "sum_reduce_scatter" else _AXIS

  def body(*xs: jax.Array) -> jax.Array:
    flat = jnp.concatenate([_words(x) for x in xs])
    flat = jnp.concatenate([flat, jnp.zeros(words - flat.size, jnp.uint32)])
    subs = flat.reshape(k, words // k)
    if op == "sum_reduce_scatter":
      d = jax.lax.axis_index("member")
      j = jnp.arange(n)
      s = jnp.minimum((j - d - 1) % n, k - 1)
      contrib = jnp.where((j != d)[:, None], subs[s], jnp.uint32(0))
      return jax.lax.psum_scatter(contrib, "member", scatter_dimension=0, tiled=True)
    acc = jnp.zeros((words // k,), jnp.uint32)
    for r, pairs in enumerate(rounds, start=1):  # sub_block(d + r, d, n) == r - 1
      got = jax.lax.ppermute(subs[r - 1], _AXIS, pairs)
      acc = acc ^ got if op == "xor" else acc + got
    return acc[None]

  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(axes), out_specs=P(axes),
                               check_vma=False))


def shard_pieces(leaf: int, arr: jax.Array) -> dict[jax.Device, tuple[int, Index]]:
  """device -> (leaf, global index) of its shard of ``arr``."""
  shape = tuple(arr.shape)
  return {d: (leaf, normalize(idx, shape))
          for d, idx in arr.sharding.devices_indices_map(shape).items()}


def evenly_sharded(st: Stripes, arr: jax.Array) -> bool:
  """True if :func:`encode` can carry ``arr``: a NamedSharding over exactly
  the stripes' devices, in device memory, with even shards, of a dtype that
  bitcasts to bytes (not complex)."""
  s = arr.sharding
  if not isinstance(s, NamedSharding) or s.device_set != set(st.grid.flat):
    return False
  if s.memory_kind not in (None, "device") or jnp.issubdtype(arr.dtype, jnp.complexfloating):
    return False  # host-memory leaves and complex dtypes keep full replicas
  try:
    s.shard_shape(tuple(arr.shape))
  except ValueError:
    return False
  return True


def layout(st: Stripes, leaves: Sequence[int], arrays: Sequence[jax.Array]
           ) -> tuple[list[tuple[tuple[int, Index], ...]], int]:
  """(each device's buffer layout, by position in ``st.grid.flat``; ``L``)
  for ``arrays`` (each :func:`evenly_sharded`)."""
  sizes = [int(np.prod(a.sharding.shard_shape(tuple(a.shape)))) * np.dtype(a.dtype).itemsize
           for a in arrays]
  owned = [shard_pieces(i, a) for i, a in zip(leaves, arrays, strict=True)]
  return [tuple(o[d] for o in owned) for d in st.grid.flat], member_length(pad4_sum(sizes),
                                                                           st.k)


def encode(st: Stripes, arrays: Sequence[jax.Array], length: int, *, op: str = "sum",
           order: Sequence[jax.Device] | None = None) -> jax.Array:
  """The parity blocks of ``arrays`` (laid out as :func:`layout` says): a
  (devices, L / k / 4) uint32 array whose row on each device is its block.
  One jitted program (``op``: see :data:`OPS`); collective. The ring runs
  on one axis over ``order`` (every device of ``st``; default the stripes'
  order): a multi-controller job passes :func:`snapstore._devices.devices`, the order
  its communicators are keyed by, so that after an in-place recovery the
  parity never meets a communicator of a dead process."""
  if op not in OPS:
    raise ValueError(f"op is one of {OPS}, got {op!r}")
  rounds: tuple[tuple[tuple[int, int], ...], ...]
  if op == "sum_reduce_scatter":
    mesh, spec, rounds = st.mesh, P(("stripe", "member")), ()
  else:
    mesh = Mesh(np.array(list(order if order is not None else st.grid.flat)), (_AXIS,))
    spec = P(_AXIS)
    pos = {d: i for i, d in enumerate(mesh.devices.flat)}
    if set(pos) != set(st.grid.flat):
      raise ValueError("the parity ring needs exactly the stripes' devices")
    rounds = tuple(tuple(sorted((pos[row[m]], pos[row[(m + r) % st.n]]) for row in st.grid
                                for m in range(st.n)))
                   for r in range(1, st.n))
  flat_devices = list(mesh.devices.flat)
  stacked = []
  for a in arrays:
    shard = tuple(a.sharding.shard_shape(tuple(a.shape))) or (1,)
    by_dev = {s.device: (s.data if s.data.ndim else s.data.reshape(1))
              for s in a.addressable_shards}
    stacked.append(jax.make_array_from_single_device_arrays(
        (shard[0] * len(flat_devices), *shard[1:]), NamedSharding(mesh, spec),
        [by_dev[d] for d in flat_devices if d in by_dev]))
  return _encode_fn(mesh, st.k, length, op, rounds)(*stacked)


# -------------------------------------------------------------- rebuild
@dataclasses.dataclass(frozen=True)
class StripeMembers:
  """One stripe as its parity records describe it."""

  members: tuple[int, ...]                                # store of each member
  pieces: tuple[tuple[tuple[int, Index], ...], ...]       # per member, in order
  length: int

  @property
  def k(self) -> int:
    return len(self.members) - 1

  @property
  def block_bytes(self) -> int:
    return self.length // self.k

  def offsets(self, member: int, itemsize: Callable[[int], int]
              ) -> list[tuple[int, Index, int, int]]:
    """(leaf, index, offset, nbytes) of each piece in ``member``'s buffer."""
    out, at = [], 0
    for leaf, idx in self.pieces[member]:
      nb = index_nbytes(idx, itemsize(leaf))
      out.append((leaf, idx, at, nb))
      at += pad4(nb)
    return out


def contribution(layout: StripeMembers, lost: int, itemsize: Callable[[int], int],
                 piece: Callable[[int, Index], np.ndarray | None],
                 block: Callable[[int], np.ndarray | None]) -> np.ndarray:
  """This process's share of the rebuild of member ``lost``'s buffer, as
  uint32 words: every parity block it holds (``block(j)``, else None) added,
  every piece it holds of the other members (``piece(leaf, index)``, flat
  uint8, else None) subtracted, each where it falls. Summed over the
  processes (mod 2**32), the shares are ``lost``'s buffer."""
  n, bw = layout.k + 1, layout.block_bytes // 4
  out = np.zeros(layout.length // 4, np.uint32)
  for j in range(n):
    if j == lost:
      continue
    s = sub_block(j, lost, n)  # the sub-block of ``lost`` that P_j holds
    got = block(j)
    if got is not None:
      out[s * bw:(s + 1) * bw] += got.view(np.uint32)
  for d in range(n):
    if d == lost:
      continue
    mine = np.zeros(layout.length, np.uint8)
    any_mine = False
    for leaf, idx, at, nb in layout.offsets(d, itemsize):
      got = piece(leaf, idx)
      if got is not None:
        mine[at:at + nb] = got
        any_mine = True
    if not any_mine:
      continue
    words = mine.view(np.uint32)
    for j in range(n):
      if j in (d, lost):
        continue
      s, sd = sub_block(j, lost, n), sub_block(j, d, n)
      out[s * bw:(s + 1) * bw] -= words[sd * bw:(sd + 1) * bw]
  return out


def split(layout: StripeMembers, member: int, buffer: np.ndarray, itemsize: Callable[[int], int]
          ) -> list[tuple[int, Index, np.ndarray]]:
  """(leaf, index, flat uint8 bytes) of each piece in a member's rebuilt buffer."""
  raw = buffer.view(np.uint8)
  return [(leaf, idx, raw[at:at + nb]) for leaf, idx, at, nb in layout.offsets(member, itemsize)]
