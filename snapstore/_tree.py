"""Pytree -> leaves -> shards, and the tree digest that fences mismatches.

A *leaf spec* describes one leaf as stored: its key path, kind, storage dtype
and storage shape. Typed PRNG keys are stored as their ``key_data`` (uint32)
with the key implementation's name. A *piece* is one addressable shard of one
leaf, named by its global index range; replicated shards on one host are
stored once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from . import _index, _jax_private, errors
from ._index import Index
from ._jax_compat import single_device_sharding

SCALAR_TYPES = (bool, int, float, str)
# Storage dtypes a snapshot may hold (a closed set: a manifest naming another
# is corrupt, and save refuses a leaf of another up front).
SUPPORTED_DTYPES = frozenset({
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64", "bfloat16", "complex64", "complex128",
    "float8_e4m3fn", "float8_e5m2"})
_INT_RANGE = (-(2**63), 2**64 - 1)  # what msgpack carries
MAX_STR = 1 << 20


class LeafKind(enum.Enum):
  ARRAY = "array"    # jax.Array
  KEY = "key"        # typed PRNG key jax.Array, stored as key_data
  NUMPY = "numpy"    # numpy array or numpy scalar
  SCALAR = "scalar"  # bool / int / float / str, stored in the manifest


@functools.lru_cache(maxsize=256)
def _np_dtype(name: str) -> np.dtype:
  """The numpy dtype named ``name`` (asked for once a piece at restore)."""
  return np.dtype(jax.numpy.dtype(name))


@dataclasses.dataclass(frozen=True)
class LeafSpec:
  path: str
  kind: LeafKind
  dtype: str = ""
  shape: tuple[int, ...] = ()
  key_impl: str = ""

  @property
  def nbytes(self) -> int:
    return math.prod(self.shape) * np.dtype(self.np_dtype).itemsize

  @property
  def np_dtype(self) -> np.dtype:
    return _np_dtype(self.dtype)

  def describe(self) -> str:
    if self.kind is LeafKind.SCALAR:
      return "python scalar"
    extra = f" key_impl={self.key_impl}" if self.key_impl else ""
    return f"{self.kind.value} {self.dtype}{list(self.shape)}{extra}"


@dataclasses.dataclass(frozen=True, slots=True)
class Piece:
  """One stored shard: ``leaf`` (index into the specs) and its global range."""

  leaf: int
  index: Index
  nbytes: int

  @property
  def shape(self) -> tuple[int, ...]:
    return _index.shape_of(self.index)


@functools.lru_cache(maxsize=1 << 16)
def piece_of(leaf: int, index: Index, nbytes: int) -> Piece:
  """``Piece(leaf, index, nbytes)``, one object per piece for the whole run:
  the same pieces every snapshot, and thousands of new ones a save would
  outlive young collections and bring the full ones closer."""
  return Piece(leaf, index, nbytes)


def path_str(path: Sequence[Any]) -> str:
  return jax.tree_util.keystr(tuple(path), simple=True, separator="/") or "<root>"


def leaf_spec(path: str, leaf: Any) -> LeafSpec:
  """The stored description of one concrete or abstract leaf; raises
  UnsupportedLeafError (naming the leaf) for what a restore could not read."""
  if isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct)):
    return _array_spec(path, leaf.dtype, tuple(leaf.shape))
  if isinstance(leaf, (np.ndarray, np.generic)):
    return _checked(path, LeafSpec(path, LeafKind.NUMPY, str(leaf.dtype), tuple(np.shape(leaf))))
  if leaf is None or isinstance(leaf, SCALAR_TYPES):
    check_scalar(path, leaf)
    return LeafSpec(path, LeafKind.SCALAR)
  raise errors.UnsupportedLeafError(
      f"leaf {path!r} has unsupported type {type(leaf).__name__}; snapstore "
      "stores jax.Array, typed PRNG keys, numpy arrays and bool/int/float/str/None",
      leaf=path)


@functools.lru_cache(maxsize=65536)
def _array_spec(path: str, dtype: Any, shape: tuple[int, ...]) -> LeafSpec:
  """A jax.Array's spec: the same on every save of a state, so computed once
  (a typed key's ``key_data`` shape takes an ``eval_shape``)."""
  if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
    data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(shape, dtype))
    impl = dtype._impl.name  # the registered name, e.g. "threefry2x32"
    return _checked(path, LeafSpec(path, LeafKind.KEY, str(data.dtype), tuple(data.shape), impl))
  return _checked(path, LeafSpec(path, LeafKind.ARRAY, str(dtype), shape))


