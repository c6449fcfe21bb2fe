"""The TPU probe behind probe.txt (run 2026-12-06 on one TPU v5e, jax 0.10.2).

1. Where device -> host time goes: ``jax.device_put`` of one leaf to
   ``pinned_host`` and to ``unpinned_host``, 16 leaves to ``pinned_host`` in
   one call, ``np.asarray`` of a fresh device array, and a host ``memcpy``
   (best of 5; 16 MB to 1 GiB).
2. Does a pending capture of a donated state stall the next step? Ten
   donating steps of ~97 ms on a 256 MB state: with no capture, with a
   ``pinned_host`` put of the state after every step, and with the put
   reading an on-device copy of the state; ms a step until the steps are
   done, and until every put is. Each mode runs twice; the best is kept.

``python docs/data/tpu-v5e/probe.py`` on a machine with an accelerator.
"""

import json
import time

import jax
import jax.numpy as jnp
import numpy as np


def best(fn, n=5):
  b = float("inf")
  for _ in range(n):
    t = time.perf_counter()
    jax.block_until_ready(fn())
    b = min(b, time.perf_counter() - t)
  return b


def copies(mb, dev):
  x = jax.device_put(np.arange((mb << 20) // 4, dtype=np.float32), dev)
  pinned = x.sharding.with_memory_kind("pinned_host")
  unpinned = x.sharding.with_memory_kind("unpinned_host")
  parts = [jax.device_put(np.full((mb << 20) // 64, i, np.float32), dev) for i in range(16)]
  to_pinned = [p.sharding.with_memory_kind("pinned_host") for p in parts]
  r = {"d2pinned_s": best(lambda: jax.device_put(x, pinned)),
       "d2unpinned_s": best(lambda: jax.device_put(x, unpinned)),
       "d2pinned_16_leaves_s": best(lambda: jax.device_put(parts, to_pinned))}
  fresh = []
  for i in range(4):
    y = jax.block_until_ready(x + float(i))
    t = time.perf_counter()
    np.asarray(y)
    fresh.append(time.perf_counter() - t)
  r["device_get_fresh_s"] = min(fresh)
  h = np.empty((mb << 20) // 4, np.float32)
  src = np.ones_like(h)
  np.copyto(h, src)
  r["memcpy_s"] = best(lambda: np.copyto(h, src), 5)
  return {k: round(v, 5) for k, v in r.items()} | {
      k.replace("_s", "_gbps"): round((mb << 20) / v / 1e9, 2) for k, v in r.items()}


def stall(dev, iters=128):
  state = {f"w{i}": jax.device_put(jnp.ones((16 << 20) // 4, jnp.float32) * i, dev)
           for i in range(16)}  # 256 MB
  w = jnp.eye(4096, dtype=jnp.bfloat16) * 0.999
  xin = jnp.ones((4096, 4096), jnp.bfloat16)

  def body(s, iters):
    y = jax.lax.fori_loop(0, iters, lambda _, y: jnp.tanh(y @ w), xin)
    return jax.tree.map(lambda a: a * 0.5 + y[0, 0].astype(a.dtype), s)
  step = jax.jit(body, static_argnums=1, donate_argnums=0)
  copy = jax.jit(lambda s: jax.tree.map(jnp.copy, s))
  pin = {k: v.sharding.with_memory_kind("pinned_host") for k, v in state.items()}
  state = jax.block_until_ready(step(state, iters))
  jax.block_until_ready(copy(state))
  res = {}
  for mode in ("none", "capture", "copy_then_capture") * 2:
    held = []
    t = time.perf_counter()
    for _ in range(10):
      state = step(state, iters)
      if mode == "capture":
        held.append(jax.device_put(state, pin))
      elif mode == "copy_then_capture":
        held.append(jax.device_put(copy(state), pin))
      if len(held) > 2:
        held.pop(0)
    jax.block_until_ready(state)
    steps_s = time.perf_counter() - t
    jax.block_until_ready(held)
    all_s = time.perf_counter() - t
    res[mode] = min(res.get(mode, (9e9, 0))[0], steps_s * 100), round(all_s * 100, 2)
  return res


if __name__ == "__main__":
  dev = jax.devices()[0]
  print(json.dumps({f"{mb}mb": copies(mb, dev) for mb in (16, 64, 256, 1024)}, indent=1))
  print(json.dumps({"step_ms_(steps_done, all_captures_done)": stall(dev)}, indent=1))
