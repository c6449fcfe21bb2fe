"""Test setup: 8 virtual CPU devices, a RAM-disk store per test, the GCS emulator."""

import os
import shutil
import uuid
from pathlib import Path

# LLVM at -O0 for every XLA compile in the suite, here and in every process a
# test starts (they inherit the environment): the test states are tiny, so
# compiling dominates. JAX's persistent cache does not help the jobs'
# processes: only process 0 writes it, and each process's cache key differs.
# Every result a test compares is computed under the same flags.
os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_backend_optimization_level=0"]).strip()

import jax  # after XLA_FLAGS: read when the backend starts
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


@pytest.fixture(autouse=True)
def _spare_memory_of_this_test_only(monkeypatch):
  """Memory a test's managers let go of is reused by later managers in the
  process (``_arena.SPARE_SECONDS``): each test starts with none, so a
  test that counts fresh mappings counts its own."""
  from snapstore import _arena
  monkeypatch.setattr(_arena, "_spares", [])


@pytest.fixture(scope="module")
def trainer():
  """The demo's model (``snapstore.demo.example``), built once a module."""
  from snapstore.demo.example import ModelConfig, Trainer
  return Trainer(ModelConfig())
