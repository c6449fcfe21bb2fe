"""snapstore: per-step in-RAM snapshots of JAX train state, beside Orbax."""

from . import errors as errors
from ._manager import SnapshotManager as SnapshotManager
from ._persistent import OrbaxTier as OrbaxTier
from .errors import (
    BudgetExceededError as BudgetExceededError,
    CorruptSnapshotError as CorruptSnapshotError,
    DeletedLeafError as DeletedLeafError,
    DrainFailedError as DrainFailedError,
    NothingToRestoreError as NothingToRestoreError,
    SnapshotInProgressError as SnapshotInProgressError,
    SnapstoreError as SnapstoreError,
    StepNotFoundError as StepNotFoundError,
    StepOrderError as StepOrderError,
    StoreError as StoreError,
    TreeMismatchError as TreeMismatchError,
    UnsafeStoreError as UnsafeStoreError,
    UnsupportedLeafError as UnsupportedLeafError,
)
from .metrics import (
    RestoreResult as RestoreResult,
    SaveMetrics as SaveMetrics,
    Source as Source,
)
from .options import (
    BusyPolicy as BusyPolicy,
    FailurePolicy as FailurePolicy,
    SnapshotOptions as SnapshotOptions,
    StoreKind as StoreKind,
)

__version__ = "0.9.0"

__all__ = [
    "BudgetExceededError", "BusyPolicy", "CorruptSnapshotError", "DeletedLeafError",
    "DrainFailedError", "FailurePolicy",
    "NothingToRestoreError", "OrbaxTier", "RestoreResult", "SaveMetrics",
    "SnapshotInProgressError", "SnapshotManager", "SnapshotOptions",
    "SnapstoreError", "Source", "StepNotFoundError", "StepOrderError", "StoreError", "StoreKind",
    "TreeMismatchError",
    "UnsafeStoreError", "UnsupportedLeafError",
    "errors",
]