def _checked(path: str, spec: LeafSpec) -> LeafSpec:
  try:
    check_spec(spec)
  except ValueError as e:
    raise errors.UnsupportedLeafError(f"leaf {path!r}: {e}", leaf=path) from None
  return spec


def check_spec(spec: LeafSpec) -> None:
  """Raises ValueError unless ``spec`` is one snapstore can store and read."""
  if spec.kind is LeafKind.SCALAR:
    if spec.dtype or spec.shape or spec.key_impl:
      raise ValueError("a scalar leaf has no dtype, shape or key implementation")
    return
  if spec.dtype not in SUPPORTED_DTYPES:
    raise ValueError(f"dtype {spec.dtype!r} is not one of {sorted(SUPPORTED_DTYPES)}")
  if bool(spec.key_impl) != (spec.kind is LeafKind.KEY):
    raise ValueError("only key leaves name a key implementation")
  if spec.nbytes >= 2**62:
    raise ValueError(f"shape {spec.shape} is too large")


def _utf8(text: str) -> bool:
  try:
    text.encode("utf-8")
  except UnicodeEncodeError:  # a lone surrogate
    return False
  return True


def check_scalar(path: str, value: Any) -> None:
  """Raises UnsupportedLeafError unless a manifest can carry ``value`` exactly."""
  ok = (value is None or type(value) in (bool, float)
        or (type(value) is int and _INT_RANGE[0] <= value <= _INT_RANGE[1])
        or (type(value) is str and len(value) <= MAX_STR and _utf8(value)))
  if not ok:
    raise errors.UnsupportedLeafError(
        f"leaf {path!r}: {type(value).__name__} {str(value)[:40]!r} cannot be kept "
        "exactly (Python scalars: bool, float, int within 64 bits, str up to 1 MiB, "
        "None; put other values in a numpy array)", leaf=path)


def flatten(tree: Any) -> tuple[list[LeafSpec], list[Any], Any]:
  """Returns (specs, leaves, treedef) of a state pytree."""
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  paths = _paths(tree, treedef)
  return [leaf_spec(p, leaf) for p, leaf in zip(paths, leaves, strict=True)], leaves, treedef


_PATHS: dict[Any, tuple[str, ...]] = {}  # treedef -> its leaves' checked key paths


def _paths(tree: Any, treedef: Any) -> tuple[str, ...]:
  """The key paths of ``tree``'s leaves: a function of the tree's structure
  alone, so computed (and checked) once per structure, not on every save."""
  try:
    paths = _PATHS.get(treedef)
  except TypeError:  # a custom node with unhashable metadata
    paths = None
  if paths is not None:
    return paths
  with_path, _ = jax.tree_util.tree_flatten_with_path(tree)
  paths = tuple(path_str(p) for p, _ in with_path)
  seen: set[str] = set()
  for path in paths:
    if path in seen:
      raise errors.UnsupportedLeafError(
          f"two leaves share the key path {path!r} (a key containing '/'?); rename one",
          leaf=path)
    if not _utf8(path):
      raise errors.UnsupportedLeafError(f"leaf path {path!r} is not valid UTF-8", leaf=path)
    seen.add(path)
  with contextlib.suppress(TypeError):
    if len(_PATHS) >= 64:
      _PATHS.clear()
    _PATHS[treedef] = paths
  return paths


def spec_row(s: LeafSpec) -> list[Any]:
  """One leaf spec as a plain row (manifests, the persistent tier, digests)."""
  return [s.path, s.kind.value, s.dtype, list(s.shape), s.key_impl]


def spec_from_row(row: Any) -> LeafSpec:
  """The inverse of :func:`spec_row`; raises ValueError/TypeError on a bad row."""
  path, kind, dtype, shape, key_impl = row
  for name, v in (("path", path), ("dtype", dtype), ("key_impl", key_impl)):
    if not isinstance(v, str):
      raise TypeError(f"leaf {name} is {type(v).__name__}, not str")
  dims = tuple(shape)
  if any(type(d) is not int or d < 0 for d in dims):
    raise ValueError(f"leaf shape {shape!r} is not a tuple of non-negative ints")
  return LeafSpec(path, LeafKind(kind), dtype, dims, key_impl)


def tree_digest(specs: Sequence[LeafSpec]) -> str:
  """A digest of paths, kinds, dtypes and shapes: equal trees, equal digests."""
  return _tree_digest(tuple(specs))


