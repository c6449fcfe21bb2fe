"""The conformance suite on a backend written outside the engine
(:mod:`tests.memory_backend`): the module supplies the backend and its
backdoor, nothing else, and every test of the suite runs on it."""

from __future__ import annotations

from typing import Any

from snapstore._manifest import Manifest, PieceRecord
from snapstore.testing.backend_suite import BackendSuite, save_steps
from tests.memory_backend import MemoryBackend


class MemorySuite(BackendSuite):
  def make_backend(self, options, *, slices, pool):
    return MemoryBackend(options, slices=slices, pool=pool)

  def flip(self, store: Any, manifest: Manifest, record: PieceRecord, at: int,
           mask: int) -> None:
    store.slots[manifest.slot][record.offset + at] ^= mask

  def test_the_manager_is_built_on_the_memory_backend(self, store_dir):
    """The suite ran on this backend, not the one ``store`` names: nothing
    reaches the store directory."""
    with self.manager(store_dir) as mgr:
      assert isinstance(mgr._backend, MemoryBackend)
      save_steps(mgr, [1])
      assert [(m.step, m.store) for m in mgr._backend.manifests()] == [
          (1, k) for k in mgr._backend.store_ids()]
    assert not store_dir.exists()


class TestMemoryOneStore(MemorySuite):
  slices = False


class TestMemoryPerSlice(MemorySuite):
  slices = True
