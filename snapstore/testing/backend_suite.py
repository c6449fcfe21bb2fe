"""The conformance suite every snapshot backend passes, shipped for new ones.

In zarr's ``StoreTests`` manner (which takes ``store_cls``): a backend's test
module subclasses :class:`BackendSuite`, declares its store value (the
``SnapshotOptions.store`` that builds the backend) and supplies its
backdoor, and pytest runs every test here on it::

    from snapstore import HostFiles
    from snapstore.testing.backend_suite import BackendSuite

    class TestMyStore(BackendSuite):
      slices = True                  # a single controller, 2 failure domains of 4

      def make_store(self, store_dir, *, budget_bytes=None):
        return HostFiles(dir=store_dir, budget_bytes=budget_bytes)

      def flip(self, store, manifest, record, at, mask):
        ...  # XOR byte ``at`` of ``record``'s stored copy in ``store`` with ``mask``

A backend of one's own is a store value whose ``build`` returns it
(:class:`snapstore.StoreSpec`): ``tests/test_memory_backend.py``
runs the suite on an in-memory backend written in the tests by declaring
its store value. The suite reaches the backend a manager uses through
:class:`Recorded` (the store value it hands the manager wraps the declared
one), never through the manager's private fields.

Two tiers:

- **protocol** (``test_protocol_*``): the :class:`~snapstore.Backend`
  alone: capture, then drain, commits a manifest in every live store; a
  fetch returns verified bytes of the caller's own; a corrupted copy raises
  ``BadCopy`` on fetch and on check; a forgotten domain is never written.
- **manager**: :class:`snapstore.SnapshotManager` on it: bitwise round trips
  of awkward leaves, retention and budgets, busy policies, a flipped byte in
  a small, a big and a run's piece, fencing, abandoned branches, replica
  intervals and their retention.

Needs pytest and 8 JAX devices (``--xla_force_host_platform_device_count=8``
on CPU); ``slices`` sees them as 2 failure domains (slices) of 4.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import threading
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from .. import (
  BudgetExceededError,
  BusyPolicy,
  SnapshotManager,
  SnapshotOptions,
  Source,
  StepNotFoundError,
  _backends,
  _planner,
)
from .._assemble import BadCopy
from .._backends import Backend
from .._index import to_slices
from .._jax_compat import single_device_sharding
from .._manifest import Manifest, PieceRecord
from .._tree import flatten, tree_digest
from .checks import assert_bitwise_equal, host_copy

__all__ = ["BackendSuite", "Recorded", "abstract", "awkward_state", "backend_of",
           "save_steps"]


class Recorded:
  """The suite's testing hook: a store value that has ``store`` build the
  backend and keeps it (:attr:`backend`), so a test reaches the backend its
  manager uses as ``mgr.options.store.backend`` (:func:`backend_of`). What
  it hands the manager is a thin proxy of that backend (the backend as
  built: :attr:`built`), which also lets a
  test hold each drain until :attr:`drain_gate` is set and counts the
  pieces of each run fetched (:attr:`runs_fetched`): fault injection by
  the injected store, not by patching snapstore."""

  def __init__(self, store: Any):
    self.store = store
    self.backend: Any = None
    self.built: Any = None
    self.drain_gate: threading.Event | None = None
    self.runs_fetched: list[int] = []

  def build(self, options: SnapshotOptions, **kw: Any) -> Backend[Any]:
    self.built = _backends.build(self.store, options, **kw)
    self.backend = _Watched(self.built, self)
    return self.backend


class _Watched:
  """A backend as built, with :class:`Recorded`'s gate and count around
  ``drain`` and ``fetch_run``; every other attribute is the backend's."""

  def __init__(self, inner: Any, hook: Recorded):
    self._inner, self._hook = inner, hook

  def __getattr__(self, name: str) -> Any:
    return getattr(self._inner, name)

  def drain(self, pending: Any) -> int:
    if self._hook.drain_gate is not None:
      self._hook.drain_gate.wait(60)
    return self._inner.drain(pending)

  def fetch_run(self, plan: Any, copies: Sequence[Any], out: Any) -> list[Any]:
    self._hook.runs_fetched.append(len(copies))
    return self._inner.fetch_run(plan, copies, out)


