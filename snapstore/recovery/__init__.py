"""In-place recovery for multi-controller jobs: survivors keep running.

With JAX's fault-tolerance mode (``jax_enable_recoverability``,
``multihost_utils.live_devices``), a process that dies no longer takes the
others down. :func:`initialize` joins the job in that mode, and
:class:`InPlace` is the small loop helper around it::

    snapstore.recovery.initialize(coordinator, num_processes, process_id)
    job = snapstore.recovery.InPlace()
    while step <= last:
      try:
        with job.live() as devices:      # agreed at its exit: all pass, or all fail
          if job.changed:                # first pass, or the job healed
            mesh = Mesh(np.array(devices).reshape(...), axes)
            state, step = restore_or_init(mesh)   # mgr.restore(...)
          state = train_step(state, step)
          jax.block_until_ready(state)   # the step counts only if all finish it
          mgr.save(step, state)
        step += 1
      except job.FAILURES as e:
        job.failed(e)                    # raises RestartRequired after K in a row
                                         # (live() does too when no order is left):
                                         # exit with RESTART_EXIT_CODE then

A survivor keeps its process, its imports, its compiled programs and its RAM
store. When a host dies, ``live()`` raises on every survivor (the step is
discarded) and then waits for the replacement that ``snapstore launch`` starts
with the same process id. Once it is in, ``changed`` is set: everyone
restores the freshest complete snapshot onto the full mesh, the survivors
from their own RAM, the replacement from its peers' (``heal``). With
``min_hosts`` (:class:`ResizePolicy`) they go on without it instead, on the
live devices, and grow back when the replacement joins.

``devices`` comes in one order all processes agree on, new after each failed
step (:mod:`snapstore._devices` says why); build every mesh from it.

On CPU, a survivor can be stuck in a gloo collective whose data was to come
through the dead process, and XLA cannot abort CPU communicators. A watchdog
thread (:mod:`snapstore.recovery.watchdog`) then shuts the process's gloo connections once it
has been stuck ``abort_after_s`` with a peer silent or replaced, so the
collective fails in seconds, not at the collective timeout.

The coordination service normally lives in process 0, so losing process 0
ends the job. ``snapstore launch --in-place`` hosts it in the supervisor
(:func:`start_service`), and the workers connect as clients only: a private
JAX API, guarded by version (:func:`unsupported`). Where in-place recovery is
not possible, :class:`RestartRequired` tells the caller to exit with
:data:`RESTART_EXIT_CODE`, and ``launch`` restarts the whole job as before.
"""


from ..errors import MembersMissing, PeerFailed, RestartRequired
from .in_place import (
    DEFAULT_ABORT_AFTER_S,
    MIN_HOSTS_ENV,
    REPLACEMENT_WAIT_ENV,
    InPlace,
    Recovery,
    Resize,
    ResizePolicy,
    failed_in_block,
)
from .orbax_barrier import Barrier as OrbaxBarrier
from .service import (
    COLLECTIVE_TIMEOUT_ENV,
    CPU_FLAGS,
    DEFAULT_COLLECTIVE_TIMEOUT_S,
    GPU_ENV,
    GPU_FLAGS,
    RESTART_EXIT_CODE,
    SERVICE_ENV,
    TESTED_JAX,
    initialize,
    set_flags,
    start_service,
    unsupported,
)

__all__ = [
    "COLLECTIVE_TIMEOUT_ENV",
    "CPU_FLAGS",
    "DEFAULT_ABORT_AFTER_S",
    "DEFAULT_COLLECTIVE_TIMEOUT_S",
    "GPU_ENV",
    "GPU_FLAGS",
    "MIN_HOSTS_ENV",
    "REPLACEMENT_WAIT_ENV",
    "RESTART_EXIT_CODE",
    "SERVICE_ENV",
    "TESTED_JAX",
    "InPlace",
    "MembersMissing",
    "OrbaxBarrier",
    "PeerFailed",
    "Recovery",
    "Resize",
    "ResizePolicy",
    "RestartRequired",
    "failed_in_block",
    "initialize",
    "set_flags",
    "start_service",
    "unsupported",
]
