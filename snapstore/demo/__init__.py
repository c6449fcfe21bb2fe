"""Example code, not library: the ``snapstore demo`` job (a small flax model on
4 local host processes), the worker it runs under ``snapstore launch``, the
local GCS emulator helper and the timeline plot.

Needs the ``[demo]`` extra (flax, optax, rich, matplotlib, gcsfs,
fake-gcs-server); the engine (``import snapstore``) does not.
"""
