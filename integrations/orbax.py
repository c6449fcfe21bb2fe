"""The Orbax persistent tier, for code that looks for it under integrations.

``OrbaxTier(path_or_checkpoint_manager)`` is what ``SnapshotManager(...,
persistent=...)`` builds from a path (local or ``gs://``) or an
``orbax.checkpoint.CheckpointManager``.
"""

from snapstore._persistent import OrbaxTier as OrbaxTier

__all__ = ["OrbaxTier"]
