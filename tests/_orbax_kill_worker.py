"""One process, a 64 MB state (``tests/test_ram_tier_faults.py``).

``save DIR``: snapshots every step and an async Orbax save every 5 steps;
armed with ``SNAPSTORE_FAULT=persistent@10`` it SIGKILLs itself right after
step 10's Orbax save is dispatched, before Orbax commits it (and before the
step's snapshot). ``restore DIR``: restores the freshest state and writes
``DIR/restored.json``: the step, the source, and whether the state is
bitwise the one saved at that step.
"""

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import snapstore

N = 16 << 20  # float32 elements: 64 MB


def state(step: int) -> dict:
  return {"w": jnp.arange(N, dtype=jnp.float32) + step, "step": jnp.int32(step)}


if __name__ == "__main__":
  jax.config.update("jax_platforms", "cpu")
  mode, where = sys.argv[1], Path(sys.argv[2])
  opts = snapstore.SnapshotOptions(keep=2, store=snapstore.HostFiles(dir=str(where / "store")),
                                   run_id="job", persistent_interval=5)
  with snapstore.SnapshotManager(opts, persistent=str(where / "ckpt")) as mgr:
    if mode == "save":
      for s in range(1, 13):
        if s == 10:  # snapshot 9 and Orbax's step 5 committed: what the kill must find
          mgr.wait_until_finished()
        mgr.save(s, state(s))
    else:
      r = mgr.restore(jax.eval_shape(lambda: state(0)))
      want = state(r.step)
      equal = all(np.array_equal(np.asarray(a), np.asarray(b))
                  for a, b in zip(jax.tree.leaves(r.state), jax.tree.leaves(want), strict=True))
      (where / "restored.json").write_text(json.dumps(
          {"step": r.step, "source": r.source.value, "equal": equal}))
