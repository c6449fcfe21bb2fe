"""snapstore's ``Snapshotter`` against Orbax v1's ``Snapshotter``, same state.

``python -m benchmarks.vs_orbax_snapshotter --mb 256``: the rows of
``benchmarks.vs_orbax`` that compare the Pathways snapshotters (8 CPU devices
as 2 slices; snapstore with its pinned-host store and with host files): save
return, save complete and load times, and the ratios other / snapstore's
pinned-host store (>1: the pinned-host store is faster); then the same with
the bytes split over 500 leaves (``many_leaves``).
"""

from __future__ import annotations

from collections.abc import Sequence

from benchmarks._common import sized_main
from benchmarks.vs_orbax import run

MANY_LEAVES = 500


def main(argv: Sequence[str] | None = None) -> int:
  systems = ("snapstore", "snapstore_host_files", "orbax_snapshotter")

  def both(mb: int, repeats: int) -> dict:
    few = run(mb, repeats, only=systems)
    few["many_leaves"] = run(mb, repeats, only=systems, leaves=MANY_LEAVES)
    return few
  return sized_main("vs_orbax_snapshotter", __doc__, both, argv)


if __name__ == "__main__":
  raise SystemExit(main())
