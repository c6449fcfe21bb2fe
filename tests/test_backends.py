"""The backend conformance suite (:mod:`snapstore.testing.backend_suite`) on
each backend: a class per backend supplies its backdoor (how to flip a byte
of a stored copy), and pytest runs the whole suite on it. Tests that only a
host-files store can take (its files, its accelerator path) are here too.
8 CPU devices; the classes with ``slices`` see them as 2 failure domains of 4.
"""

from __future__ import annotations

import ctypes
from typing import Any

import jax

from snapstore import HostFiles, PinnedHost, Staging
from snapstore._manifest import Manifest, PieceRecord
from snapstore.testing.backend_suite import (
    BackendSuite,
    abstract,
    awkward_state,
    backend_of,
    save_steps,
)
from tests.helpers import assert_bitwise_equal, host_copy


class HostFilesSuite(BackendSuite):
  """Host files: a store's slots are files on the RAM disk."""

  def make_store(self, store_dir, *, budget_bytes=None):
    return HostFiles(dir=store_dir, budget_bytes=budget_bytes)

  def flip(self, store: Any, manifest: Manifest, record: PieceRecord, at: int,
           mask: int) -> None:
    with open(store.root / f"slot-{manifest.slot}.bin", "r+b") as f:
      f.seek(record.offset + at)
      b = f.read(1)
      f.seek(record.offset + at)
      f.write(bytes([b[0] ^ mask]))

  def test_the_staged_path_saves_every_awkward_leaf_bitwise(self, store_dir):
    """``Staging.ALWAYS``: the accelerator path (shards staged and cut into
    pieces, several a chunk) on CPU devices."""
    state = awkward_state(jax.devices(), 1)
    with self.manager(store_dir, staging=Staging.ALWAYS, chunk_bytes=8192,
                      staging_piece_bytes=4096) as mgr:
      mgr.save(1, state)
      assert mgr.metrics.staged_bytes > 0
      mgr.wait_until_finished()
      got = mgr.restore(abstract(awkward_state(jax.devices(), 0)))
    assert_bitwise_equal(host_copy(state), got.state)

  def test_the_pinned_host_path_puts_every_leaf_in_one_call(self, store_dir, monkeypatch):
    """Off CPU with ``Staging.NEVER``, host files read each leaf's
    ``pinned_host`` copy, all leaves dispatched in one ``device_put`` (CPU
    devices have ``pinned_host`` memory: the path runs here when told the
    devices are not CPUs)."""
    from snapstore._backends import staging
    monkeypatch.setattr(staging, "_on_cpu", lambda sharding: False)
    state = awkward_state(jax.devices(), 1)
    puts = []
    real_put = jax.device_put

    def put(x, *args, **kw):  # (jax.device_put itself: this test's only puts)
      puts.append(len(x) if isinstance(x, list) else 1)
      return real_put(x, *args, **kw)
    with self.manager(store_dir, staging=Staging.NEVER) as mgr:
      monkeypatch.setattr(jax, "device_put", put)
      mgr.save(1, state)
      mgr.wait_until_finished()
      monkeypatch.undo()
      assert puts == [sum(isinstance(x, jax.Array) for x in jax.tree.leaves(state))]
      got = mgr.restore(abstract(awkward_state(jax.devices(), 0)))
    assert_bitwise_equal(host_copy(state), got.state)

  def test_a_committed_manifest_is_what_its_file_decodes_to(self, store_dir):
    # A store keeps the manifest it commits instead of decoding its file again.
    with self.manager(store_dir) as mgr:
      save_steps(mgr, [1, 2])
      for store in backend_of(mgr).stores.values():
        kept = store.manifests()
        store._decoded.clear()
        assert [m.step for m in kept] == [1, 2]
        assert store.manifests() == kept


class TestHostFilesPerProcess(HostFilesSuite):
  slices = False


class TestHostFilesPerSlice(HostFilesSuite):
  slices = True

  def test_a_forgotten_domain_s_directory_stays_empty(self, store_dir):
    with self.manager(store_dir) as mgr:
      save_steps(mgr, [1])
      mgr.forget_domains([1], "slice lost")
      save_steps(mgr, [2], devices=jax.devices()[:4])
      assert list(backend_of(mgr).stores[1].root.iterdir()) == []  # not even progress


class TestPinnedHostPerSlice(BackendSuite):
  """Pinned host: each slice's snapshots are ``pinned_host`` jax.Arrays."""

  slices = True

  def make_store(self, store_dir, *, budget_bytes=None):
    return PinnedHost(budget_bytes=budget_bytes)

  def flip(self, store: Any, manifest: Manifest, record: PieceRecord, at: int,
           mask: int) -> None:
    arr = store.array(manifest.slot, record.offset)
    arr.block_until_ready()
    ctypes.c_uint8.from_address(arr.unsafe_buffer_pointer() + at).value ^= mask
