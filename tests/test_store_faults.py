"""Corruption, fencing, budget, mismatches and the Orbax fallback."""

import dataclasses
import logging
import shutil

import jax
import numpy as np
import pytest

import snapstore
from snapstore._manifest import decode, encode
from tests.helpers import assert_bitwise_equal, host_copy, only_store, opts


def train_and_save(trainer, mgr, steps):
  """Trains ``steps``, saving each; returns host copies per step."""
  state = trainer.init_state()
  refs = {}
  for s in steps:
    state, _ = trainer.step(state, s)
    mgr.save(s, state)
    refs[s] = host_copy(state)
  mgr.wait_until_finished()
  return refs


def manifest_file(store, step):
  """The manifest file of ``step`` (one incarnation wrote it)."""
  (path,) = store.root.glob(f"step-{step:010d}-inc*.manifest")
  return path


def flip_byte(store, step, nth_piece=3):
  m = decode(manifest_file(store, step).read_bytes())
  piece = m.pieces[nth_piece]
  path = store.root / f"slot-{m.slot}.bin"
  with open(path, "r+b") as f:
    f.seek(piece.offset + piece.nbytes // 2)
    b = f.read(1)
    f.seek(piece.offset + piece.nbytes // 2)
    f.write(bytes([b[0] ^ 0x40]))
  return m.leaves[piece.leaf].path


def test_flipped_byte_falls_back_to_older_snapshot(trainer, store_dir, caplog):
  with snapstore.SnapshotManager(opts(store_dir, keep=2)) as mgr:
    refs = train_and_save(trainer, mgr, range(1, 4))
    leaf = flip_byte(only_store(mgr), 3)
    with caplog.at_level(logging.WARNING, logger="snapstore"):
      result = mgr.restore(trainer.abstract_state())
  assert result.step == 2 and result.source is snapstore.Source.SNAPSHOT
  assert result.rewind_steps == 1
  assert any("step 3" in n and leaf in n for n in result.notes), result.notes
  assert leaf in caplog.text
  assert_bitwise_equal(refs[2], result.state)


def test_corrupt_snapshots_fall_back_to_orbax(trainer, store_dir, tmp_path):
  o = opts(store_dir, keep=2, persistent_interval=2)
  with snapstore.SnapshotManager(o, persistent=tmp_path / "ckpt") as mgr:
    refs = train_and_save(trainer, mgr, range(1, 6))
    for s in mgr.snapshot_steps():
      flip_byte(only_store(mgr), s)
    result = mgr.restore(trainer.abstract_state())
  assert result.source is snapstore.Source.PERSISTENT
  assert result.step == 4 and result.rewind_steps == 1
  assert result.bytes_read["persistent"] > 0
  assert_bitwise_equal(refs[4], result.state)


def test_truncated_and_foreign_manifests_are_ignored(trainer, store_dir, caplog):
  with snapstore.SnapshotManager(opts(store_dir, keep=3)) as mgr:
    refs = train_and_save(trainer, mgr, range(1, 4))
    path3 = manifest_file(only_store(mgr), 3)
    path3.write_bytes(path3.read_bytes()[:100])  # truncated
    m2 = decode(manifest_file(only_store(mgr), 2).read_bytes())
    foreign = dataclasses_replace(m2, run_id="another-run")
    manifest_file(only_store(mgr), 2).write_bytes(encode(foreign))
    with caplog.at_level(logging.WARNING, logger="snapstore"):
      result = mgr.restore(trainer.abstract_state())
  assert result.step == 1
  assert_bitwise_equal(refs[1], result.state)
  assert "not valid msgpack" in caplog.text or "malformed" in caplog.text
  assert "another-run" in caplog.text


def dataclasses_replace(m, **kw):
  import dataclasses
  return dataclasses.replace(m, **kw)


def test_store_of_another_run_is_not_restored(trainer, store_dir):
  with snapstore.SnapshotManager(opts(store_dir, run_id="a")) as mgr:
    train_and_save(trainer, mgr, [1])
  with snapstore.SnapshotManager(opts(store_dir, run_id="b")) as mgr:
    with pytest.raises(snapstore.NothingToRestoreError):
      mgr.restore(trainer.abstract_state())


def test_newer_incarnation_fences_stale_steps(trainer, store_dir):
  with snapstore.SnapshotManager(opts(store_dir, keep=5)) as mgr:
    train_and_save(trainer, mgr, range(1, 6))
    first = mgr.incarnation
  with snapstore.SnapshotManager(opts(store_dir, keep=5)) as mgr2:
    assert mgr2.incarnation == first + 1
    result = mgr2.restore(trainer.abstract_state(), step=3)
    state, _ = trainer.step(result.state, 4)
    mgr2.save(4, state)
    expected4 = host_copy(state)
    mgr2.wait_until_finished()
    # incarnation 1's step 5 is stale now: restore picks incarnation 2's step 4.
    latest = mgr2.restore(trainer.abstract_state())
  assert latest.step == 4
  assert_bitwise_equal(expected4, latest.state)


def test_files_are_private(trainer, store_dir):
  with snapstore.SnapshotManager(opts(store_dir)) as mgr:
    train_and_save(trainer, mgr, [1])
    root = only_store(mgr).root
  assert root.stat().st_mode & 0o777 == 0o700
  for p in root.iterdir():
    assert p.stat().st_mode & 0o777 == 0o600, p


def test_budget_for_two_snapshots_keeps_at_most_two(trainer, store_dir):
  state = trainer.init_state()
  with snapstore.SnapshotManager(opts(store_dir, keep=5)) as probe:
    probe.save(0, state)
    probe.wait_until_finished()
    size = max(p.stat().st_size for p in only_store(probe).root.glob("slot-*.bin"))
  shutil.rmtree(store_dir)
  o = opts(store_dir, keep=5, budget_bytes=2 * size + 100)
  with snapstore.SnapshotManager(o) as mgr:
    for s in range(1, 8):
      state, _ = trainer.step(state, s)
      mgr.save(s, state)
      mgr.wait_until_finished()
      files = list(only_store(mgr).root.glob("*.manifest"))
      slots = list(only_store(mgr).root.glob("slot-*.bin"))
      assert len(files) <= 2 and len(slots) <= 2
      assert sum(p.stat().st_size for p in slots) <= o.store.budget_bytes
    assert mgr.snapshot_steps()[-1] == 7


def test_one_state_too_big_for_the_budget_does_not_stop_later_snapshots(store_dir):
  """Step 3's state does not fit the budget (skipped, counted); the usual
  size fits again from step 4 on: the refused size is not kept as the slot
  size every later request is rounded up to."""
  def state(step, rows):
    return {"w": np.full((rows, 256), step, np.float32)}
  o = opts(store_dir, keep=1, budget_bytes=int(2.5 * 256 * 256 * 4))
  with snapstore.SnapshotManager(o) as mgr:
    took = []
    for step, rows in [(1, 256), (2, 256), (3, 384), (4, 256), (5, 256)]:
      took.append(mgr.save(step, state(step, rows)))
      mgr.wait_until_finished()
    assert took == [True, True, False, True, True]
    assert mgr.metrics.store_failures == 1 and "393216 bytes" in mgr.metrics.last_store_failure
    assert mgr.snapshot_steps() == [4, 5]
    r = mgr.restore(state(0, 256))
  assert r.step == 5
  assert_bitwise_equal(state(5, 256), r.state)


def test_a_store_directory_removed_between_saves_is_made_again(trainer, store_dir):
  """Something deletes the host's store directory (a RAM disk cleanup):
  a restore finds nothing there (a SnapstoreError, not an OSError of the
  scan), the next save makes it again and snapshots go on."""
  with snapstore.SnapshotManager(opts(store_dir, keep=1)) as mgr:
    train_and_save(trainer, mgr, [1, 2])
    shutil.rmtree(only_store(mgr).root)
    with pytest.raises(snapstore.NothingToRestoreError):
      mgr.restore(trainer.abstract_state())
    refs = train_and_save(trainer, mgr, [3, 4])
    assert mgr.metrics.store_failures == 0 and mgr.snapshot_steps() == [3, 4]
    r = mgr.restore(trainer.abstract_state())
  assert r.step == 4
  assert_bitwise_equal(refs[4], r.state)


def test_budget_smaller_than_two_snapshots_is_an_error_at_first_save(trainer, store_dir):
  state = trainer.init_state()
  with snapstore.SnapshotManager(opts(store_dir, budget_bytes=4096)) as mgr:
    with pytest.raises(snapstore.BudgetExceededError, match="raise budget_bytes"):
      mgr.save(0, state)
    assert isinstance(snapstore.BudgetExceededError("x"), MemoryError)


def test_renamed_leaf_and_wrong_shape_name_the_leaf(trainer, store_dir):
  state = trainer.init_state()
  with snapstore.SnapshotManager(opts(store_dir)) as mgr:
    mgr.save(1, state)
    renamed = trainer.abstract_state()
    renamed["rng_renamed"] = renamed.pop("rng")
    with pytest.raises(snapstore.TreeMismatchError) as e:
      mgr.restore(renamed)
    assert e.value.leaf in ("rng_renamed", "rng") and "rng" in str(e.value)
    wrong = trainer.abstract_state()
    wrong["params"]["head"]["kernel"] = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((x.shape[0] + 1, x.shape[1]), x.dtype,
                                       sharding=x.sharding),
        wrong["params"]["head"]["kernel"])
    with pytest.raises(snapstore.TreeMismatchError) as e:
      mgr.restore(wrong)
    assert e.value.leaf == "params/head/kernel/value"
    assert "params/head/kernel" in str(e.value)


def test_snapshots_deleted_restore_from_orbax_local(trainer, store_dir, tmp_path):
  _persistent_fallback(trainer, store_dir, str(tmp_path / "ckpt"))


def test_snapshots_deleted_restore_from_orbax_on_gcs_emulator(trainer, store_dir, gcs):
  _persistent_fallback(trainer, store_dir, gcs.url("fallback"))
  assert any(name.startswith("fallback/") for name in gcs.list_objects())


def _persistent_fallback(trainer, store_dir, path):
  o = opts(store_dir, keep=2, persistent_interval=5)
  with snapstore.SnapshotManager(o, persistent=path) as mgr:
    refs = train_and_save(trainer, mgr, range(1, 8))
    for p in only_store(mgr).root.glob("*.manifest"):
      p.unlink()
    result = mgr.restore(trainer.abstract_state())
  assert result.source is snapstore.Source.PERSISTENT
  assert result.step == 5 and result.rewind_steps == 2
  assert_bitwise_equal(refs[5], result.state)


def test_missing_persistent_step_is_a_clear_error(trainer, store_dir, tmp_path):
  o = opts(store_dir, persistent_interval=5)
  with snapstore.SnapshotManager(o, persistent=tmp_path / "ckpt") as mgr:
    train_and_save(trainer, mgr, range(1, 3))
    with pytest.raises(snapstore.StepNotFoundError, match="step 9"):
      mgr.restore(trainer.abstract_state(), step=9)


def test_alternating_snapshot_sizes_reuse_slots_and_a_real_shrink_does_not(store_dir):
  """Replicas with every other snapshot make sizes alternate: the store keeps
  one slot size (the larger) instead of remaking a slot file every save; a
  state that shrinks to under half gets slots of its own size."""
  import os

  from snapstore._backends.hostfiles.store import HostStore, host_dir
  store = HostStore(host_dir(store_dir, "r", 0), run_id="r", host=0, keep=2,
                    budget_bytes=None)

  def files() -> dict[str, tuple[int, int]]:
    return {e.name: (e.inode(), e.stat().st_size) for e in os.scandir(store.root)
            if e.name.startswith("slot")}
  small, big = 3 << 12, 5 << 12
  for step, size in enumerate([big, small, big, small]):
    store.slot_buffer(store.reserve(step, size))  # (the drain makes a new slot's file)
  settled = files()
  assert settled and {s for _, s in settled.values()} == {big}
  for step, size in enumerate([big, small] * 3, start=4):
    slot = store.reserve(step, size)
    assert store.slot_buffer(slot).nbytes >= size
  assert files() == settled  # the same files, none remade
  store.slot_buffer(store.reserve(10, 1 << 12))  # under half: its own size
  assert {s for _, s in files().values()} == {1 << 12}


def test_committed_manifests_keep_no_per_piece_objects_for_the_collector(store_dir, trainer):
  """Thousands of pieces a snapshot, kept as objects, made Python's full
  collection run every few saves; kept as rows of plain tuples, the
  collector stops tracking them, and the file is byte for byte the one that
  records give."""
  import gc

  import msgpack

  from snapstore._manifest import PieceTable, _piece_row

  with snapstore.SnapshotManager(opts(store_dir, keep=2)) as mgr:
    train_and_save(trainer, mgr, [1, 2])
    manifests = only_store(mgr).manifests()
  assert [m.step for m in manifests] == [1, 2]
  gc.collect()  # a pass untracks a tuple whose items it has already untracked
  gc.collect()
  for m in manifests:
    assert isinstance(m.pieces, PieceTable) and len(m.pieces) > 0
    assert not any(gc.is_tracked(row) for row in m.pieces.rows)
    records = tuple(m.pieces)
    assert m.pieces == records and m.pieces[-1] == records[-1] and m.pieces[1:] == records[1:]
    # the same file whether the pieces are given as records or as the table
    rebuilt = dataclasses.replace(m, pieces=records)
    assert encode(rebuilt) == encode(m) and decode(encode(m)) == m
    assert msgpack.packb(m.pieces.rows) == msgpack.packb([_piece_row(p) for p in records])
