"""Who takes part in a restore, and how hosts that hold pieces meet.

:func:`for_job` gives the manager its peers: :class:`Solo` on one process
(or a single controller), :class:`Distributed` on a multi-controller job.
``Distributed`` restores in two ways:

- **sparse** (``sparse``, ``agree``, ``moves``, ``rebuild``): each host plans from
  its own manifests and a few agreed facts (the newest complete step, which
  copy serves each piece), then moves only the pieces a host lacks;
- **full exchange** (``exchange``): every host gathers every host's manifests
  and plans over them; the fallback when the sparse path declines.

Every collective runs through :class:`collective.Collective` on the device
order all processes agree on (:mod:`snapstore._devices`), so a test or a
benchmark can replace it to play one host of thousands.
"""

from .collective import (
  NONE as NONE,
  Collective as Collective,
  Traffic as Traffic,
  bucket as bucket,
  gather_blobs as gather_blobs,
)
from .moves import slot_bytes as slot_bytes
from .peers import Distributed as Distributed, Solo as Solo, for_job as for_job

__all__ = ["Collective", "Distributed", "Solo", "Traffic", "bucket", "for_job", "gather_blobs",
           "slot_bytes"]
