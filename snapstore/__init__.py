"""snapstore: per-step in-RAM snapshots of JAX train state, beside Orbax."""

from . import errors as errors, stores as stores
from ._backends import Backend as Backend, StoreSpec as StoreSpec
from ._manager import SnapshotManager as SnapshotManager
from ._persistent import OrbaxTier as OrbaxTier
from .errors import (
    BudgetExceededError as BudgetExceededError,
    ClosedError as ClosedError,
    CorruptSnapshotError as CorruptSnapshotError,
    DeletedLeafError as DeletedLeafError,
    DrainFailedError as DrainFailedError,
    InvalidOptionError as InvalidOptionError,
    InvalidStepError as InvalidStepError,
    NothingToRestoreError as NothingToRestoreError,
    SnapstoreError as SnapstoreError,
    StepNotFoundError as StepNotFoundError,
    StepOrderError as StepOrderError,
    StoreError as StoreError,
    TreeMismatchError as TreeMismatchError,
    UnsafeStoreError as UnsafeStoreError,
    UnsupportedExtraError as UnsupportedExtraError,
    UnsupportedLeafError as UnsupportedLeafError,
)
from .metrics import (
    RestoreResult as RestoreResult,
    SaveMetrics as SaveMetrics,
    Source as Source,
)
from .options import (
    AutoInterval as AutoInterval,
    BusyPolicy as BusyPolicy,
    Every as Every,
    FailurePolicy as FailurePolicy,
    Parity as Parity,
    Replicas as Replicas,
    SnapshotOptions as SnapshotOptions,
    Staging as Staging,
)
from .stores import (
    Auto as Auto,
    HostFiles as HostFiles,
    PinnedChecksum as PinnedChecksum,
    PinnedHost as PinnedHost,
    PinnedMemory as PinnedMemory,
)

__version__ = "0.9.0"

__all__ = [
    "Auto", "AutoInterval", "Backend", "BudgetExceededError", "BusyPolicy", "ClosedError",
    "CorruptSnapshotError", "DeletedLeafError", "DrainFailedError", "Every", "FailurePolicy",
    "HostFiles", "InvalidOptionError", "InvalidStepError", "NothingToRestoreError", "OrbaxTier",
    "Parity", "PinnedChecksum", "PinnedHost", "PinnedMemory", "Replicas", "RestoreResult",
    "SaveMetrics", "SnapshotManager", "SnapshotOptions", "SnapstoreError", "Source", "Staging",
    "StepNotFoundError", "StepOrderError", "StoreError", "StoreSpec", "TreeMismatchError",
    "UnsafeStoreError", "UnsupportedExtraError", "UnsupportedLeafError", "errors", "stores",
]
