"""The checks a CPU cannot make, as one command for a GPU or TPU machine.

``python -m benchmarks.device_check [--mb 1024] [--state-mb 2048]`` prints
JSON and writes ``--out``, every figure of one run:

* ``capture``: device -> ``pinned_host`` throughput (``jax.device_put`` onto
  the same sharding with ``memory_kind="pinned_host"``, what the pinned-host
  store does), ``pinned_host`` -> device (its restore), ``jax.device_get``
  and a host ``memcpy``;
* ``stores``: for host files and the pinned-host store (on the slices'
  hosts with its on-device sum, or crc32c on the host; and in this
  process's memory, staged): a ``SnapshotManager``'s first save, a warm save
  (``save`` to ``wait_until_finished``) and a warm restore onto the device,
  bitwise checked;
* ``overhead``: a jitted, donating train step of at least ``--step-ms``
  (its loop doubled until it takes that long) on a state of ``--state-mb``
  (16 leaves), with a snapshot every ``--intervals`` steps against none,
  loops of ``--steps`` steps until the last step is done, interleaved
  rounds, best round of each, for each of ``--stores``;
* ``orbax``: the same state through Orbax's ``StandardCheckpointer`` in a
  fresh directory under ``/tmp``, save and restore onto the device,
  against the pinned-host store's warm restore, bitwise checked;
* ``link``: the raw link, ``--mb`` in all: device -> host in pieces of 1, 4
  and 16 MiB (cut on the device first, then ``copy_to_host_async()`` on
  every piece and ``np.asarray`` of each), and host -> device
  (``device_put`` of the same pieces, and of one array);
* ``per_step``: for each ``--state-mb`` and ``--step-ms``, a donating step
  with a snapshot every step against none (``--per-step-steps`` a loop,
  ``--rounds`` interleaved rounds, best of each) for each of
  ``--per-step-stores``: host files and the pinned-host store in this
  process's memory, each with the staging budget at its default and at
  64 MiB, the pinned-host store on the slices' hosts, (``host_files_pinned_put``:
  the unstaged ``pinned_host`` put); each with its save metrics (bytes
  staged, bytes copied before ``save`` returned, the stall), host RSS before
  and after the loops' snapshots (and over ``--rss-snapshots`` more), a
  restore of the last snapshot (bitwise
  checked) against a raw ``device_put`` of the same bytes, and, with
  ``link``, the small budget's bound (no snapshot + 1.2 x state bytes over
  the 4 MiB link);
* ``host``: the drain's fused copy with crc32c on 1, 2, 4 and 8 threads,
  and (with ``link``) the cores a host needs to keep up with 1, 4 and 8
  chips;
* ``model``: the demo's flax transformer sized by ``--model`` (default
  ~1.4 GiB of params and adam state), trained with a snapshot every step
  against none, and a bitwise restore;
* ``recovery`` (GPU only): ``snapstore.recovery.set_flags`` (JAX's
  documented flag set), then a recoverable one-process job
  (``jax_enable_recoverability``, ``live_devices``) running a jitted step.

Without an accelerator it prints ``{"skipped": ...}`` and exits 0 (``--cpu``
runs it anyway, as a smoke test of the script).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import socket
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._common import best_seconds as _best, cleanup, emit, ram_dir

# name -> (store, the pinned store's checksum and memory: PinnedChecksum's and
# PinnedMemory's names)
STORES = {"host_files": ("HOST_FILES", "AUTO", "AUTO"),
          "pinned_device_sum": ("PINNED_HOST", "DEVICE", "SLICE_HOSTS"),
          "pinned_crc32c": ("PINNED_HOST", "HOST", "SLICE_HOSTS"),
          "pinned_process": ("PINNED_HOST", "HOST", "PROCESS")}
# per_step: name -> (store, options beyond its own)
PER_STEP = {"host_files": ("host_files", {}),
            "host_files_budget_64mb": ("host_files", {"staging_budget_bytes": 64 << 20}),
            "pinned_process": ("pinned_process", {}),
            "pinned_process_budget_64mb": ("pinned_process", {"staging_budget_bytes": 64 << 20}),
            "pinned_device_sum": ("pinned_device_sum", {}),
            "pinned_device_sum_budget_64mb": ("pinned_device_sum",
                                              {"staging_budget_bytes": 64 << 20}),
            "pinned_device_sum_unstaged": ("pinned_device_sum", {"staging": "NEVER"}),
            "host_files_pinned_put": ("host_files", {"staging": "NEVER"})}
LINK_PIECES_MB = (1, 4, 16)


def _gbps(nbytes: int, seconds: float) -> float:
  return round(nbytes / seconds / 1e9, 2)


def _fresh_get(x: Any, repeats: int) -> float:
  """``jax.device_get`` of a new array each time (an array caches its host copy)."""
  import jax
  best = float("inf")
  for i in range(repeats):
    y = jax.block_until_ready(x + float(i))
    t = time.perf_counter()
    jax.device_get(y)
    best = min(best, time.perf_counter() - t)
  return best


def capture(mb: int, repeats: int) -> dict[str, Any]:
  """Raw copies between device memory and host memory, one leaf of ``mb``."""
  import jax
  x = jax.device_put(np.arange((mb << 20) // 4, dtype=np.float32), jax.devices()[0])
  pinned = x.sharding.with_memory_kind("pinned_host")
  on_host = jax.device_put(x, pinned)
  host = np.empty(x.shape, np.float32)
  src = np.asarray(jax.device_get(x))
  return {
      "mb": mb,
      "device_to_pinned_host_gbps": _gbps(x.nbytes, _best(lambda: jax.device_put(x, pinned),
                                                          repeats)),
      "pinned_host_to_device_gbps": _gbps(x.nbytes, _best(
          lambda: jax.device_put(on_host, x.sharding), repeats)),
      "device_get_gbps": _gbps(x.nbytes, _fresh_get(x, repeats)),
      "host_memcpy_gbps": _gbps(x.nbytes, _best(lambda: np.copyto(host, src), repeats)),
  }


def make_state(state_mb: int, leaves: int = 16) -> dict[str, Any]:
  """``leaves`` float32 leaves of ``state_mb`` in all, sharded over every local device."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec as P
  mesh = jax.make_mesh((len(jax.devices()),), ("d",))
  elems = (state_mb << 20) // 4 // leaves // 1024 * 1024
  make = jax.jit(lambda k: jax.random.normal(k, (elems,), jnp.float32),
                 out_shardings=NamedSharding(mesh, P("d")))
  return {f"w{i:02d}": make(jax.random.key(i)) for i in range(leaves)}


