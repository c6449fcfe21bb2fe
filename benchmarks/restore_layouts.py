"""Restores of real layouts against a raw ``device_put`` of the same bytes (#62).

``python -m benchmarks.restore_layouts [--layouts ...] [--stores ...]``: for
each layout (a state of 2-D and 3-D leaves, bf16 and f32, KB to hundreds of
MB) and each store, a ``SnapshotManager`` saves the state once, then
restores it ``--repeats`` times into the state's own shardings (best of);
against it, in the same process, a raw ``jax.device_put`` of the same host
arrays (numpy, already in RAM) onto the same shardings (best of), and the
same put from pieces of 4 MiB (rows) concatenated on the device. Reports,
for each, GB/s, ``over_raw`` (restore / raw put, in time: > 1 is slower),
the restore's ``timings`` (where its time went) and a bitwise check.

Layouts: ``flat`` (16 f32 (N, 1024) leaves, 1 GiB), ``transformer`` (bf16
params (1024, 1024) and (1024, 4096) with two f32 moments each, 1.4 GiB),
``stacked`` (bf16 (8, 1024, 1024) and (8, 1024, 4096) with f32 moments:
scanned layers, 0.94 GiB), ``small`` (2,000 f32 leaves of 1-64 KiB). On one
device (a TPU v5e here) unless more are visible; prints JSON and writes
``--out``. Without an accelerator it prints ``{"skipped": ...}`` unless
``--cpu`` (a smoke test: sizes divided by 64).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._common import best_seconds as _best

LAYOUTS = ("flat", "transformer", "stacked", "small")
STORES = {"host_files": ("HOST_FILES", "", ""),
          "pinned_process": ("PINNED_HOST", "HOST", "PROCESS"),
          "pinned_slice_hosts": ("PINNED_HOST", "DEVICE", "SLICE_HOSTS")}


#: bytes of one ``transformer`` block at ``scale`` 1 (120 MiB; over scale**2 at another)
BLOCK_BYTES = 120 << 20


def layout_shapes(layout: str, scale: int, blocks: int = 12) -> list[tuple[tuple[int, ...], str]]:
  """(shape, dtype) of each leaf; ``scale`` divides the sizes (smoke test);
  ``blocks``: a ``transformer``'s blocks (per block 6 bf16 params, 2 f32
  moments each)."""
  d = max(1024 // scale, 8)
  if layout == "flat":
    return [((16384 // scale, 1024), "float32")] * 16
  if layout == "transformer":  # ~1 GiB: per block 4 (d, d) + 2 (d, 4d) bf16, x5 with moments
    block = [((d, d), "bfloat16")] * 4 + [((d, 4 * d), "bfloat16")] * 2
    moments = [(s, "float32") for s, _ in block] * 2
    return (block + moments) * blocks
  if layout == "stacked":
    layers = max(8 // scale, 2)
    params = [((layers, d, d), "bfloat16")] * 4 + [((layers, d, 4 * d), "bfloat16")] * 2
    return params + [(s, "float32") for s, _ in params] * 2
  if layout == "small":
    rng = np.random.default_rng(0)
    return [((int(rng.integers(256, 16384)),), "float32") for _ in range(2000 // scale)]
  raise ValueError(f"unknown layout {layout!r}; one of {LAYOUTS}")


def make_state(layout: str, scale: int) -> dict[str, Any]:
  """Leaves of ``layout`` (random bytes made on the host: no program to
  compile per shape), each sharded over the devices on its first axis where
  that divides (else replicated)."""
  import jax
  import ml_dtypes
  from jax.sharding import NamedSharding, PartitionSpec as P
  devices = jax.devices()
  mesh = jax.make_mesh((len(devices),), ("d",))
  rng = np.random.default_rng(0)
  out = {}
  for i, (shape, dtype) in enumerate(layout_shapes(layout, scale)):
    spec = P("d") if shape[0] % len(devices) == 0 else P()
    host = rng.standard_normal(shape, np.float32)
    host = host.astype(ml_dtypes.bfloat16) if dtype == "bfloat16" else host
    out[f"l{i:04d}"] = jax.device_put(host, NamedSharding(mesh, spec))
  return out


def _raw(state: Any, repeats: int) -> dict[str, float]:
  """A raw put of the host bytes: whole leaves, and 4 MiB row pieces
  concatenated on the device."""
  import jax
  import jax.numpy as jnp
  host = jax.device_get(state)
  shardings = jax.tree.map(lambda a: a.sharding, state)
  whole = _best(lambda: jax.device_put(host, shardings), repeats)
  dev = jax.devices()[0]
  pieces = []
  for x in jax.tree.leaves(host):
    rows = max(1, (4 << 20) // max(1, x.nbytes // max(1, x.shape[0])))
    pieces.append([x[i:i + rows] for i in range(0, x.shape[0], rows)])
  cat = jax.jit(lambda ps: [jnp.concatenate(p) if len(p) > 1 else p[0] for p in ps])

  def by_pieces() -> Any:
    return cat(jax.device_put(pieces, dev))
  by_pieces()  # (compile)
  return {"raw_put_s": whole, "raw_pieces_put_s": _best(by_pieces, repeats)}


def _manager(store: str, where: str) -> Any:
  import jax

  import snapstore
  kind, checksum, memory = STORES[store]
  value = (snapstore.HostFiles(dir=where) if kind == "HOST_FILES" else
           snapstore.PinnedHost(checksum=snapstore.PinnedChecksum[checksum],
                                memory=snapstore.PinnedMemory[memory]))
  opts = snapstore.SnapshotOptions(store=value, keep=1, run_id=store)
  return snapstore.SnapshotManager(opts, slices=None if kind == "HOST_FILES"
                                   else {0: jax.devices()})


def measure(layout: str, stores: Sequence[str], repeats: int, scale: int) -> dict[str, Any]:
  import jax

  from snapstore.testing.checks import assert_bitwise_equal
  state = make_state(layout, scale)
  nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
  row: dict[str, Any] = {"leaves": len(jax.tree.leaves(state)), "bytes": nbytes,
                         **{k: round(v, 4) for k, v in _raw(state, repeats).items()}}
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                          state)
  expected = jax.device_get(state)
  for store in stores:
    where = tempfile.mkdtemp(prefix="restore-layouts-", dir="/dev/shm")
    try:
      with _manager(store, where) as mgr:
        mgr.save(1, state)
        mgr.wait_until_finished()
        best, timings, r = float("inf"), {}, None
        for _ in range(repeats):
          del r
          t = time.perf_counter()
          r = mgr.restore(abstract)
          jax.block_until_ready(r.state)
          took = time.perf_counter() - t
          if took < best:
            best, timings = took, dict(r.timings)
        try:
          assert_bitwise_equal(r.state, expected)
          equal = True
        except AssertionError:
          equal = False
        del r
      row[store] = {"restore_s": round(best, 4), "gbps": round(nbytes / best / 1e9, 2),
                    "raw_put_over_restore": round(row["raw_put_s"] / best, 3),
                    "bitwise_equal": equal,
                    "timings": {k: round(v, 4) for k, v in sorted(timings.items())}}
    finally:
      shutil.rmtree(where, ignore_errors=True)
  row["raw_put_gbps"] = round(nbytes / row["raw_put_s"] / 1e9, 2)
  return row


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
  p.add_argument("--stores", nargs="+", choices=list(STORES), default=list(STORES))
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--out", default="bench-results/restore_layouts.json")
  p.add_argument("--cpu", action="store_true", help="run on CPU devices (smoke test)")
  a = p.parse_args(argv)
  import jax
  if jax.default_backend() == "cpu" and not a.cpu:
    out: dict[str, Any] = {"skipped": "no accelerator (--cpu runs it as a smoke test)"}
    print(json.dumps(out))
    return out
  scale = 64 if jax.default_backend() == "cpu" else 1
  out = {"backend": jax.default_backend(), "devices": len(jax.devices()),
         "device_kind": jax.devices()[0].device_kind, "jax": jax.__version__}
  for layout in a.layouts:
    out[layout] = measure(layout, a.stores, a.repeats, scale)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=2))
    print(json.dumps({layout: out[layout]}), flush=True)
  return out


if __name__ == "__main__":
  main()