@functools.lru_cache(maxsize=64)
def _tree_digest(specs: tuple[LeafSpec, ...]) -> str:
  rows = [spec_row(s) for s in specs]
  return hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:32]


def check_compatible(saved: Sequence[LeafSpec], target: Sequence[LeafSpec],
                     *, step: int) -> None:
  """Raises TreeMismatchError naming the first leaf that differs."""
  saved_by_path = {s.path: s for s in saved}
  target_paths = {t.path for t in target}
  for t in target:
    s = saved_by_path.get(t.path)
    if s is None:
      missing = sorted(set(saved_by_path) - target_paths)
      raise errors.TreeMismatchError(
          f"leaf {t.path!r} of the abstract state is not in the snapshot of step "
          f"{step} (saved leaves not in the abstract state: {missing[:5]}). Pass "
          "an abstract state with the structure that was saved.", leaf=t.path)
    target_kind_ok = (s.kind == t.kind or
                      {s.kind, t.kind} <= {LeafKind.ARRAY, LeafKind.NUMPY})
    if not target_kind_ok or s.dtype != t.dtype or s.shape != t.shape or \
        s.key_impl != t.key_impl:
      raise errors.TreeMismatchError(
          f"leaf {t.path!r}: saved as {s.describe()} at step {step}, the abstract "
          f"state asks for {t.describe()}. Fix the abstract state or restore "
          "into a model of the saved shape.", leaf=t.path)
    if t.kind is LeafKind.ARRAY and s.kind is not LeafKind.KEY:
      held = jax.dtypes.canonicalize_dtype(s.np_dtype)
      if held != s.np_dtype:  # a JAX array of it would change its values
        raise errors.TreeMismatchError(
            f"leaf {t.path!r} was saved as {s.dtype} at step {step}, which JAX "
            f"holds as {held} here (jax_enable_x64 is off): restoring it as a "
            "jax.Array would change its values. Enable jax_enable_x64, or ask "
            "for a numpy array there.", leaf=t.path)
  extra = sorted(set(saved_by_path) - target_paths)
  if extra:
    raise errors.TreeMismatchError(
        f"the snapshot of step {step} has leaf {extra[0]!r} that the abstract "
        "state lacks. Pass an abstract state with the structure that was saved.",
        leaf=extra[0])


@functools.lru_cache(maxsize=4096)
def _pieces_of(leaf_idx: int, sharding: jax.sharding.Sharding, shape: tuple[int, ...],
                itemsize: int) -> tuple[tuple[int, ...], tuple[Piece, ...]]:
  """(device ids, pieces): one device per distinct index, lowest id first."""
  out: dict[Index, tuple[int, Piece]] = {}
  idx_map: Mapping[jax.Device, Any] = sharding.addressable_devices_indices_map(shape)
  for device in sorted(idx_map, key=lambda d: d.id):
    idx = _index.normalize(idx_map[device], shape)
    if idx not in out:
      out[idx] = (device.id, Piece(leaf_idx, idx, _index.nbytes(idx, itemsize)))
  return tuple(d for d, _ in out.values()), tuple(p for _, p in out.values())


_POSITIONS: dict[jax.sharding.Sharding, dict[int, int]] = {}


def positions(arr: jax.Array) -> dict[int, int]:
  """device id -> position in ``arr.addressable_data``. JAX orders an array's
  shards by its sharding's device assignment, so the map is one per sharding
  (``addressable_shards`` builds a Shard object per device: too slow to call
  for every leaf of every save)."""
  pos = _POSITIONS.get(arr.sharding)
  if pos is None:
    pos = {s.device.id: i for i, s in enumerate(arr.addressable_shards)}
    if len(_POSITIONS) >= 4096:
      _POSITIONS.clear()
    _POSITIONS[arr.sharding] = pos
  return pos


def addressable_pieces(leaf_idx: int, arr: jax.Array) -> list[tuple[Piece, jax.Array]]:
  """(piece, single-device data) for each distinct addressable index of ``arr``.

  Replicated shards on this host appear once. For a typed key leaf pass
  ``jax.random.key_data(leaf)``.
  """
  pieces, data = addressable_data(leaf_idx, arr)
  return list(zip(pieces, data, strict=True))