def transformer_state(state_mb: int) -> dict[str, Any]:
  """:mod:`benchmarks.restore_layouts`' ``transformer`` layout (per block bf16
  params (1024, 1024) x 4 and (1024, 4096) x 2 with two f32 moments each)
  in blocks of about ``state_mb``, made on the devices (host-made random
  bytes take minutes at 4 GiB), sharded over every local device on their
  first axis. On CPU a smoke test: 1/64 the bytes a block."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec as P

  from benchmarks.restore_layouts import BLOCK_BYTES, layout_shapes
  mesh = jax.make_mesh((len(jax.devices()),), ("d",))
  sharding = NamedSharding(mesh, P("d"))
  scale = 8 if jax.default_backend() == "cpu" else 1
  blocks = max(1, (state_mb << 20) // (BLOCK_BYTES // scale ** 2))

  @functools.cache
  def maker(shape: tuple[int, ...], dtype: str) -> Callable[[Any], Any]:
    return jax.jit(lambda k: jax.random.normal(k, shape, jnp.float32).astype(dtype),
                   out_shardings=sharding)
  return {f"l{i:04d}": maker(shape, dtype)(jax.random.key(i))
          for i, (shape, dtype) in enumerate(layout_shapes("transformer", scale, blocks))}


#: per_step's state layout (``--layout``): ``flat`` (16 f32 leaves) or ``transformer``
LAYOUT = "flat"


#: host files' ``staging_piece_bytes`` in MiB (``--piece-mb``; 0: the default)
PIECE_MB = 0


def manager(kind: str, store_dir: str, **extra: Any):
  import jax

  import snapstore
  store, checksum, memory = STORES[kind]
  if "staging" in extra:
    extra["staging"] = snapstore.Staging[extra["staging"]]
  if PIECE_MB and _stages(kind):
    extra.setdefault("staging_piece_bytes", PIECE_MB << 20)
  value = (snapstore.PinnedHost(checksum=snapstore.PinnedChecksum[checksum],
                                memory=snapstore.PinnedMemory[memory])
           if store == "PINNED_HOST" else snapstore.HostFiles(dir=store_dir))
  opts = snapstore.SnapshotOptions(store=value, keep=1, run_id=kind, **extra)
  slices = {0: jax.devices()} if store == "PINNED_HOST" else None
  return snapstore.SnapshotManager(opts, slices=slices)


def _stages(kind: str) -> bool:
  """Whether the store ``kind`` stages (SnapshotOptions.staging applies):
  every one but the pinned store checked by crc32c on the slices' hosts."""
  return STORES[kind][0] == "HOST_FILES" or STORES[kind][1] != "HOST" or \
      STORES[kind][2] == "PROCESS"


def _abstract(state: Any) -> Any:
  import jax
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                      state)


