"""What snapstore ships for testing a job: a local supervisor, a worker's
side of it, and the conformance suite every snapshot backend passes.

- :func:`launch` (:mod:`.supervisor`) starts N host processes of a training
  module with ``jax.distributed`` on CPU, kills them for real (:class:`Kill`)
  and restarts them as JobSet would: the whole job, or one host in place.
  ``snapstore launch`` is its command line.
- :mod:`.worker`: what a process it starts calls (``init_from_env``, the
  ``report_*`` functions, ``global_digest``).
- :mod:`.backend_suite`: ``BackendSuite``, the conformance suite a snapshot
  backend's test module subclasses (needs pytest; not imported here).
- :mod:`.checks`: ``assert_bitwise_equal`` and ``host_copy``.
- :mod:`.lockstep` and :mod:`.job_layout`: a multi-controller job's
  collective stood in for in one process (its hosts as threads in lockstep),
  and a large job's layout and manifests; the sparse restore's tests and
  ``benchmarks.scale`` use them (not imported here).
"""

from .kills import Incarnation as Incarnation, Kill as Kill
from .stall import StallPolicy as StallPolicy
from .supervisor import (
  Supervisor as Supervisor,
  die_with_parent as die_with_parent,
  launch as launch,
)
from .worker import (
    global_digest as global_digest,
    in_place_from_env as in_place_from_env,
    incarnation_from_env as incarnation_from_env,
    init_from_env as init_from_env,
    report_digest as report_digest,
    report_restore as report_restore,
)

__all__ = ["Incarnation", "Kill", "StallPolicy", "Supervisor", "die_with_parent",
           "global_digest", "in_place_from_env", "incarnation_from_env", "init_from_env",
           "launch", "report_digest", "report_restore"]
