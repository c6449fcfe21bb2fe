"""The snapstore error family.

Every error derives from :class:`SnapstoreError`; most also derive from the
builtin a caller would naturally catch (``FileNotFoundError``, ``ValueError``,
``MemoryError``), so ``except FileNotFoundError`` keeps working. The
in-place recovery's errors (:mod:`snapstore.recovery`: ``RestartRequired``,
``PeerFailed``, ``MembersMissing``) are of the family too.
"""

from __future__ import annotations


class SnapstoreError(Exception):
  """Root of every error raised by snapstore."""


class NothingToRestoreError(SnapstoreError, FileNotFoundError):
  """No complete snapshot survives and the persistent tier has no committed step."""


class StepNotFoundError(SnapstoreError, FileNotFoundError):
  """A specific step was asked for and no source holds it complete."""


class TreeMismatchError(SnapstoreError, ValueError):
  """The abstract state given to restore does not match what was saved.

  Attributes:
    leaf: the key path of the first leaf that differs (``"params/w"``).
  """

  def __init__(self, message: str, *, leaf: str):
    super().__init__(message)
    self.leaf = leaf


class CorruptSnapshotError(SnapstoreError, ValueError):
  """A stored shard failed its checksum, or a manifest could not be parsed."""

  def __init__(self, message: str, *, step: int | None = None,
               leaf: str | None = None):
    super().__init__(message)
    self.step = step
    self.leaf = leaf


class BudgetExceededError(SnapstoreError, MemoryError):
  """The host store cannot hold the snapshots within its byte budget."""


class DrainFailedError(SnapstoreError, RuntimeError):
  """A snapshot failed in its background drain (copy, checksum or commit);
  the original error is its ``__cause__``. Nothing of that step was committed.

  Attributes:
    step: the step whose snapshot failed (None: not known).
  """

  def __init__(self, message: str, *, step: int | None = None):
    super().__init__(message)
    self.step = step


class UnsupportedLeafError(SnapstoreError, TypeError):
  """``save`` was given a leaf that a restore could not read back (a dtype
  outside the supported set, a scalar msgpack cannot carry). Names the leaf.

  Attributes:
    leaf: the key path of the leaf.
  """

  def __init__(self, message: str, *, leaf: str):
    super().__init__(message)
    self.leaf = leaf


class UnsupportedExtraError(SnapstoreError, TypeError, ValueError):
  """``save``'s ``extra`` that a manifest cannot carry: not unchanged through
  msgpack, or, with the state's strings, over what a manifest holds inline
  (:data:`snapstore._manifest.MAX_INLINE_BYTES`). Nothing was saved."""


class InvalidStepError(SnapstoreError, ValueError):
  """A ``step`` that is not an int in [0, 2**48] (``save``; ``restore``,
  where None is also allowed). Nothing was saved or restored."""


class InvalidOptionError(SnapstoreError, ValueError, TypeError):
  """An option value of the wrong type or out of range (``SnapshotOptions``,
  the store values, ``Every``, ``AutoInterval``, ``Replicas``, ``Parity``),
  raised where the value is made. Both a ValueError and a TypeError."""


class ClosedError(SnapstoreError, RuntimeError):
  """A :class:`snapstore.SnapshotManager` was used after its ``close``."""


class StepOrderError(SnapstoreError, ValueError):
  """``save`` was given a step older than one this manager saved since it
  was made or last restored: restore first (a restore starts a new
  lineage), or save under a new ``run_id``."""


class DeletedLeafError(SnapstoreError, RuntimeError):
  """``save`` was given an array whose buffer was deleted (donated to a
  jitted step, or ``.delete()``d). Nothing of that step was saved."""


class StoreError(SnapstoreError, OSError):
  """The snapshot store cannot be written (read-only, full, or refused).
  What it holds is untouched and still restorable."""


class UnsafeStoreError(StoreError):
  """The store or run directory is not safe to use: a symlink, not owned by
  this user, or writable by others. Nothing was read or changed."""


# In-place recovery (snapstore.recovery)

class RestartRequired(SnapstoreError, RuntimeError):
  """In-place recovery is not possible here; exit with
  :data:`snapstore.recovery.RESTART_EXIT_CODE` and let the supervisor restart the whole job."""


class PeerFailed(SnapstoreError, RuntimeError):
  """Another process's step failed; this one's is discarded too."""


class MembersMissing(SnapstoreError, RuntimeError):
  """Not every process of the job is live (a replacement is starting, or a
  host hangs: the supervisor fences it). ``processes``: the missing ones;
  ``since``: when they were last seen, if known (else when this process
  began to wait)."""

  def __init__(self, message: str, processes: tuple[int, ...] = (),
               since: float | None = None):
    super().__init__(message)
    self.processes, self.since = processes, since


# The local supervisor (snapstore.testing.launch)

class JobStalledError(SnapstoreError, TimeoutError):
  """Every process of a job was alive, but no host advanced a step for the
  watch period (:class:`snapstore.testing.StallPolicy`): the job was stopped
  after each process wrote its Python stacks into its log. ``phase``: where
  it stopped; ``logs``: each host's log; ``incarnation``: which run."""

  def __init__(self, message: str, *, phase: str, incarnation: int,
               logs: tuple[str, ...] = ()):
    super().__init__(message)
    self.phase, self.incarnation, self.logs = phase, incarnation, logs
