"""A manager's fencing state, decided: the incarnation it saves as, and the
steps it may save next (its lineage).

:class:`snapstore.SnapshotManager` holds that state and alone writes it (a
restore returns its part as :class:`snapstore._restore.Outcome`); the rules
it writes by are here. A newer incarnation fences an older one's steps
(:func:`snapstore._planner.fence`); within one lineage steps only grow.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from . import _reports, errors
from ._manifest import Manifest
from .options import MAX_INT, SnapshotOptions


def check_step(step: object, *, optional: bool = False) -> None:
  """Raises :class:`InvalidStepError` unless ``step`` is an int in
  [0, 2**48] (or, where ``optional``, None)."""
  if optional and step is None:
    return
  if type(step) is not int or not 0 <= step <= MAX_INT:
    raise errors.InvalidStepError(
        f"step must be an int in [0, 2**48]{' or None' if optional else ''}, got {step!r}")


def check_order(step: int, lineage_step: int | None, incarnation: int) -> None:
  """Raises :class:`StepOrderError` if ``step`` is older than the last step
  saved in this lineage (``lineage_step``): a restore would still pick the
  later one."""
  if lineage_step is not None and step < lineage_step:
    raise errors.StepOrderError(
        f"save of step {step} after step {lineage_step} (incarnation {incarnation}): a "
        "restore would still pick the later step. To go back, restore(step=...) first (a "
        "restore starts a new lineage); to start over, use a new run_id.")


def first_incarnation(options: SnapshotOptions, manifests: Sequence[Manifest],
                      progress_incarnation: int,
                      agree_max: Callable[[int], tuple[int, ...]], where: str) -> int:
  """The incarnation a new manager saves as: ``options.incarnation``, else
  ``$SNAPSTORE_INCARNATION`` (``snapstore launch``), else one above every
  incarnation the stores name, the maximum over the job's hosts (a
  replaced host starts empty; ``agree_max`` is collective). Raises
  :class:`StoreError` if that would pass 2**48 (``where``: the stores)."""
  incarnation = options.incarnation
  if incarnation is None:
    incarnation = _reports.incarnation_from_env()
  if incarnation is None:
    seen = [m.incarnation for m in manifests] + [progress_incarnation]
    (incarnation,) = agree_max(max(seen) + 1)
    if incarnation > MAX_INT:
      raise errors.StoreError(
          f"the stores name incarnation {incarnation - 1}, the most there can be; "
          f"inspect them ({where}) or pass incarnation=")
  return incarnation
