"""MaxText's own elastic training (single controller) on 8 CPU devices as 2
virtual slices, with slice losses injected: a test and benchmark worker, not
part of the library.

::

  python -m benchmarks._maxtext_elastic --out DIR [--lose STEP ...] \\
      [--back STEP] [--flip STEP ...] -- <MaxText args, snapshot_* keys included>

runs ``snapstore.integrations.maxtext.train`` (MaxText 0.2.5's pre-training
loop with the snapstore hook) in this process. What cannot run on a CPU is
replaced, and only that:

* MaxText's Pathways gate (``pathwaysutils.is_pathways_backend_used``) says
  yes; pathwaysutils' own backend stays off (no IFRT proxy is registered);
* the slice map (``elastic.get_slice_to_devices``): devices 0-3 are slice 0,
  4-7 slice 1 (CPU devices have no ``slice_index``);
* the slice health check (``elastic.get_active_slice_indices``) reports what
  this worker decides;
* ``elastic_utils.live_devices``: the devices of the active slices (MaxText's
  own reads ``slice_index``);
* the elastic manager's poll interval: 0.1 s (MaxText passes none: 10 s).

A loss (``--lose S``): after step S trained and its snapshot committed,
what slice 1's store holds raises DATA_LOSS when read from then on (its
hosts' memory is gone; ``--flip S`` also flips a byte of slice 0's copy of
a slice-1 piece of step S), then pathwaysutils'
``DeviceLossSimulator`` marks slice 1 lost and the next read of the state
raises DATA_LOSS, as on Pathways. The simulator is stopped at the next
health check, before the retry re-jits (while it runs, ``jax.jit`` has no
``.lower()``). Pause-resume (``elastic_min_slice_count=-1``): slice 1 is
back after two health checks. Replica-resize (``elastic_min_slice_count=1``):
slice 1 stays down until step ``--back`` is about to be saved; the worker
waits there until MaxText's monitor sees it, so MaxText's scale-up comes at
the same step in every run.

Not exercised here: the IFRT proxy and remote dispatch, the DCN hybrid mesh
(every CPU device counts as slice 0 for MaxText's mesh), real loss of pinned
host memory (reads of it raise instead), heartbeat timeouts.

Writes ``DIR/worker.json``: the fault times, and MaxText's report from the
hook (``maxtext-inc0-host0.json`` beside it).
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import os
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

DEVICES, PER_SLICE = 8, 4


def _flip_cross_copy(manager: Any, step: int) -> str:
  """Flips a byte of slice 0's copy of a piece that slice 1 owns, at
  ``step``; returns the leaf's path."""
  store = manager._backend.stores[0]
  (m,) = [m for m in store.manifests() if m.step == step]
  p = next(p for p in m.pieces if p.owner == 1 and p.leaf >= 0 and p.nbytes >= 64)
  arr = store.array(m.slot, p.offset)
  arr.block_until_ready()
  ctypes.c_uint8.from_address(arr.unsafe_buffer_pointer() + p.nbytes // 2).value ^= 0x10
  return m.leaves[p.leaf].path


class Faults:
  """Slice 1's health, the simulator, and the fault log."""

  def __init__(self, lose: Sequence[int], back: int | None, flip: Sequence[int]):
    import jax
    from pathwaysutils.test.mock_fault_injection import DeviceLossSimulator
    devs = jax.devices()
    if len(devs) != DEVICES:
      raise SystemExit(f"{DEVICES} CPU devices expected, found {len(devs)}")
    self.slices = {k: devs[k * PER_SLICE:(k + 1) * PER_SLICE] for k in range(2)}
    self.lose, self.back, self.flip = list(lose), back, set(flip)
    self.down: dict[int, int | None] = {}  # slice -> health checks until back (None: held)
    self.sim = DeviceLossSimulator()
    self.log: list[dict[str, Any]] = []
    self.dead: dict[int, Any] = {}  # id -> a lost slice's stored piece (held: ids stay)
    self._lock = threading.Lock()

  def health(self, slice_to_devices: Any = None, checker: Any = None) -> frozenset[int]:
    with self._lock:
      if self.sim._active:  # the event is being handled: stop before the retry re-jits
        self.sim.stop()
      up = set()
      for k in (slice_to_devices or self.slices):
        left = self.down.get(k, 0)
        if k in self.down and left is not None and left <= 0:
          del self.down[k]
        if k in self.down:
          if left is not None:
            self.down[k] = left - 1
        else:
          up.add(k)
      return frozenset(up)

  def before_save(self, step: int) -> None:
    """At step ``--back``: slice 1 returns; waits until MaxText's monitor
    has seen it (so the scale-up follows this step)."""
    if self.back is None or step != self.back or 1 not in self.down:
      return
    from maxtext.utils import elastic_utils
    with self._lock:
      self.down.pop(1, None)
    self.log.append({"back": step, "time": time.time()})
    deadline = time.time() + 60
    while not elastic_utils.elastic_manager.available_inactive_slices:
      if time.time() > deadline:
        raise RuntimeError("MaxText's elastic monitor never saw slice 1 return")
      time.sleep(0.02)

  def after_save(self, step: int, state: Any) -> None:
    """After step ``--lose``: slice 1 is lost; raises DATA_LOSS."""
    if not self.lose or step != self.lose[0]:
      return
    import jax

    from snapstore.integrations.maxtext import train as hook
    self.lose.pop(0)
    manager = hook.current.manager if hook.current is not None else None
    flipped = None
    if manager is not None:
      manager.wait_until_finished()
      if step in self.flip:
        flipped = _flip_cross_copy(manager, step)
      # Its hosts' memory is gone: what slice 1's store holds now raises
      # DATA_LOSS when read, as on Pathways (the hook must forget it).
      store = manager._backend.stores[1]
      self.dead.update({id(a): a for arrays in store._slots.values() for a in arrays
                        if a is not None})
    with self._lock:
      self.down[1] = 2 if self.back is None else None
    self.log.append({"lost": step, "time": time.time(), "flipped": flipped})
    self.sim.start()
    self.sim.mark_slice_lost(1, self.slices)
    jax.block_until_ready(state)  # raises DATA_LOSS
    raise RuntimeError("the simulator did not raise for the lost slice")


def install(faults: Faults) -> None:
  """The replacements that make MaxText's elastic path run on CPU."""
  import pathwaysutils
  from maxtext.utils import elastic_utils
  from pathwaysutils.elastic import elastic, manager
  pathwaysutils.is_pathways_backend_used = lambda: True
  elastic.get_slice_to_devices = lambda devices=None: {k: list(v)
                                                       for k, v in faults.slices.items()}
  elastic.get_active_slice_indices = faults.health

  def live_devices(config: Any = None) -> list[Any]:
    em = elastic_utils.elastic_manager
    if em is None:
      return [d for devs in faults.slices.values() for d in devs]
    return [d for k in sorted(em.active_slice_indices) for d in faults.slices[k]]
  elastic_utils.live_devices = live_devices
  manager.Manager.elastic_retry = functools.partialmethod(  # type: ignore[method-assign]
      manager.Manager.elastic_retry, poll_interval=0.1)
  import jax

  from snapstore._backends.pinned.store import PinnedHostStore
  real_part = PinnedHostStore.part

  def part(store: Any, slot: int, position: int) -> Any:
    got = real_part(store, slot, position)
    if faults.dead.get(id(got)) is got:
      raise jax.errors.JaxRuntimeError("DATA_LOSS: the slice holding this array was lost "
                                       "(simulated)")
    return got
  PinnedHostStore.part = part  # type: ignore[method-assign]


def wrap_saves(faults: Faults) -> None:
  """Outside the hook's wrap of ``maybe_save_checkpoint`` (installed when
  MaxText's ``train.main`` starts, after the hook's own)."""
  from maxtext.common import checkpointing
  from maxtext.trainers.pre_train import train
  real_main = train.main

  def main(argv: Sequence[str]) -> None:
    inner = checkpointing.maybe_save_checkpoint

    @functools.wraps(inner)
    def save(checkpoint_manager: Any, state: Any, config: Any, data_iterator: Any,
             step: int | None = None) -> Any:
      if step is not None:
        faults.before_save(int(step))
      out = inner(checkpoint_manager, state, config, data_iterator, step)
      if step is not None:
        faults.after_save(int(step), state)
      return out
    checkpointing.maybe_save_checkpoint = save
    real_main(argv)
  train.main = main


def main(argv: Sequence[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  if "--" in argv:
    ours, maxtext_args = argv[:argv.index("--")], argv[argv.index("--") + 1:]
  else:
    ours, maxtext_args = argv, []
  p = argparse.ArgumentParser(prog="benchmarks._maxtext_elastic", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--out", required=True)
  p.add_argument("--lose", type=int, nargs="*", default=[])
  p.add_argument("--back", type=int, default=None)
  p.add_argument("--flip", type=int, nargs="*", default=[],
                 help="at these --lose steps, also flip a byte of slice 0's cross-slice copy")
  args = p.parse_args(ours)
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + f" --xla_force_host_platform_device_count={DEVICES}")
  os.environ["DECOUPLE_GCLOUD"] = "TRUE"  # else MaxText's retry cleanup asks for credentials
  os.environ["SNAPSTORE_REPORT_DIR"] = str(out)
  faults = Faults(args.lose, args.back, args.flip)
  install(faults)
  wrap_saves(faults)
  from snapstore.integrations.maxtext import train as hook
  started = time.time()
  try:
    return hook.main([hook.__file__, *maxtext_args])
  finally:
    (out / "worker.json").write_text(json.dumps({"faults": faults.log, "started": started,
                                                 "ended": time.time()}))


if __name__ == "__main__":
  raise SystemExit(main())
