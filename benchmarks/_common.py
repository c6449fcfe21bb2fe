"""Shared benchmark plumbing: CPU device setup, memcpy baseline, JSON output."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np


def setup_cpu_devices(n: int = 8) -> None:
  import jax  # noqa: PLC0415
  jax.config.update("jax_platforms", "cpu")
  jax.config.update("jax_num_cpu_devices", n)


def median_seconds(fn: Callable[[], Any], repeats: int) -> float:
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t)
  return statistics.median(times)


def memcpy_bandwidth(nbytes: int, repeats: int = 5) -> float:
  """Single-thread np.copyto bandwidth (bytes/s) into a touched, reused buffer."""
  src = np.ones(nbytes, np.uint8)
  dst = np.zeros(nbytes, np.uint8)
  np.copyto(dst, src)
  return nbytes / median_seconds(lambda: np.copyto(dst, src), repeats)


def ram_dir(prefix: str) -> Path:
  base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
  return Path(tempfile.mkdtemp(prefix=prefix, dir=base))


def emit(name: str, result: dict[str, Any], out: str | None) -> None:
  text = json.dumps({"benchmark": name, **result}, indent=2)
  print(text)
  if out:
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(text)


def cleanup(path: Path) -> None:
  shutil.rmtree(path, ignore_errors=True)