def backend_of(mgr: SnapshotManager) -> Any:
  """The backend of a manager built by :meth:`BackendSuite.manager`."""
  store = mgr.options.store
  if not isinstance(store, Recorded) or store.backend is None:
    raise TypeError("backend_of() takes a manager made by BackendSuite.manager()")
  return store.backend


def _stores(mgr: SnapshotManager) -> dict[int, Any]:
  """The backend's stores by id (every backend here keeps a ``stores`` dict)."""
  return backend_of(mgr).stores


def awkward_state(devices, step):
  """Sharded without a twin across domains, DP-replicated, 0-d, bool, int8,
  bf16, uint16 on one device, a typed key, numpy leaves and Python scalars."""
  n = len(devices) // 4
  mesh = jax.sharding.Mesh(np.array(devices).reshape(n, 4), ("replica", "model"))
  put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
  return {
      "tp": put(jnp.arange(8 * 16, dtype=jnp.float32).reshape(8, 16) + step,
                P("replica", "model")),
      "dp": put(jnp.ones((4, 8), jnp.bfloat16) * step, P(None, "model")),
      "flags": put(jnp.arange(8) % (step + 2) == 0, P("model")),
      "small": put(jnp.arange(15, dtype=jnp.int8).reshape(3, 5) - step, P()),
      "zero_d": put(jnp.float32(step) / 3, P()),
      "single": jax.device_put(jnp.arange(5, dtype=jnp.uint16) * step,
                               single_device_sharding(devices[-1])),
      "key": jax.device_put(jax.random.key(step), single_device_sharding(devices[0])),
      "np": np.arange(6, dtype=np.int64).reshape(2, 3) * step,
      "np_scalar": np.float64(step + 0.25),
      "py": {"i": step, "f": 1 / 3, "s": f"step {step}", "b": True, "none": None},
  }


def abstract(state):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                      if isinstance(x, jax.Array) else x, state)


def save_steps(mgr, steps, devices=None):
  refs = {}
  for s in steps:
    state = awkward_state(devices or jax.devices(), s)
    assert mgr.save(s, state, extra={"data": [s, "it"]})
    refs[s] = host_copy(state)
  mgr.wait_until_finished()
  return refs