def _restores(mgr: Any, state: Any, repeats: int) -> tuple[Any, float]:
  """The last of ``repeats`` restores into ``state``'s layout, and the best time."""
  import jax
  best = float("inf")
  for _ in range(repeats):
    t = time.perf_counter()
    r = mgr.restore(_abstract(state))
    jax.block_until_ready(r.state)
    best = min(best, time.perf_counter() - t)
  return r, best


def _equal(a: Any, b: Any) -> bool:
  """Same structure, dtypes and bytes (:func:`snapstore.testing.checks.assert_bitwise_equal`)."""
  from snapstore.testing.checks import assert_bitwise_equal
  try:
    assert_bitwise_equal(a, b)
  except AssertionError:
    return False
  return True


def stores(state: Any, repeats: int, gap_s: float = 0.5) -> dict[str, Any]:
  """Each store's first save, warm save and warm restore of ``state``; and
  the return of each of the first ``keep + 1`` saves (each into a slot of
  its own's first use), ``gap_s`` apart (a train step, when a slot is made
  ahead), against a warm save's (``first_saves_vs_warm``)."""
  import jax
  nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
  out: dict[str, Any] = {"state_mb": nbytes >> 20}
  for kind in STORES:
    d = ram_dir("snapstore-dc-")
    try:
      with manager(kind, str(d)) as mgr:
        t = time.perf_counter()
        mgr.save(0, state, force=True)
        early = [time.perf_counter() - t]
        mgr.wait_until_finished()
        first = time.perf_counter() - t
        for i in range(1, mgr.options.keep + 1):
          time.sleep(gap_s)
          t = time.perf_counter()
          mgr.save(i, state, force=True)
          early.append(time.perf_counter() - t)
          mgr.wait_until_finished()
        returns, completes = [], []
        for i in range(len(early), len(early) + repeats):
          t = time.perf_counter()
          mgr.save(i, state, force=True)
          returns.append(time.perf_counter() - t)
          mgr.wait_until_finished()
          completes.append(time.perf_counter() - t)
        r, restore_s = _restores(mgr, state, repeats)
        out[kind] = {
            "first_save_s": round(first, 4),
            "first_saves_return_s": [round(x, 4) for x in early],
            "first_saves_vs_warm": round(max(early) / min(returns), 3),
            "save_returns_s": round(min(returns), 4),
            "save_complete_s": round(min(completes), 4),
            "save_complete_gbps": _gbps(nbytes, min(completes)),
            "restore_s": round(restore_s, 4),
            "restore_gbps": _gbps(nbytes, restore_s),
            "restored_step": r.step, "bitwise_equal": _equal(r.state, state)}
    finally:
      cleanup(d)
  return out


def train_step(state: Any, step_ms: float) -> tuple[Callable[..., Any], Any, int]:
  """A jitted, donating ``fn(state, x, iters)`` that touches every leaf and
  computes for about ``step_ms`` (a bf16 matmul chain; on CPU, a smoke
  test, of 256 x 256 matrices, not 4096 x 4096)."""
  import jax
  import jax.numpy as jnp
  dim = 256 if jax.default_backend() == "cpu" else 4096
  w = jnp.eye(dim, dtype=jnp.bfloat16) * 0.999
  x = jnp.ones((dim, dim), jnp.bfloat16)

  def body(state, x, iters):
    y = jax.lax.fori_loop(0, iters, lambda _, y: jnp.tanh(y @ w), x)
    return jax.tree.map(lambda a: a * 0.5 + y[0, 0].astype(a.dtype) * 0.5, state)
  fn = jax.jit(body, static_argnums=2, donate_argnums=0)
  iters = 1
  while True:
    state = jax.block_until_ready(fn(state, x, iters))  # compiles
    t = time.perf_counter()
    state = jax.block_until_ready(fn(state, x, iters))
    took = time.perf_counter() - t
    if took * 1e3 >= step_ms or iters >= 1 << 14:
      break
    iters *= 2
  # the last doubling overshoots (up to 2x): scale back to about step_ms
  iters = max(1, round(iters * step_ms / (took * 1e3)))
  jax.block_until_ready(fn(state, x, iters))  # compiles
  return fn, x, iters


