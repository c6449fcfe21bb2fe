"""Single-controller elastic MaxText (Pathways): the snapshot side of
MaxText's ``elastic_utils.elastic_retry``.

MaxText wraps its whole train function in pathwaysutils' ``elastic_retry``:
on a slice loss (``JaxRuntimeError`` DATA_LOSS, or DEADLINE_EXCEEDED after
missed heartbeats) or a ``ScaleUpSignalError`` the controller survives, waits
for the slices it needs, and runs the function again, which restores through
``checkpointing.load_state_if_possible`` (wrapped by :mod:`.train`).

:class:`ElasticSide` keeps the per-slice stores in step with that: on the
event, the slices that were active and are down *then* are forgotten (their
hosts' memory is gone, even if they are back by the next attempt); before
each attempt the active slices are set, so snapshots and their cross-slice copies go to those
only. It also writes each event into the process's report: its kind, the
slices lost, the slices the next attempt ran on, where that attempt restored
from, the steps lost, and the time from the event to the first new step.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from typing import Any

from ..pathways import check_pathwaysutils

logger = logging.getLogger(__name__)


def scale_up_signal() -> type[BaseException]:
  """pathwaysutils' ``ScaleUpSignalError``."""
  from pathwaysutils.elastic.manager import ScaleUpSignalError
  return ScaleUpSignalError


def chain(first: Callable[[], Any], then: Callable[[], Any] | None) -> Callable[[], None]:
  """``first()``, then ``then()`` if given."""
  def both() -> None:
    first()
    if then is not None:
      then()
  return both


class ElasticSide:
  """The snapshot side of one ``elastic_retry``: MaxText's elastic manager
  (``elastic_utils.elastic_manager``) and the report's ``elastic`` list.
  Called on the controller's main thread (the retry loop's callbacks, and
  the train loop's wraps)."""

  def __init__(self, config: Any, report: dict[str, Any], *, snapshots: bool = True):
    from maxtext.utils import elastic_utils
    if snapshots:  # (MaxText alone keeps no arrays across an event)
      check_pathwaysutils()
    elastic_utils.ensure_elastic_manager_initialized(config)
    self.elastic = elastic_utils.elastic_manager
    self.manager: Any = None  # the SnapshotManager, once built (at the first restore)
    self.events: list[dict[str, Any]] = report.setdefault("elastic", [])
    self.attempt = 0
    self.last_step: int | None = None  # the newest step trained and saved
    self._open: dict[str, Any] | None = None  # the last event, until its first new step

  def slices(self) -> dict[int, list[Any]]:
    """Failure domain (slice) -> its devices, as MaxText's manager sees them."""
    return {int(k): list(v) for k, v in self.elastic.slice_to_devices.items()}

  def on_event(self) -> None:
    """pathwaysutils' ``on_elastic_event_callback`` (inside its ``except``):
    forgets the slices that are down now."""
    from pathwaysutils.elastic import elastic
    t = time.time()
    error = sys.exc_info()[1]
    kind = "scale_up" if isinstance(error, scale_up_signal()) else "slice_down"
    was_active = {int(k) for k in self.elastic.active_slice_indices}
    try:
      up = elastic.get_active_slice_indices(self.elastic.slice_to_devices)
    except Exception as e:  # noqa: BLE001 - the retry goes on; reads find a lost slice
      logger.warning("elastic event: the slice health check failed (%r); no slice is "
                     "forgotten now, a lost one is when its store fails to read", e)
      up = was_active
    lost = sorted(was_active - {int(k) for k in up})
    event: dict[str, Any] = {
        "attempt": self.attempt, "kind": kind, "time": t, "lost_slices": lost,
        "last_step": self.last_step,
        "error": (f"{type(error).__name__}: {str(error)[:300]}" if error is not None
                  else None)}
    if lost and self.manager is not None:
      self.manager.forget_domains(lost, f"slice lost ({kind} event)")
    self.events.append(event)
    self._open = event

  def before_attempt(self, *, count: bool = True) -> None:
    """pathwaysutils' ``pre_callback`` (once the slices it waits for are
    up): snapshots go to the active slices only."""
    if count:
      self.attempt += 1
    active = sorted(int(k) for k in self.elastic.active_slice_indices)
    if self._open is not None:
      self._open.setdefault("active_slices", active)
    if self.manager is not None:
      self.manager.set_active_domains(active)

  def restored(self, summary: dict[str, Any]) -> None:
    """Where the attempt after the open event restored from."""
    event = self._open
    if event is None or "restore" in event:
      return
    step = summary.get("step")
    event["restore"] = {k: summary.get(k) for k in ("source", "step", "why", "notes")}
    event["restore"]["seconds"] = (summary.get("ended", time.time())
                                   - summary.get("started", event["time"]))
    last = event["last_step"]
    event["steps_lost"] = last - step if last is not None and step is not None else None

  def stepped(self, step: int) -> None:
    """A step trained and saved: the first after an event closes it."""
    self.last_step = step
    event = self._open
    if event is not None and "restore" in event:
      event["first_new_step"] = step
      event["event_to_first_new_step_s"] = time.time() - event["time"]
      self._open = None
