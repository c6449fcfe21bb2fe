"""The demo's worker with the multi-host restore's overlap turned on, as on
an accelerator (``tests/test_multihost.py``): each host puts the leaves
whose pieces it holds while it still reads the rest, and notes each such
restore in ``<--out>/overlap-host<h>.txt`` (how many leaves it put early)."""

import sys
from pathlib import Path

from snapstore import _assemble
from snapstore._multihost import peers
from snapstore.demo import worker

peers._puts_copy = lambda targets: True  # (CPU devices adopt on a put; a TPU copies)
_real = _assemble.Assembler.read_and_place


def _noted(self, *args, **kw):
  out = _real(self, *args, **kw)
  import jax
  where = Path(sys.argv[sys.argv.index("--out") + 1])
  with open(where / f"overlap-host{jax.process_index()}.txt", "a") as f:
    f.write(f"{sum(x is not None for x in out)} of {len(out)}\n")
  return out


_assemble.Assembler.read_and_place = _noted

if __name__ == "__main__":
  raise SystemExit(worker.main())