class _Loop:
  """A timed loop of a donating step, with or without snapshots: the time a
  step takes until the loop's last step is done (its last snapshot's drain
  is waited for after the clock stops)."""

  def __init__(self, advance: Callable[[Any, int], Any], state: Any) -> None:
    self.advance, self.state, self.step = advance, state, 0

  def run(self, steps: int, mgr: Any | None = None, every: int = 1,
          force: bool = True) -> float:
    """The mean step time of ``steps`` steps; with ``mgr`` a save every
    ``every`` (``force=False``: every step offered, the manager's interval
    decides)."""
    import jax
    t = time.perf_counter()
    for _ in range(steps):
      self.step += 1
      self.state = self.advance(self.state, self.step)
      if mgr is not None and self.step % every == 0:
        mgr.save(self.step, self.state, force=force)
    jax.block_until_ready(self.state)
    took = time.perf_counter() - t
    if mgr is not None:
      mgr.wait_until_finished()
    return took / steps

  def none_vs_every_step(self, steps: int, rounds: int, mgr: Any) -> tuple[float, float]:
    """The best round's step time without snapshots and with one every
    step, rounds interleaved."""
    none, snap = float("inf"), float("inf")
    for _ in range(rounds):
      none = min(none, self.run(steps))
      snap = min(snap, self.run(steps, mgr))
    return none, snap


def overhead(state_mb: int, step_ms: float, intervals: Sequence[int], steps: int,
             rounds: int, kinds: Sequence[str]) -> dict[str, Any]:
  """Step time with a snapshot every ``interval`` steps over step time
  without: the time until the loop's last step is done (the last
  snapshot's drain is waited for after the clock stops; run several
  intervals a loop so that each snapshot's cost on later steps counts)."""
  import jax
  state = make_state(state_mb)
  fn, x, iters = train_step(jax.tree.map(lambda a: a.copy(), state), step_ms)
  out: dict[str, Any] = {"state_mb": state_mb, "iters": iters, "steps_a_loop": steps}
  for kind in kinds:
    d = ram_dir("snapstore-dc-")
    try:
      with manager(kind, str(d)) as mgr:
        run = _Loop(lambda st, _: fn(st, x, iters), state)
        run.run(steps, mgr, max(intervals))  # compiles, and the first save makes the store
        best: dict[str, float] = {}
        for _ in range(rounds):
          best["none"] = min(best.get("none", float("inf")), run.run(steps))
          for i in intervals:
            best[str(i)] = min(best.get(str(i), float("inf")), run.run(steps, mgr, i))
        state = run.state
      out[kind] = {"step_ms_none": round(best["none"] * 1e3, 2), **{
          f"every_{i}": {"step_ms": round(best[str(i)] * 1e3, 2),
                         "overhead": round(best[str(i)] / best["none"] - 1.0, 4)}
          for i in intervals}}
    finally:
      cleanup(d)
  return out


def _rss_mb() -> float:
  """This process's resident memory, MiB (Linux; else -1)."""
  try:
    with open("/proc/self/statm") as f:
      return round(int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / (1 << 20), 1)
  except (OSError, ValueError, IndexError):
    return -1.0


