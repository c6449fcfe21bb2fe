"""snapstore's ``Snapshotter`` against Orbax v1's ``Snapshotter``, same state.

``python -m benchmarks.vs_orbax_snapshotter --mb 256``: the rows of
``benchmarks.vs_orbax`` that compare the Pathways snapshotters (8 CPU devices
as 2 slices; snapstore with its pinned-host store and with host files): save
return, save complete and load times, and the ratios other / snapstore's
pinned-host store (>1: the pinned-host store is faster).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from benchmarks._common import emit, setup_cpu_devices
from benchmarks.vs_orbax import run


def main(argv: Sequence[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog="benchmarks.vs_orbax_snapshotter", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--mb", type=int, default=256)
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--out", default="bench-results/vs_orbax_snapshotter.json")
  args = p.parse_args(argv)
  setup_cpu_devices(8)
  systems = ("snapstore", "snapstore_host_files", "orbax_snapshotter")
  emit("vs_orbax_snapshotter", run(args.mb, args.repeats, only=systems), args.out)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
