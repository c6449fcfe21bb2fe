"""Integrity checks of stored pieces, computed where the bytes are
(:class:`ChecksumKind`, recorded per piece in the manifest).

* ``CRC32C``: crc32c of each ``chunk_bytes`` chunk of a host buffer (host
  files; and pinned host buffers where the controller can address them
  without a copy: on CPU ``np.asarray`` of a ``pinned_host`` array is a view
  of its buffer). Hardware crc32c, computed while the chunk is hot in cache.
* ``DEVICE_SUM``: the pinned copies live in the TPU hosts' RAM, which a single
  controller cannot read without moving them, so each shard gets a 64-bit sum
  computed by XLA on its device at capture, and again on the device that
  receives the copy at restore. Defined below.

Definition: the shard is read as a sequence of uint32 lanes ``u[i]`` (one per
element, zero-extended, for 1-, 2- and 4-byte dtypes; two per element for
8-byte dtypes), and for each of two seeds::

    sum_i fmix32(u[i] + i * 0x9E3779B9 + seed)   (mod 2**32)

``fmix32`` (MurmurHash3's finalizer) is a bijection on uint32, so changing any
one lane, by any number of bits, always changes both sums; other corruptions
(several lanes, swapped lanes) go undetected with probability about 2**-64.
"""

from __future__ import annotations

import enum
import functools
import os
from collections.abc import Sequence
from concurrent import futures

import crc32c
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

try:
  import snapstore._stream as _stream
except ImportError:  # built without a C compiler: numpy copies (the same bytes, slower)
  _stream = None  # type: ignore[assignment]  # checked before every use (FUSED)

Checksum = tuple[int, ...]


class ChecksumKind(enum.Enum):
  """How a stored piece's checksum was computed (recorded per piece)."""

  CRC32C = "crc32c"          # crc32c of each chunk_bytes chunk, on the host
  DEVICE_SUM = "device_sum"  # two position-keyed 32-bit sums, by XLA on the device


def _flat_bytes(a: np.ndarray) -> np.ndarray:
  return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


def _chunk_starts(n: int, chunk_bytes: int) -> list[int]:
  return list(range(0, max(n, 1), chunk_bytes))


@functools.lru_cache(maxsize=1 << 16)  # the same pieces every snapshot
def piece_key(path: str, index: Sequence[Sequence[int]]) -> bytes:
  """What a piece's crc32c is seeded with: its leaf path and global index, so
  the checksum binds the bytes to where they go (a manifest whose indices
  were swapped fails it)."""
  return f"{path}|{[list(r) for r in index]}".encode()


#: Whether copies go through :func:`._stream.copy_crc32c` (built with the
#: package: x86-64 with SSE4.2 and a C compiler at install): the copy and its
#: crc32c in one pass, streaming stores. ``SNAPSTORE_FUSED_COPY=0`` in the
#: environment turns it off (numpy copies: to compare, or to rule it out).
FUSED = (_stream is not None and bool(_stream.FUSED)
         and os.environ.get("SNAPSTORE_FUSED_COPY", "1") != "0")

#: Without :data:`FUSED`, copies go through the cache this many bytes at a
#: time: each part is checksummed right after it is written, while it is
#: still in L2 (a part bigger than L2 would be read back from memory).
CACHE_BYTES = 256 << 10

#: Copies of pieces smaller than this on average cost more in Python than in
#: bytes: a pool's threads only contend for the GIL over them, so they are
#: copied on the calling thread.
SMALL_BYTES = 128 << 10


def copy_crc(dst: np.ndarray, src: np.ndarray, crc: int,
             also: Sequence[np.ndarray] = ()) -> int:
  """Copies ``src`` into ``dst`` and every buffer of ``also`` (flat uint8
  arrays of one size, none overlapping ``src``) and returns the crc32c of the
  bytes written, continued from ``crc``: the bytes checked are the bytes
  written, whatever another process does to ``src`` meanwhile.

  With :data:`FUSED`: one pass (each word loaded once, checksummed and
  stored from the register; streaming stores, which skip reading the lines
  they write). Else numpy: ``dst`` part by part, each part checksummed while
  hot in cache and then copied on to ``also`` from the cache."""
  if FUSED:
    return _stream.copy_crc32c(crc, src, dst, *also)
  if src.nbytes <= CACHE_BYTES:  # one part (a small piece): no loop, no slicing
    np.copyto(dst, src)
    crc = crc32c.crc32c(dst, crc)
    for other in also:
      np.copyto(other, dst)
    return crc
  for a in range(0, src.nbytes, CACHE_BYTES):
    part = dst[a:a + CACHE_BYTES]
    np.copyto(part, src[a:a + CACHE_BYTES])
    crc = crc32c.crc32c(part, crc)
    for other in also:
      np.copyto(other[a:a + CACHE_BYTES], part)
  return crc