def link(mb: int, repeats: int) -> dict[str, Any]:
  """The raw link, ``mb`` MiB: device -> host in pieces of each size (cut on
  the device, then ``copy_to_host_async()`` on all, then ``np.asarray`` of
  each; fresh pieces each time, an array caches its host copy), and host ->
  device of the same pieces and of one array."""
  import jax
  import jax.numpy as jnp

  from snapstore import _jax_private
  from snapstore._jax_compat import single_device_sharding
  dev = jax.devices()[0]
  total = mb << 20
  x = jax.device_put(np.arange(total // 4, dtype=np.float32), dev)
  out: dict[str, Any] = {"mb": mb}
  for piece_mb in LINK_PIECES_MB:
    n = total // (piece_mb << 20)
    if n < 1:
      continue
    split = jax.jit(lambda a, i, n=n: jnp.split(a + i, n))
    best = float("inf")
    for i in range(repeats + 1):  # (the first compiles)
      pieces = jax.block_until_ready(split(x, float(i)))
      t = time.perf_counter()
      _jax_private.copy_to_host_async(pieces)
      host = [np.asarray(p) for p in pieces]
      if i:
        best = min(best, time.perf_counter() - t)
    out[f"d2h_{piece_mb}mb_pieces_gbps"] = _gbps(total, best)
    out[f"h2d_{piece_mb}mb_pieces_gbps"] = _gbps(total, _best(
        lambda host=host: jax.device_put(host, [dev] * len(host)), repeats))
  whole = np.asarray(jax.device_get(x))
  out["h2d_one_array_gbps"] = _gbps(total, _best(lambda: jax.device_put(whole, dev), repeats))
  # What SLICE_HOSTS does now: 4 MiB pieces cut on the device, put at once
  # into each host memory kind (jax.Arrays that stay there).
  n4 = max(1, total // (4 << 20))
  split4 = jax.jit(lambda a, i: jnp.split(a + i, n4))
  for kind in ("unpinned_host", "pinned_host"):
    try:
      put = single_device_sharding(dev, memory_kind=kind)
      best = float("inf")
      for i in range(repeats + 1):  # (the first compiles)
        pieces = jax.block_until_ready(split4(x, float(i)))
        t = time.perf_counter()
        jax.block_until_ready(jax.device_put(pieces, [put] * len(pieces)))
        if i:
          best = min(best, time.perf_counter() - t)
      out[f"d2h_4mb_pieces_to_{kind}_gbps"] = _gbps(total, best)
    except Exception as e:  # noqa: BLE001 - a memory kind this platform lacks
      out[f"{kind}_pieces_error"] = repr(e)[:300]
  # Into jax.Arrays that stay in host memory (a per-slice store on
  # Pathways): 16 leaves put at once to each host memory kind, from the
  # leaves themselves and from fresh copies in device memory.
  leaves = jax.block_until_ready(jax.jit(lambda a: jnp.split(a, 16))(x))
  copy = jax.jit(lambda xs: [jnp.array(a, copy=True) for a in xs])
  for kind in ("pinned_host", "unpinned_host"):
    try:
      put = single_device_sharding(dev, memory_kind=kind)
      out[f"d2h_16_leaves_to_{kind}_gbps"] = _gbps(total, _best(
          lambda put=put: jax.device_put(leaves, [put] * len(leaves)), repeats))
      out[f"d2h_16_leaf_copies_to_{kind}_gbps"] = _gbps(total, _best(
          lambda put=put: jax.device_put(copy(leaves), [put] * len(leaves)), repeats))
      held = jax.block_until_ready(jax.device_put(leaves, [put] * len(leaves)))
      out[f"h2d_16_leaves_from_{kind}_gbps"] = _gbps(total, _best(
          lambda held=held: jax.device_put(held, [dev] * len(held)), repeats))
    except Exception as e:  # noqa: BLE001 - a memory kind this platform lacks
      out[f"{kind}_error"] = repr(e)[:300]
  # The raw link a store is held to: the best way device -> host measured here
  d2h = {k: v for k, v in out.items() if k.startswith("d2h_") and isinstance(v, float)}
  out["d2h_best_gbps"] = max(d2h.values())
  out["d2h_best_way"] = max(d2h, key=lambda k: d2h[k])
  return out


def _rss_loop(run: _Loop, mgr: Any, snapshots: int, chunk: int = 20) -> dict[str, Any]:
  """Host RSS over ``snapshots`` saves, one a step (the same slots and arenas
  written again and again), sampled every ``chunk``: one sample pair can land
  on a trough or a peak of the allocator's churn, a trace shows a trend.
  ``growth_mb``: the second half's peak over the first half's."""
  trace = [_rss_mb()]
  for done in range(0, snapshots, chunk):
    run.run(min(chunk, snapshots - done), mgr)
    trace.append(_rss_mb())
  half = len(trace) // 2
  return {"rss_loop_snapshots": snapshots, "rss_loop_mb": trace,
          "rss_loop_growth_mb": round(max(trace[half:]) - max(trace[:half]), 1)}


def per_step(state_mb: int, step_ms: float, steps: int, rounds: int, repeats: int,
             kinds: Sequence[str], link_gbps: float | None,
             staging: str = "AUTO", rss_snapshots: int = 0) -> dict[str, Any]:
  """Per-step time with a snapshot every step against none, each of
  ``kinds`` (:data:`PER_STEP`), with its save metrics, host RSS, and a
  restore against a raw ``device_put`` of the same bytes; then host RSS
  over ``rss_snapshots`` more saves, one a step."""
  import jax
  state = transformer_state(state_mb) if LAYOUT == "transformer" else make_state(state_mb)
  nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
  fn, x, iters = train_step(jax.tree.map(lambda a: a.copy(), state), step_ms)
  out: dict[str, Any] = {"state_mb": state_mb, "step_ms_asked": step_ms, "iters": iters,
                         "steps_a_loop": steps, "layout": LAYOUT,
                         "leaves": len(jax.tree.leaves(state))}
  run = _Loop(lambda st, _: fn(st, x, iters), state)

  for name in kinds:
    kind, extra = PER_STEP[name]
    if _stages(kind):
      extra = {"staging": staging, **extra}
    d = ram_dir("snapstore-dc-")
    try:
      with manager(kind, str(d), **extra) as mgr:
        run.run(steps, mgr)  # compiles, and the first save makes the store
        rss_before = _rss_mb()
        m = mgr.metrics
        started, stall0, capture0 = m.snapshots_started, m.stall_seconds_total, \
            m.capture_seconds_total
        none, snap = run.none_vs_every_step(steps, rounds, mgr)
        rss_after = _rss_mb()
        saves = m.snapshots_started - started
        row: dict[str, Any] = {
            "step_ms_none": round(none * 1e3, 2), "step_ms_every_1": round(snap * 1e3, 2),
            "over_none": round(snap / none, 4),
            "save_returns_ms_mean": round((m.capture_seconds_total - capture0) / saves * 1e3, 2),
            "stall_ms_mean": round((m.stall_seconds_total - stall0) / saves * 1e3, 2),
            "staged_bytes": m.staged_bytes,
            "copied_before_return_bytes": m.copied_before_return_bytes,
            "waited_busy": m.waited_busy, "drain_s_last": round(m.drain_seconds, 4),
            "rss_mb_before": rss_before, "rss_mb_after": rss_after, "snapshots": saves}
        if link_gbps:
          row["small_budget_bound_ms"] = round(none * 1e3 + 1.2 * nbytes / link_gbps / 1e6, 2)
        run.run(1, mgr)
        state = run.state
        expected = jax.device_get(state)
        r, restore_s = _restores(mgr, state, repeats)
        shardings = jax.tree.map(lambda a: a.sharding, state)
        raw = _best(lambda e=expected, sh=shardings: jax.device_put(e, sh), repeats)
        row.update({"restore_s": round(restore_s, 4), "raw_h2d_s": round(raw, 4),
                    "restore_over_raw_h2d": round(raw / restore_s, 4),
                    "restored_step": r.step, "bitwise_equal": _equal(r.state, expected)})
        del r
        if rss_snapshots:
          row.update(_rss_loop(run, mgr, rss_snapshots))
      out[name] = row
    finally:
      cleanup(d)
  return out


def host(mb: int, repeats: int, threads: Sequence[int] = (1, 2, 4, 8),
         link_gbps: float | None = None) -> dict[str, Any]:
  """The host's share of a save: the drain's fused copy with its crc32c
  (``snapstore._checksum.copy_crc``, 16 MiB chunks, what the drain runs on
  its pool) of ``mb`` MiB into memory touched before, on each number of
  ``threads``; with ``link_gbps``, the cores that keep up with 1, 4 and 8
  chips of that link each."""
  import math
  from concurrent import futures

  from snapstore._checksum import copy_crc
  size = mb << 20
  src = np.arange(size // 4, dtype=np.uint32).view(np.uint8)
  dst = np.zeros(size, np.uint8)
  chunk = 16 << 20
  out: dict[str, Any] = {"mb": mb, "cores": os.cpu_count()}
  for n in threads:
    with futures.ThreadPoolExecutor(n) as pool:
      def run(pool: futures.Executor = pool) -> None:
        list(pool.map(lambda a: copy_crc(dst[a:a + chunk], src[a:a + chunk], 0),
                      range(0, size, chunk)))
      run()
      best = float("inf")
      for _ in range(repeats):
        t = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t)
    out[f"copy_crc_{n}_threads_gbps"] = _gbps(size, best)
  one = out[f"copy_crc_{threads[0]}_threads_gbps"] / threads[0]
  out["copy_crc_gbps_a_core"] = round(one, 2)
  if link_gbps:
    out["cores_to_keep_up"] = {f"{chips}_chips": math.ceil(chips * link_gbps / one)
                               for chips in (1, 4, 8)}
  return out


def model(steps: int, rounds: int, repeats: int, *, dim: int, layers: int, vocab: int,
          seq: int, batch: int, kinds: Sequence[str] = ("host_files",),
          host_mtbf_s: float = 0.0) -> dict[str, Any]:
  """The demo's flax transformer (adam), sized by the arguments, trained on
  the device with a snapshot every step against none, for each store of
  ``kinds`` (:data:`STORES`); with ``host_mtbf_s``, also under
  ``AutoInterval`` (its interval and step time); its train state's bytes,
  and a restore of the last snapshot, bitwise checked."""
  import jax

  import snapstore
  from snapstore.demo.example import ModelConfig, Trainer
  cfg = ModelConfig(vocab=vocab, dim=dim, heads=max(1, dim // 128), layers=layers, seq=seq,
                    batch=batch, lr=1e-4)
  tr = Trainer(cfg)
  state = tr.init_state()
  nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
  out: dict[str, Any] = {"state_mb": round(nbytes / 2**20, 1), "leaves":
                         len(jax.tree.leaves(state)), "dim": dim, "layers": layers,
                         "seq": seq, "batch": batch}
  run = _Loop(lambda st, s: tr.step(st, s)[0], state)
  for kind in kinds:
    d = ram_dir("snapstore-dc-")
    row: dict[str, Any] = {}
    try:
      with manager(kind, str(d)) as mgr:
        run.run(steps, mgr)  # compiles, and the first save makes the store
        none, snap = run.none_vs_every_step(steps, rounds, mgr)
        m = mgr.metrics
        row.update(step_ms_none=round(none * 1e3, 2), step_ms_every_1=round(snap * 1e3, 2),
                   over_none=round(snap / none, 4), staged_bytes=m.staged_bytes,
                   stall_ms_last=round(m.stall_seconds * 1e3, 2))
        run.run(1, mgr)
        expected = jax.device_get(run.state)
        t = time.perf_counter()
        r = mgr.restore(tr.abstract_state())
        jax.block_until_ready(r.state)
        row.update(restore_s=round(time.perf_counter() - t, 4), restored_step=r.step,
                   bitwise_equal=_equal(r.state, expected))
        del r, expected
      if host_mtbf_s:
        auto = snapstore.AutoInterval(host_mtbf_s=host_mtbf_s)
        with manager(kind, str(d), interval=auto) as mgr:
          run.run(steps, mgr, force=False)  # measures its costs
          took = run.run(steps * rounds, mgr, force=False)
          row.update(auto_step_ms=round(took * 1e3, 2), auto_over_none=round(took / none, 4),
                     auto_interval=mgr.metrics.interval,
                     auto_reason=mgr.metrics.interval_reason)
    finally:
      cleanup(d)
    out[kind] = row
  return out


def orbax(state: Any, repeats: int, snapstore_restore_s: float) -> dict[str, Any]:
  """Orbax's StandardCheckpointer on a local directory, the same state."""
  import jax
  try:
    import orbax.checkpoint as ocp
  except ImportError as e:
    return {"skipped": f"no Orbax: {e}"}
  d = ram_dir("snapstore-dc-orbax-")
  try:
    ckpt = ocp.StandardCheckpointer()
    saves, restores = [], []
    for i in range(repeats):
      t = time.perf_counter()
      ckpt.save(d / str(i), state)
      ckpt.wait_until_finished()
      saves.append(time.perf_counter() - t)
    for i in range(repeats):
      t = time.perf_counter()
      got = ckpt.restore(d / str(i), _abstract(state))
      jax.block_until_ready(got)
      restores.append(time.perf_counter() - t)
    ckpt.close()
    return {"dir": str(d), "save_s": round(min(saves), 4), "restore_s": round(min(restores), 4),
            "bitwise_equal": _equal(got, state),
            "pinned_restore_over_orbax": round(snapstore_restore_s / min(restores), 4)}
  finally:
    cleanup(d)


def recovery_check() -> dict[str, Any]:
  """A recoverable one-process job on GPU: the flags and the InPlace loop run."""
  import jax

  from snapstore import recovery
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  service = recovery.start_service(f"127.0.0.1:{port}", 1)
  try:
    recovery.initialize(f"127.0.0.1:{port}", 1, 0, external_service=True)
    job = recovery.InPlace()
    step_fn = jax.jit(lambda v: v * 2.0)
    steps = 0
    while steps < 3:
      try:
        with job.live() as devices:
          step_fn(jax.device_put(np.ones(4, np.float32), devices[0])).block_until_ready()
        steps += 1
      except job.FAILURES as e:
        job.failed(e)
    out = {"steps": steps, "generation": job.generation,
           "unsupported": recovery.unsupported()}
    job.close()
    return out
  finally:
    service.shutdown()


def main(argv: Sequence[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog="benchmarks.device_check", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--mb", type=int, default=1024, help="capture: one leaf of this size")
  p.add_argument("--state-mb", type=int, nargs="+", default=[2048],
                 help="per_step: each; stores, overhead, orbax: the first")
  p.add_argument("--step-ms", type=float, nargs="+", default=[200.0],
                 help="per_step: each; overhead: the first")
  p.add_argument("--per-step-steps", type=int, default=10, help="a per_step loop's steps")
  p.add_argument("--cases", nargs="+", metavar="MB:MS",
                 help="per_step: these (state MiB, step ms) pairs, not each --state-mb "
                      "with each --step-ms")
  p.add_argument("--staging", choices=["AUTO", "ALWAYS", "NEVER"], default="AUTO",
                 help="per_step: host files' SnapshotOptions.staging where a store does not "
                      "set it (ALWAYS: the staged path on CPU devices, with --cpu)")
  p.add_argument("--per-step-stores", nargs="+", choices=list(PER_STEP),
                 default=["host_files", "host_files_budget_64mb", "pinned_process",
                          "pinned_process_budget_64mb"])
  p.add_argument("--rss-snapshots", type=int, default=0,
                 help="per_step: host RSS over this many more saves, one a step (e.g. 200)")
  p.add_argument("--intervals", type=int, nargs="+", default=[1, 3, 10])
  p.add_argument("--steps", type=int, default=30, help="a loop's steps (overhead)")
  p.add_argument("--stores", nargs="+", choices=list(STORES), default=list(STORES),
                 help="overhead: the stores to run")
  p.add_argument("--layout", choices=["flat", "transformer"], default="flat",
                 help="per_step: the state's layout (transformer: 2-D bf16 params, f32 "
                      "moments)")
  p.add_argument("--piece-mb", type=int, default=0,
                 help="host files' staging_piece_bytes, in MiB (0: the default)")
  p.add_argument("--first-gap-s", type=float, default=0.5,
                 help="stores: seconds between the first keep + 1 saves (a train step)")
  p.add_argument("--rounds", type=int, default=2)
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--sections", nargs="+",
                 default=["capture", "link", "stores", "overhead", "per_step"],
                 choices=["capture", "link", "stores", "overhead", "per_step", "host",
                          "model"],
                 help="stores includes the Orbax comparison")
  p.add_argument("--model", type=int, nargs=5, default=[1024, 8, 8192, 512, 8],
                 metavar=("DIM", "LAYERS", "VOCAB", "SEQ", "BATCH"),
                 help="model: the transformer's size (the default: ~1.4 GiB of train state)")
  p.add_argument("--model-stores", nargs="+", choices=list(STORES), default=["host_files"],
                 help="model: the stores to train it with")
  p.add_argument("--host-mtbf-s", type=float, default=0.0,
                 help="model: also under AutoInterval with this host MTBF (0: not)")
  p.add_argument("--out", default="bench-results/device_check.json")
  p.add_argument("--cpu", action="store_true",
                 help="run on the CPU anyway: a smoke test of this script, not a measurement")
  a = p.parse_args(argv)
  global PIECE_MB, LAYOUT
  PIECE_MB, LAYOUT = a.piece_mb, a.layout
  gpu = "cuda" in os.environ.get("JAX_PLATFORMS", "") or shutil.which("nvidia-smi")
  if gpu:
    from snapstore import recovery
    recovery.set_flags()  # before the backend starts
  import jax
  if jax.default_backend() == "cpu" and not a.cpu:
    emit("device_check", {"skipped": "no accelerator: JAX's backend is the CPU"}, a.out)
    return 0
  import snapstore
  import snapstore._checksum as cs
  out: dict[str, Any] = {
      "devices": [str(d) for d in jax.devices()], "jax": jax.__version__,
      "fused_copy": cs.FUSED, "xla_flags": os.environ.get("XLA_FLAGS", ""),
      "cpus": os.cpu_count(), "copy_threads": snapstore.SnapshotOptions().copy_threads}
  t0 = time.perf_counter()

  def done(what: str) -> None:  # progress, and what is measured so far on disk
    print(f"[device_check] {what} done at {time.perf_counter() - t0:.0f} s", file=sys.stderr,
          flush=True)
    if a.out:
      Path(a.out).parent.mkdir(parents=True, exist_ok=True)
      Path(a.out).write_text(json.dumps({"benchmark": "device_check", "partial": True, **out},
                                        indent=2))
  if "capture" in a.sections:
    out["capture"] = capture(a.mb, a.repeats)
    done("capture")
  if "link" in a.sections:
    out["link"] = link(a.mb, a.repeats)
    done("link")
  if "host" in a.sections:
    out["host"] = host(a.mb, a.repeats, link_gbps=out.get("link", {}).get("d2h_best_gbps"))
    done("host")
  if "stores" in a.sections:
    state = make_state(a.state_mb[0])
    out["stores"] = stores(state, a.repeats, a.first_gap_s)
    out["orbax"] = orbax(state, a.repeats, out["stores"]["pinned_device_sum"]["restore_s"])
    del state
    done("stores")
  if "overhead" in a.sections:
    out["overhead"] = overhead(a.state_mb[0], a.step_ms[0], a.intervals, a.steps, a.rounds,
                               a.stores)
  if "per_step" in a.sections:
    gbps = out.get("link", {}).get("d2h_best_gbps")
    cases = ([(int(c.split(":")[0]), float(c.split(":")[1])) for c in a.cases] if a.cases
             else [(mb, ms) for mb in a.state_mb for ms in a.step_ms])
    out["per_step"] = {}
    for mb, ms in cases:
      out["per_step"][f"{mb}mb_{ms:g}ms"] = per_step(
          mb, ms, a.per_step_steps, a.rounds, a.repeats, a.per_step_stores, gbps, a.staging,
          a.rss_snapshots)
      done(f"per_step {mb} MiB {ms:g} ms")
  if "model" in a.sections:
    dim, layers, vocab, seq, batch = a.model
    try:
      out["model"] = model(a.per_step_steps, a.rounds, a.repeats, dim=dim, layers=layers,
                           vocab=vocab, seq=seq, batch=batch, kinds=a.model_stores,
                           host_mtbf_s=a.host_mtbf_s)
    except ImportError as e:  # flax/optax are the demo's extra
      out["model"] = {"skipped": f"needs snapstore[demo]: {e}"}
    done("model")
  if gpu:
    out["recovery"] = recovery_check()
  emit("device_check", out, a.out)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