class BackendSuite:
  """Subclass per backend: implement :meth:`make_store` (the store value
  under test) and :meth:`flip` (the backdoor: flip bits of one stored
  copy), and set :attr:`slices`."""

  #: a single controller holding one store per failure domain (2 of 4 devices)
  slices: bool = False

  def flip(self, store: Any, manifest: Manifest, record: PieceRecord, at: int,
           mask: int) -> None:
    """XORs byte ``at`` of ``record``'s copy in ``store`` (a backend's store
    object; ``manifest`` is that store's manifest of the step) with ``mask``."""
    raise NotImplementedError("a backend's suite supplies its backdoor: flip()")

  def make_store(self, store_dir: Path, *, budget_bytes: int | None = None) -> Any:
    """The store value under test (what ``SnapshotOptions.store`` takes).

    Args:
      store_dir: a fresh directory for this test (a store kept elsewhere,
        e.g. in memory, ignores it).
      budget_bytes: the store's byte budget (None: none), for the budget tests.
    """
    raise NotImplementedError("a backend's suite declares its store value: make_store()")

  # ------------------------------------------------------------ fixtures
  @pytest.fixture
  def store_dir(self) -> Iterator[Path]:
    """A fresh store directory on the RAM disk (else /tmp)."""
    base = Path("/dev/shm") if os.path.isdir("/dev/shm") else Path("/tmp")
    d = base / f"snapstore-suite-{uuid.uuid4().hex[:8]}"
    yield d
    shutil.rmtree(d, ignore_errors=True)

  def manager(self, store_dir: Path, *, budget_bytes: int | None = None,
              **kw: Any) -> SnapshotManager:
    """A manager on :meth:`make_store`'s store (through :class:`Recorded`),
    with ``kw`` as further :class:`SnapshotOptions`."""
    kw.setdefault("run_id", "conformance")
    devs = jax.devices()
    store = Recorded(self.make_store(store_dir, budget_bytes=budget_bytes))
    slices = {0: devs[:4], 1: devs[4:]} if self.slices else None
    return SnapshotManager(SnapshotOptions(store=store, **kw), slices=slices)

  def need_slices(self) -> None:
    if not self.slices:
      pytest.skip("needs failure domains held by one controller (slices = True)")

  def flip_byte(self, mgr: SnapshotManager, store_id: int, step: int, leaf: str) -> None:
    """Flips a byte in the middle of store ``store_id``'s own copy of the
    first piece of ``leaf`` at ``step``."""
    store = _stores(mgr)[store_id]
    (m,) = [m for m in store.manifests() if m.step == step]
    names = {i: s.path for i, s in enumerate(m.leaves)}
    p = next(p for p in m.pieces if names[p.leaf] == leaf and p.owner == store_id)
    self.flip(store, m, p, p.nbytes // 2, 0x10)

  # ------------------------------------------------------------ protocol
  @staticmethod
  def _drain(mgr: SnapshotManager, step: int, state: Any, replicas: int = 1) -> int:
    """One snapshot through the Backend protocol alone: capture, then drain."""
    backend = backend_of(mgr)
    specs, leaves, _ = flatten(state)
    header = _backends.Header.for_snapshot(
        mgr.options, incarnation=mgr.incarnation, step=step,
        num_hosts=max(jax.process_count(), len(backend.store_ids())), specs=specs, extra=None)
    return backend.drain(backend.capture(header, specs, leaves, replicas=replicas))

  @staticmethod
  def _plain_state(devices: list[jax.Device], step: int) -> dict[str, Any]:
    mesh = jax.sharding.Mesh(np.array(devices).reshape(len(devices) // 4, 4),
                             ("replica", "model"))
    return {"tp": jax.device_put(jnp.arange(8 * 16, dtype=jnp.float32).reshape(8, 16) + step,
                                 NamedSharding(mesh, P("replica", "model"))),
            "dp": jax.device_put(jnp.arange(4 * 8, dtype=jnp.int32).reshape(4, 8) * step,
                                 NamedSharding(mesh, P(None, "model")))}

  def test_protocol_capture_then_drain_commits_a_manifest_in_every_live_store(
      self, store_dir):
    with self.manager(store_dir) as mgr:
      state = self._plain_state(jax.devices(), 1)
      stored = self._drain(mgr, 1, state)
      backend = backend_of(mgr)
      ms = backend.manifests()
      assert sorted(m.store for m in ms) == backend.store_ids()
      specs, _, _ = flatten(state)
      for m in ms:
        assert (m.step, m.run_id, m.incarnation) == (1, "conformance", mgr.incarnation)
        assert m.leaves == tuple(specs) and m.tree_digest == tree_digest(specs)
      assert stored >= sum(p.nbytes for m in ms for p in m.pieces) > 0
      plan = _planner.choose(ms)
      assert plan is not None and plan.step == 1

  def test_protocol_fetch_returns_verified_bytes_of_the_callers_own(self, store_dir):
    with self.manager(store_dir) as mgr:
      state = self._plain_state(jax.devices(), 3)
      want = host_copy(state)
      self._drain(mgr, 3, state)
      backend = backend_of(mgr)
      plan = _planner.choose(backend.manifests())
      assert plan is not None
      for (leaf, index), copies in plan.copies.items():
        path = plan.specs[leaf].path
        for copy in copies:
          if not backend.holds(copy.store):
            continue
          got = np.array(backend.fetch(plan, copy, None))
          np.testing.assert_array_equal(got, want[path][to_slices(index)])
          mine = np.asarray(backend.fetch(plan, copy, None))
          assert mine.flags.writeable, "a host fetch is the caller's own memory"
          mine[...] = 0  # changing it changes no stored copy
          np.testing.assert_array_equal(np.asarray(backend.fetch(plan, copy, None)), got)

  def test_protocol_a_corrupted_copy_raises_on_fetch_and_check(self, store_dir):
    with self.manager(store_dir) as mgr:
      self._drain(mgr, 2, self._plain_state(jax.devices(), 2))
      backend = backend_of(mgr)
      store_id = backend.store_ids()[0]
      store = _stores(mgr)[store_id]
      (m,) = store.manifests()
      tp = next(i for i, s in enumerate(m.leaves) if s.path == "tp")
      rec = next(p for p in m.pieces if p.leaf == tp and p.owner == store_id)
      plan = _planner.choose(backend.manifests())
      assert plan is not None
      (copy,) = [c for c in plan.copies[(tp, rec.index)]
                 if c.store == store_id and c.record.index == rec.index]
      backend.fetch(plan, copy, None)  # (whole)
      self.flip(store, m, rec, rec.nbytes // 2, 0x10)
      with pytest.raises(BadCopy):
        backend.fetch(plan, copy, None)
      with pytest.raises(BadCopy):
        backend.check(plan, copy)

  def test_protocol_a_forgotten_domain_is_never_written(self, store_dir):
    self.need_slices()
    devs = jax.devices()
    with self.manager(store_dir) as mgr:
      backend = backend_of(mgr)
      self._drain(mgr, 1, self._plain_state(devs, 1))
      backend.forget_domains([1], "slice lost")
      assert [m for m in backend.manifests() if m.store == 1] == []
      self._drain(mgr, 2, self._plain_state(devs[:4], 2))
      assert {m.store for m in backend.manifests()} == {0}
      backend.set_active_domains([0, 1])
      self._drain(mgr, 3, self._plain_state(devs, 3))
      assert sorted(m.store for m in backend.manifests() if m.step == 3) == [0, 1]

  # ------------------------------------------------------------- manager
  def test_round_trip_is_bitwise_for_awkward_leaves(self, store_dir):
    with self.manager(store_dir) as mgr:
      refs = save_steps(mgr, [1, 2])
      target = abstract(awkward_state(jax.devices(), 0))
      newest = mgr.restore(target)
      older = mgr.restore(target, step=1)
    assert (newest.step, newest.source, newest.extra) == (2, Source.SNAPSHOT, {"data": [2, "it"]})
    assert_bitwise_equal(refs[2], newest.state)
    assert older.step == 1
    assert_bitwise_equal(refs[1], older.state)
    assert newest.state["tp"].sharding == target["tp"].sharding

  def test_the_extra_restored_is_what_was_saved_not_the_callers_object(self, store_dir):
    meta = {"data": [1, "it"]}
    with self.manager(store_dir) as mgr:
      mgr.save(1, awkward_state(jax.devices(), 1), extra=meta)
      mgr.wait_until_finished()
      meta["data"].append("changed after save")
      got = mgr.restore(abstract(awkward_state(jax.devices(), 0)))
      got.extra["data"].append("changed by the caller")
      again = mgr.restore(abstract(awkward_state(jax.devices(), 0)))
    assert got.extra is not meta and again.extra == {"data": [1, "it"]}

  def test_keep_holds_the_newest_and_a_too_small_budget_stores_nothing(self, store_dir):
    with self.manager(store_dir, keep=2) as mgr:
      save_steps(mgr, range(1, 6))
      # the newest two and the job's watermark: step 3, agreed as held by
      # every store at step 4's capture, read at step 5's
      assert mgr.snapshot_steps() == [3, 4, 5]
      assert mgr.metrics.watermark == 3
      assert all(len(st.manifests()) <= 3 for st in _stores(mgr).values())
      with pytest.raises(StepNotFoundError):
        mgr.restore(abstract(awkward_state(jax.devices(), 0)), step=2)
    with self.manager(store_dir / "small", budget_bytes=64) as mgr:
      with pytest.raises(BudgetExceededError, match="raise budget_bytes"):
        mgr.save(1, awkward_state(jax.devices(), 1))
      assert mgr.snapshot_steps() == []

  @pytest.mark.parametrize("policy", [BusyPolicy.WAIT, BusyPolicy.SKIP])
  def test_busy_policy_waits_or_skips_and_counts(self, store_dir, policy):
    with self.manager(store_dir, busy_policy=policy) as mgr:
      gate = mgr.options.store.drain_gate = threading.Event()
      mgr.save(1, awkward_state(jax.devices(), 1))
      if policy is BusyPolicy.SKIP:
        assert not mgr.save(2, awkward_state(jax.devices(), 2))
        gate.set()
      else:
        second = awkward_state(jax.devices(), 2)  # built first: save(2) must find 1 busy
        threading.Timer(1.0, gate.set).start()
        assert mgr.save(2, second)
      mgr.wait_until_finished()
      m = mgr.metrics
      assert (m.skipped_busy, m.waited_busy) == ((1, 0) if policy is BusyPolicy.SKIP else (0, 1))
      assert mgr.snapshot_steps() == ([1] if policy is BusyPolicy.SKIP else [1, 2])
      assert mgr.save(3, awkward_state(jax.devices(), 3))  # not busy now: taken
      mgr.wait_until_finished()
      assert mgr.snapshot_steps()[-1] == 3

  def test_deleting_the_state_while_it_drains_keeps_the_snapshot(self, store_dir):
    """A caller may free the old state (``x.delete()``) as soon as ``save``
    returns: the snapshot keeps its bytes (a DLPack hold on a shard made
    XLA abort the process instead)."""
    with self.manager(store_dir) as mgr:
      gate = mgr.options.store.drain_gate = threading.Event()
      state = awkward_state(jax.devices(), 1)
      ref = host_copy(state)
      mgr.save(1, state)
      for x in jax.tree.leaves(state):
        if isinstance(x, jax.Array):
          x.delete()
      gate.set()
      mgr.wait_until_finished()
      assert_bitwise_equal(ref, mgr.restore(abstract(awkward_state(jax.devices(), 0))).state)

  def test_flipped_byte_uses_the_other_copy_or_an_older_step(self, store_dir):
    with self.manager(store_dir) as mgr:
      refs = save_steps(mgr, [1, 2])
      self.flip_byte(mgr, 0, 2, "tp")
      r = mgr.restore(abstract(awkward_state(jax.devices(), 0)))
    # With two domains the replica in the other domain is used; alone, step 1.
    want = 2 if self.slices else 1
    assert r.step == want
    assert_bitwise_equal(refs[want], r.state)
    assert any("step 2" in n and "tp" in n for n in r.notes), r.notes

  def test_a_flipped_byte_in_a_big_piece_is_caught(self, store_dir):
    """Pieces of 512 KiB in 2 chunks, copied and checked on the pool (small
    ones go on the calling thread, see ``_checksum.SMALL_BYTES``; the test
    above flips one of those), beside small ones, at save and at restore."""
    leaf = "big"
    def state(step):
      out = awkward_state(jax.devices(), step)
      mesh = out["tp"].sharding.mesh
      out["big"] = jax.device_put(jnp.arange(64 * 8192, dtype=jnp.float32).reshape(64, 8192)
                                  * step, NamedSharding(mesh, P(None, "model")))
      return out
    with self.manager(store_dir, chunk_bytes=256 << 10) as mgr:
      refs = {}
      for s in (1, 2):
        refs[s] = host_copy(state(s))
        mgr.save(s, state(s))
      mgr.wait_until_finished()
      assert_bitwise_equal(refs[2], mgr.restore(abstract(state(0))).state)
      self.flip_byte(mgr, 0, 2, leaf)
      r = mgr.restore(abstract(state(0)))
    want = 2 if self.slices else 1
    assert r.step == want
    assert_bitwise_equal(refs[want], r.state)
    assert any("step 2" in n and leaf in n for n in r.notes), r.notes

  def test_a_flipped_byte_in_the_middle_of_a_run_is_caught(self, store_dir):
    """Many small leaves lie back to back in a slot and are fetched as runs
    (one copy, then each piece's crc32c): a flipped byte in one piece in the
    middle of a run rejects that piece alone; the others of its run are still
    taken from it, and the restore is bitwise."""
    def state(step):
      out = awkward_state(jax.devices(), step)
      mesh = out["tp"].sharding.mesh
      for i in range(12):
        out[f"m{i:02d}"] = jax.device_put(
            jnp.arange(32 * 64, dtype=jnp.float32).reshape(32, 64) * step + i,
            NamedSharding(mesh, P(None, "model")))
      return out
    with self.manager(store_dir) as mgr:
      refs = {}
      for s in (1, 2):
        refs[s] = host_copy(state(s))
        mgr.save(s, state(s))
      mgr.wait_until_finished()
      self.flip_byte(mgr, 0, 2, "m05")
      r = mgr.restore(abstract(state(0)))
    want = 2 if self.slices else 1
    assert r.step == want
    assert_bitwise_equal(refs[want], r.state)
    assert any("step 2" in n and "m05" in n for n in r.notes), r.notes
    runs = mgr.options.store.runs_fetched
    if backend_of(mgr).runs:  # host files: pieces went in runs of several
      assert max(runs) > 4, runs
    else:
      assert not runs

  def test_restore_timings_name_the_parts_of_its_read(self, store_dir):
    with self.manager(store_dir) as mgr:
      save_steps(mgr, [1])
      t = mgr.restore(abstract(awkward_state(jax.devices(), 0))).timings
    assert {"scan", "plan", "read", "read_verify", "read_place", "total"} <= set(t), t
    assert 0 < t["read_verify"] + t["read_place"] <= t["read"] <= t["total"], t

  def test_both_copies_bad_falls_back_to_an_older_step(self, store_dir):
    self.need_slices()
    with self.manager(store_dir) as mgr:
      refs = save_steps(mgr, [1, 2])
      m = next(m for m in _stores(mgr)[0].manifests() if m.step == 2)
      tp = next(i for i, s in enumerate(m.leaves) if s.path == "tp")
      index = next(p.index for p in m.pieces if p.leaf == tp and p.owner == 0)
      self.flip_byte(mgr, 0, 2, "tp")
      # the same piece's replica in domain 1
      store1 = _stores(mgr)[1]
      m1 = next(m for m in store1.manifests() if m.step == 2)
      rec = next(p for p in m1.pieces if p.leaf == tp and p.index == index)
      self.flip(store1, m1, rec, 1, 0x01)
      r = mgr.restore(abstract(awkward_state(jax.devices(), 0)))
    assert r.step == 1
    assert_bitwise_equal(refs[1], r.state)

  def test_a_forgotten_domain_is_not_written_to(self, store_dir):
    self.need_slices()
    devs = jax.devices()
    with self.manager(store_dir) as mgr:
      save_steps(mgr, [1])
      mgr.forget_domains([1], "slice lost")
      assert _stores(mgr)[1].manifests() == []
      with pytest.raises(ValueError, match="no slice that is up"):
        mgr.save(2, awkward_state(devs, 2))  # leaves on slice 1's devices
      refs = save_steps(mgr, [3], devices=devs[:4])
      assert _stores(mgr)[1].manifests() == []
      r = mgr.restore(abstract(awkward_state(devs[:4], 0)))
      assert r.step == 3
      assert_bitwise_equal(refs[3], r.state)
      mgr.set_active_domains([0, 1])
      save_steps(mgr, [4])
      assert [m.step for m in _stores(mgr)[1].manifests()] == [4]

  def test_other_runs_and_older_incarnations_are_fenced(self, store_dir):
    with self.manager(store_dir, incarnation=5) as mgr:
      refs = save_steps(mgr, [1, 2])
      sid = backend_of(mgr).store_ids()[0]
      store = _stores(mgr)[sid]
      m2 = next(m for m in store.manifests() if m.step == 2)
      store.commit(dataclasses.replace(m2, run_id="another-run", step=8))
      store.commit(dataclasses.replace(m2, incarnation=4, step=9))
      r = mgr.restore(abstract(awkward_state(jax.devices(), 0)))
    assert r.step == 2
    assert_bitwise_equal(refs[2], r.state)

  def test_restoring_an_older_step_abandons_the_newer_ones(self, store_dir):
    """restore(step=1), then save(2) with new data: a later restore returns the
    new step 2 or later, never the abandoned branch's step 3."""
    with self.manager(store_dir, keep=4) as mgr:
      save_steps(mgr, [1, 2, 3])
      r = mgr.restore(abstract(awkward_state(jax.devices(), 0)), step=1)
      assert r.step == 1
      new = awkward_state(jax.devices(), 7)  # different data at step 2
      mgr.save(2, new)
      mgr.wait_until_finished()
      again = mgr.restore(abstract(awkward_state(jax.devices(), 0)))
    assert again.step == 2
    assert_bitwise_equal(host_copy(new), again.state)

  def test_replicas_every_other_snapshot_rewind_to_the_last_that_had_them(self, store_dir):
    """replica_interval=2: replicas travel with the even steps' snapshots
    (decided from the step, so every process, a replacement too, agrees);
    step 3's snapshot kept no cross-domain copies, so losing domain 1 restores
    step 2, the newest whose every piece survives."""
    self.need_slices()
    devs = jax.devices()
    with self.manager(store_dir, replica_interval=2, keep=3) as mgr:
      refs = save_steps(mgr, [2, 3])
      held = {m.step: len(m.pieces) for m in _stores(mgr)[0].manifests()}
      assert held[2] > held[3]  # step 2 carries domain 1's pieces too
      mgr.forget_domains([1], "slice lost")
      r = mgr.restore(abstract(awkward_state(devs[:4], 0)))
    assert (r.step, r.rewind_steps) == (2, 1)
    assert_bitwise_equal(refs[2], r.state)

  def test_retention_keeps_the_snapshot_with_replicas_before_the_newest(self, store_dir):
    """replica_interval=2, keep=2: after step 4 the store keeps steps 4 and 2
    (both carry replicas) and lets step 3 (none) go, so when step 4's
    replicas are lost (a peer died during their transfer while this store's
    copy committed) step 2 still restores; keeping 3 and 4 would leave no
    step whose every piece survives."""
    self.need_slices()
    devs = jax.devices()
    with self.manager(store_dir, replica_interval=2, keep=2) as mgr:
      refs = save_steps(mgr, [2, 3, 4])
      store = _stores(mgr)[0]
      assert sorted(m.step for m in store.manifests()) == [2, 4]
      four = next(m for m in store.manifests() if m.step == 4)
      store.delete(four, "test: its replicas never arrived")
      mgr.forget_domains([1], "slice lost")
      r = mgr.restore(abstract(awkward_state(devs[:4], 0)))
    assert r.step == 2
    assert_bitwise_equal(refs[2], r.state)