def copy_crc_many(src: np.ndarray, dst: np.ndarray, rows: Sequence[int]) -> list[int]:
  """:func:`copy_crc` of many parts of ``src`` into the same places of
  ``dst`` (flat uint8, of one size, not overlapping) in one call: ``rows``
  is flat (offset, length, seed) triples; returns each part's crc32c.
  With :data:`FUSED` no Python runs per part (a run of thousands of small
  pieces); else one :func:`copy_crc` a part."""
  if FUSED:
    table = np.array(rows, dtype=np.int64)
    crcs = np.empty(len(rows) // 3, dtype=np.uint32)
    _stream.copy_crc32c_many(src, dst, table, crcs)
    return crcs.tolist()
  return [copy_crc(dst[a:a + n], src[a:a + n], seed)
          for a, n, seed in zip(rows[::3], rows[1::3], rows[2::3], strict=True)]


def copy_crc_gather(dst: np.ndarray, parts: Sequence[tuple[np.ndarray, int, int]]
                    ) -> list[int]:
  """:func:`copy_crc` of many sources into places of ``dst`` in one call:
  ``parts`` are (source, offset in ``dst``, seed), flat uint8 sources not
  overlapping ``dst``; returns each one's crc32c. With :data:`FUSED` no
  Python runs per source in the copy (a save's thousands of small shards);
  else one :func:`copy_crc` each."""
  if FUSED:
    table = np.array([(at, seed) for _, at, seed in parts], dtype=np.int64).reshape(-1, 2)
    crcs = np.empty(len(parts), dtype=np.uint32)
    _stream.copy_crc32c_gather(dst, table, crcs, [src for src, _, _ in parts])
    return crcs.tolist()
  return [copy_crc(dst[at:at + src.nbytes], src, seed) for src, at, seed in parts]


def chunk_seed(key: bytes, chunk: int) -> int:
  """The initial crc32c value of chunk number ``chunk`` of the piece ``key``."""
  return crc32c.crc32c(key + chunk.to_bytes(8, "little"))


def chunk_seeds(key: bytes, count: int) -> tuple[int, ...]:
  """:func:`chunk_seed` of chunks 0 .. count - 1 of the piece ``key``
  (remembered for pieces of up to 64 chunks: the same pieces every step)."""
  if count <= 64:
    return _chunk_seeds(key, count)
  return tuple(chunk_seed(key, c) for c in range(count))


@functools.lru_cache(maxsize=1 << 16)
def _chunk_seeds(key: bytes, count: int) -> tuple[int, ...]:
  return tuple(chunk_seed(key, c) for c in range(count))


def crc_chunks(buf: np.ndarray, *, chunk_bytes: int, key: bytes,
               pool: futures.Executor | None = None) -> Checksum:
  """crc32c of each ``chunk_bytes`` chunk of ``buf``, each seeded with
  :func:`chunk_seed` of ``key`` (on ``pool`` if given)."""
  raw = _flat_bytes(buf)
  n = raw.nbytes
  one = lambda a: crc32c.crc32c(raw[a:min(a + chunk_bytes, n)],  # noqa: E731
                                chunk_seed(key, a // chunk_bytes))
  starts = _chunk_starts(n, chunk_bytes)
  return tuple(pool.map(one, starts) if pool is not None and len(starts) > 1
               else map(one, starts))


def aligned_empty(nbytes: int, align: int = 4096) -> np.ndarray:
  """An uninitialized, page-aligned uint8 buffer (device_put on CPU can then
  adopt it instead of copying it once more)."""
  raw = np.empty(nbytes + align, np.uint8)
  start = -raw.ctypes.data % align
  return raw[start:start + nbytes]


def copy_verified(src: np.ndarray, crcs: Sequence[int], *, chunk_bytes: int, key: bytes,
                  pool: futures.Executor | None = None,
                  out: np.ndarray | None = None) -> np.ndarray | None:
  """A private copy of ``src``'s bytes whose every chunk matched its recorded
  crc32c (computed on the copy, while hot in cache: the bytes checked are the
  bytes returned, whatever happens to ``src`` later), or None. ``out``: flat
  uint8 memory of the right size, private to the caller, to copy into (else
  a new buffer)."""
  # (a store's bytes come flat: three numpy calls a piece saved)
  raw = src if src.dtype == np.uint8 and src.ndim == 1 and src.flags.c_contiguous \
      else _flat_bytes(src)
  n = raw.nbytes
  if n <= chunk_bytes:  # one chunk (most pieces of a many-leaves state): no pool, no closure
    if len(crcs) != 1:
      return None
    if out is None:
      out = aligned_empty(n)
    return out if copy_crc(out, raw, chunk_seeds(key, 1)[0]) == crcs[0] else None
  starts = _chunk_starts(n, chunk_bytes)
  if len(starts) != len(crcs):
    return None
  if out is None:
    out = aligned_empty(n)
  seeds = chunk_seeds(key, len(starts))

  def one(a: int) -> int:
    b = min(a + chunk_bytes, n)
    return copy_crc(out[a:b], raw[a:b], seeds[a // chunk_bytes])
  got = tuple(pool.map(one, starts) if pool is not None and len(starts) > 1
              else map(one, starts))
  return out if got == tuple(crcs) else None


@functools.lru_cache(maxsize=1 << 16)  # the same pieces every restore
def first_seed(path: str, index: Sequence[Sequence[int]]) -> int:
  """:func:`chunk_seed` of chunk 0 of piece (``path``, ``index``): a
  one-chunk piece's whole seed, in one lookup."""
  return chunk_seed(piece_key(path, index), 0)


def crc_matches(buf: np.ndarray, crcs: Sequence[int], *, chunk_bytes: int, key: bytes,
                pool: futures.Executor | None = None) -> bool:
  """True if every chunk of ``buf`` matches its recorded crc32c."""
  if len(_chunk_starts(_flat_bytes(buf).nbytes, chunk_bytes)) != len(crcs):
    return False
  return crc_chunks(buf, chunk_bytes=chunk_bytes, key=key, pool=pool) == tuple(crcs)

_GOLDEN = 0x9E3779B9
_SEEDS = (0x243F6A88, 0x85A308D3)
_M1, _M2 = 0x85EBCA6B, 0xC2B2AE35


def _fmix(h: jax.Array) -> jax.Array:
  """MurmurHash3's 32-bit finalizer (a bijection on uint32)."""
  u32 = jnp.uint32
  h = h ^ (h >> u32(16))
  h = h * u32(_M1)
  h = h ^ (h >> u32(13))
  h = h * u32(_M2)
  return h ^ (h >> u32(16))


def _lanes(x: jax.Array) -> jax.Array:
  if x.dtype == jnp.bool_:
    x = x.astype(jnp.uint8)
  if jnp.issubdtype(x.dtype, jnp.complexfloating):  # its bytes: (real, imag) pairs
    x = jnp.stack([jnp.real(x), jnp.imag(x)], axis=-1)
  size = x.dtype.itemsize
  if size in (1, 2):
    u = lax.bitcast_convert_type(x, jnp.uint8 if size == 1 else jnp.uint16)
    u = u.astype(jnp.uint32)
  elif size in (4, 8):
    u = lax.bitcast_convert_type(x, jnp.uint32)  # 8 bytes: a trailing dim of 2
  else:
    raise TypeError(f"no on-device checksum for dtype {x.dtype}")
  return u.reshape(-1)


def _sums(x: jax.Array) -> jax.Array:
  u = _lanes(x)
  pos = lax.iota(jnp.uint32, u.size) * jnp.uint32(_GOLDEN)
  return jnp.stack([jnp.sum(_fmix(u + pos + jnp.uint32(s)), dtype=jnp.uint32)
                    for s in _SEEDS])


#: uint32[2] of one array on its device (one shard: a single-device array).
device_checksum = jax.jit(_sums)


@functools.lru_cache(maxsize=1024)
def _per_shard_fn(mesh: Mesh, spec: P):
  axes = tuple(mesh.axis_names)
  body = lambda x: _sums(x)[None]  # noqa: E731
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,), out_specs=P(axes),
                               check_vma=False))


def shard_checksums(arr: jax.Array) -> tuple[jax.Array, dict[jax.Device, int]] | None:
  """Every shard's checksum in one dispatch, for a NamedSharding leaf:
  (uint32[devices, 2] array, device -> its row); None for other shardings."""
  sharding = arr.sharding
  if not isinstance(sharding, NamedSharding) or sharding.memory_kind not in (None, "device"):
    return None
  mesh = sharding.mesh
  if not isinstance(mesh, Mesh):
    return None
  out = _per_shard_fn(mesh, sharding.spec)(arr)
  return out, {d: r for r, d in enumerate(mesh.devices.flat)}


def as_checksum(x: jax.Array | np.ndarray) -> Checksum:
  v = np.asarray(x).reshape(-1)
  return int(v[0]), int(v[1])
