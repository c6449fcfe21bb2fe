"""Persistent compilation cache keys that survive an in-place heal on CPU.

After a heal every process compiles for a new device order (gloo, see
:mod:`snapstore._devices`). On CPU two parts of JAX's cache key then miss:

- the compile options' device assignment (the order itself). JAX strips it
  from the key on GPU; :func:`share` strips it on CPU too. The assignment
  still reaches the program: JAX passes the current compile options when it
  loads a cached executable, and the CPU client places and exchanges by
  them (``tests/test_devices.py`` checks a ring shift's result, device by
  device, after a hit under a permuted order).
- the "accelerator config": the fingerprint of the client's topology, which
  on CPU lists only this process's devices, so no two processes share a
  key and only process 0 (the one JAX lets write the cache) ever hits.
  :func:`share` hashes that topology without its device list; the target
  machine (triple, CPU model, features) stays in the key.

With the keys shared, a process after a heal loads the train step from
the cache instead of compiling it again. Private JAX functions: left alone
where they are missing or their signatures differ, which costs cache hits,
never correctness.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from typing import Any

import jax

from .. import _jax_private


def share() -> None:
  """Patches JAX's cache key (idempotent); call before compiling."""
  cache_key = _jax_private.cache_key_module()
  if cache_key is None:
    return
  hash_options = getattr(cache_key, "_hash_serialized_compile_options", None)
  if (hash_options is not None and not hasattr(hash_options, "snapstore")
      and "strip_device_assignment" in inspect.signature(hash_options).parameters):

    def options(hash_obj: Any, compile_options: Any,
                strip_device_assignment: bool = False) -> Any:
      strip = strip_device_assignment or jax.default_backend() == "cpu"
      return hash_options(hash_obj, compile_options, strip_device_assignment=strip)

    options.snapstore = True  # type: ignore[attr-defined]
    cache_key._hash_serialized_compile_options = options
  hash_config = getattr(cache_key, "_hash_accelerator_config", None)
  if (hash_config is not None and not hasattr(hash_config, "snapstore")
      and len(inspect.signature(hash_config).parameters) == 2
      and hasattr(cache_key, "xla_client")):

    def config(hash_obj: Any, accelerators: Any) -> Any:
      devices = list(accelerators.flat)
      if devices and devices[0].platform == "cpu":
        try:
          topology = cache_key.xla_client.get_topology_for_devices(devices).serialize()
          hash_obj.update(without_devices(topology))
          return None
        except Exception:  # noqa: BLE001  (JAX's own hash below)
          pass
      return hash_config(hash_obj, accelerators)

    config.snapstore = True  # type: ignore[attr-defined]
    cache_key._hash_accelerator_config = config


def without_devices(topology: bytes) -> bytes:
  """What to hash of a serialized ``PjRtTopologyDescriptionProto``: its
  fields, with the CPU topology it wraps (field 9, a ``google.protobuf.Any``
  whose value, field 2, is a ``CpuTopologyProto``) spliced in without that
  topology's device list (its field 1). Not a valid message: hash input
  only. Raises ValueError on bytes that do not parse."""
  out = []
  for number, raw, payload in _fields(topology):
    if number != 9 or payload is None:
      out.append(raw)
      continue
    for n, r, p in _fields(payload):
      if n == 2 and p is not None:
        out.extend(r3 for n3, r3, _ in _fields(p) if n3 != 1)
      else:
        out.append(r)
  return b"".join(out)


def _fields(buf: bytes) -> Iterator[tuple[int, bytes, bytes | None]]:
  """A protobuf message's fields: number, raw bytes (key included) and, for
  length-delimited ones, the payload."""
  i = 0
  while i < len(buf):
    start = i
    key, i = _varint(buf, i)
    number, wire = key >> 3, key & 7
    payload = None
    if wire == 0:
      _, i = _varint(buf, i)
    elif wire == 1:
      i += 8
    elif wire == 5:
      i += 4
    elif wire == 2:
      n, i = _varint(buf, i)
      payload, i = buf[i:i + n], i + n
    else:
      raise ValueError(f"protobuf wire type {wire} at byte {start}")
    if i > len(buf):
      raise ValueError("protobuf field runs past the end")
    yield number, buf[start:i], payload


def _varint(buf: bytes, i: int) -> tuple[int, int]:
  value = shift = 0
  while True:
    if i >= len(buf):
      raise ValueError("protobuf varint runs past the end")
    b = buf[i]
    i += 1
    value |= (b & 0x7F) << shift
    shift += 7
    if b < 0x80:
      return value, i
