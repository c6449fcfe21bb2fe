"""Test setup: 8 virtual CPU devices, a RAM-disk store per test, the GCS emulator."""

import os
import shutil
import uuid
from pathlib import Path

import jax
import pytest

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")


def pytest_addoption(parser):
  parser.addoption("--long", action="store_true", default=False,
                   help="long fuzz runs (thousands of cases)")


@pytest.fixture
def store_dir():
  """A fresh store directory on the RAM disk (falls back to /tmp)."""
  base = Path("/dev/shm") if os.path.isdir("/dev/shm") else Path("/tmp")
  d = base / f"snapstore-test-{uuid.uuid4().hex[:8]}"
  yield d
  shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session")
def gcs():
  from snapstore.demo.gcs_emulator import GcsEmulator
  with GcsEmulator(bucket="ckpt") as emu:
    yield emu
