"""The conformance suite on a backend written outside the engine
(:mod:`tests.memory_backend`): the module declares the backend's store value
and its backdoor, nothing else, and every test of the suite runs on it."""

from __future__ import annotations

from typing import Any

from snapstore._manifest import Manifest, PieceRecord
from snapstore.testing.backend_suite import BackendSuite, backend_of, save_steps
from tests.memory_backend import InMemory, MemoryBackend


class MemorySuite(BackendSuite):
  def make_store(self, store_dir, *, budget_bytes=None):
    return InMemory(budget_bytes=budget_bytes)

  def flip(self, store: Any, manifest: Manifest, record: PieceRecord, at: int,
           mask: int) -> None:
    store.slots[manifest.slot][record.offset + at] ^= mask

  def test_the_manager_is_built_on_the_memory_backend(self, store_dir):
    """The suite ran on this backend, built by its store value: the manager
    reports that value, and nothing reaches the store directory."""
    with self.manager(store_dir) as mgr:
      assert isinstance(mgr.options.store.built, MemoryBackend)
      assert mgr.store == InMemory()
      save_steps(mgr, [1])
      assert [(m.step, m.store) for m in backend_of(mgr).manifests()] == [
          (1, k) for k in backend_of(mgr).store_ids()]
    assert not store_dir.exists()


class TestMemoryOneStore(MemorySuite):
  slices = False


class TestMemoryPerSlice(MemorySuite):
  slices = True