def addressable_data(leaf_idx: int, arr: jax.Array) -> tuple[tuple[Piece, ...], list[jax.Array]]:
  """:func:`addressable_pieces` as (pieces, their single-device data): the
  pieces are the same tuple for every array of one layout (a save of a
  state of thousands of shards extends its lists with them at once)."""
  ids, pieces = _pieces_of(leaf_idx, arr.sharding, tuple(arr.shape),
                            np.dtype(arr.dtype).itemsize)
  if arr.is_fully_replicated:  # one device's copy for every position: by device
    by_id = {s.device.id: s.data for s in arr.addressable_shards}
    return pieces, [by_id[dev] for dev in ids]
  at = positions(arr)  # by position: no Shard object per device (see positions)
  shards = _shards(arr)
  if shards is None or len(shards) != len(at):
    data = [arr.addressable_data(at[dev]) for dev in ids]
  else:
    data = [shards[at[dev]] for dev in ids]
  for k, (dev, x) in enumerate(zip(ids, data, strict=True)):
    if _device_id(x) != dev:  # checked, not trusted: by device then
      data[k] = next(s.data for s in arr.addressable_shards if s.device.id == dev)
  return pieces, data


def _shards(arr: jax.Array) -> list[jax.Array] | None:
  """What ``arr.addressable_data(i)`` returns for each position i, in one
  attribute read: JAX's list of the array's single-device arrays (a call a
  shard is a noticeable share of a many-leaf save on the caller's thread);
  None where this JAX has no such list, or the array was deleted (the
  per-shard calls then say so)."""
  shards = _jax_private.single_device_arrays(arr)
  if shards is None or arr.is_deleted():
    return None
  return shards


def _device_id(x: jax.Array) -> int:
  """A single-device array's device id: its sharding's device where JAX
  keeps one (a third of the cost of ``devices()``, which builds a set)."""
  try:
    return x.sharding._device.id  # type: ignore[attr-defined]  # SingleDeviceSharding's
  except AttributeError:
    return next(iter(x.devices())).id


def filled(items: Sequence[Any], sizes: Sequence[int], limit: int) -> list[list[Any]]:
  """``items`` in consecutive groups, each closed once it holds ``limit``
  bytes or more (a task's share of a copy: big enough that its hand-off
  costs little)."""
  out: list[list[Any]] = []
  size = limit
  for item, n in zip(items, sizes, strict=True):
    if size >= limit:
      out.append([])
      size = 0
    out[-1].append(item)
    size += n
  return out


def batches(sizes: Sequence[int], limit: int) -> list[list[int]]:
  """Groups positions into consecutive runs of at most ``limit`` bytes (an
  item larger than ``limit`` gets a run of its own)."""
  out: list[list[int]] = []
  used = limit
  for i, n in enumerate(sizes):
    if used + n > limit or not out:
      out.append([])
      used = 0
    out[-1].append(i)
    used += n
  return out


def check_targets(specs: Sequence[LeafSpec], targets: Sequence[Any]) -> None:
  """Raises TreeMismatchError naming the first target leaf whose sharding
  does not divide its shape."""
  for spec, target in zip(specs, targets, strict=True):
    sharding = getattr(target, "sharding", None)
    if sharding is None or spec.kind in (LeafKind.SCALAR, LeafKind.NUMPY):
      continue
    why = _indivisible(sharding, tuple(spec.shape))
    if why is not None:
      raise errors.TreeMismatchError(
          f"leaf {spec.path!r}: its target sharding cannot hold shape {list(spec.shape)} "
          f"({why}). Pick a sharding whose mesh axes divide the leaf, or restore it "
          "replicated.", leaf=spec.path)


@functools.lru_cache(maxsize=4096)
def _indivisible(sharding: jax.sharding.Sharding, shape: tuple[int, ...]) -> str | None:
  try:
    sharding.shard_shape(shape)
  except ValueError as e:  # (jax's IndivisibleError)
    return str(e)
  return None


def wants_numpy(saved: LeafSpec, target_spec: LeafSpec, target: Any) -> bool:
  """True if a restored leaf goes back as a host numpy array: the target asks
  for one, or a numpy leaf was saved and the target carries no sharding."""
  return target_spec.kind is LeafKind.NUMPY or (
      saved.kind is LeafKind.NUMPY and getattr(target, "sharding", None) is None)


def target_sharding(target: Any) -> jax.sharding.Sharding:
  """The sharding a restored jax.Array leaf should have (the target's, else
  the first device)."""
  sharding = getattr(target, "sharding", None)
  if sharding is None:
    return single_device_sharding(jax.devices()[0])
  return sharding
