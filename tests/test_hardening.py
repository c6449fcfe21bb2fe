"""Safe files, no loss, clear refusals: each defect found by an adversarial
user, one test each (host-file store, one process, 8 CPU devices)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import snapstore
from snapstore._jax_compat import single_device_sharding
from snapstore._manifest import decode, encode
from tests.helpers import assert_bitwise_equal, host_copy, only_store


def state_at(step, rows=16):
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("d",))
  return {"w": jax.device_put(jnp.arange(rows * 8, dtype=jnp.float32).reshape(rows, 8) + step,
                              NamedSharding(mesh, P("d"))),
          "n": np.arange(4, dtype=np.int32) * step, "step": step}


def abstract(rows=16):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                      if isinstance(x, jax.Array) else x, state_at(0, rows))


def opts(store_dir, **kw):
  kw.setdefault("run_id", "hard")
  kw.setdefault("store", snapstore.Auto(dir=store_dir))
  return snapstore.SnapshotOptions(**kw)


def save_steps(mgr, steps, rows=16):
  refs = {}
  for s in steps:
    mgr.save(s, state_at(s, rows))
    refs[s] = host_copy(state_at(s, rows))
  mgr.wait_until_finished()
  return refs


def slot_of(root, step):
  (path,) = root.glob(f"step-{step:010d}-inc*.manifest")
  return root / f"slot-{decode(path.read_bytes()).slot}.bin"


# ------------------------------------------------------------ safe files
def test_a_store_owned_by_another_user_is_refused_untouched(store_dir):
  run = store_dir / "hard"
  run.mkdir(parents=True, mode=0o700)
  os.chown(run, 12345, 12345)
  with pytest.raises(snapstore.UnsafeStoreError, match="owned by uid 12345"):
    snapstore.SnapshotManager(opts(store_dir))
  assert run.stat().st_uid == 12345 and list(run.iterdir()) == []


def test_a_run_directory_writable_by_others_is_refused_untouched(store_dir):
  run = store_dir / "hard"
  run.mkdir(parents=True)
  run.chmod(0o777)
  with pytest.raises(snapstore.UnsafeStoreError, match="writable by others"):
    snapstore.SnapshotManager(opts(store_dir))
  assert run.stat().st_mode & 0o777 == 0o777


def test_a_symlinked_run_directory_is_refused_and_its_target_untouched(store_dir, tmp_path):
  target = tmp_path / "elsewhere"
  target.mkdir(mode=0o755)
  store_dir.mkdir()
  (store_dir / "hard").symlink_to(target)
  with pytest.raises(snapstore.UnsafeStoreError, match="symlink"):
    snapstore.SnapshotManager(opts(store_dir))
  assert target.stat().st_mode & 0o777 == 0o755 and list(target.iterdir()) == []


def test_a_symlinked_slot_is_never_written_through(store_dir, tmp_path):
  outside = tmp_path / "precious"
  outside.write_bytes(b"keep me" * 1000)
  with snapstore.SnapshotManager(opts(store_dir, keep=2)) as mgr:
    save_steps(mgr, [1, 2])
    slot = slot_of(only_store(mgr).root, 1)
    slot.unlink()
    slot.symlink_to(outside)
  with snapstore.SnapshotManager(opts(store_dir, keep=2)) as mgr:
    refs = save_steps(mgr, [3, 4, 5])
    r = mgr.restore(abstract())
  assert outside.read_bytes() == b"keep me" * 1000
  assert r.step == 5
  assert_bitwise_equal(refs[5], r.state)


@pytest.mark.parametrize("kw", [dict(run_id=".."), dict(run_id="."), dict(run_id="a/b"),
                                dict(store="/dev/shm"), dict(store=None),
                                dict(store_dir="/dev/shm/x"), dict(budget_bytes=1 << 30),
                                dict(pinned_checksum="host"), dict(interval=True),
                                dict(chunk_bytes=4096.0), dict(keep="2"),
                                dict(redundancy=1),
                                dict(redundancy="parity"), dict(interval=3),
                                dict(drain_switch_interval_s=0),
                                dict(drain_switch_interval_s=2.0),
                                dict(drain_switch_interval_s="1ms"),
                                dict(pause_gc=1), dict(pause_gc="yes")])
def test_bad_options_are_refused_naming_the_option(kw):
  """One error for a bad value (both a ValueError and a TypeError); an
  option that is gone is Python's own TypeError."""
  (name,) = kw
  gone = name in ("store_dir", "budget_bytes", "pinned_checksum")
  with pytest.raises(TypeError if gone else snapstore.InvalidOptionError, match=name) as e:
    snapstore.SnapshotOptions(**kw)
  assert gone or (isinstance(e.value, ValueError) and isinstance(e.value, TypeError))


@pytest.mark.parametrize("make, name", [
    (lambda: snapstore.Every(0), "Every.steps"), (lambda: snapstore.Every(True), "Every.steps"),
    (lambda: snapstore.Replicas(-1), "Replicas.copies"),
    (lambda: snapstore.Parity(0), "Parity.k"), (lambda: snapstore.Parity(1024), "Parity.k"),
    (lambda: snapstore.AutoInterval(0), "host_mtbf_s"),
    (lambda: snapstore.AutoInterval(None), "host_mtbf_s"),
    (lambda: snapstore.HostFiles(dir=""), "HostFiles.dir"),
    (lambda: snapstore.HostFiles(budget_bytes=1.5e9), "HostFiles.budget_bytes"),
    (lambda: snapstore.Auto(budget_bytes=0), "Auto.budget_bytes"),
    (lambda: snapstore.PinnedHost(checksum="host"), "PinnedHost.checksum"),
    (lambda: snapstore.PinnedHost(budget_bytes=-1), "PinnedHost.budget_bytes")])
def test_a_bad_choice_is_refused_naming_its_parameter(make, name):
  with pytest.raises(snapstore.InvalidOptionError, match=name):
    make()


# --------------------------------------------------------- nothing lost
def test_a_kill_while_a_bigger_state_is_saved_keeps_the_older_snapshot(store_dir):
  """The state grows at step 2 and the process is SIGKILLed just before that
  step's manifest is committed (a real fault point): step 1 survives."""
  script = textwrap.dedent(f"""
      import jax, numpy as np, snapstore
      jax.config.update("jax_platforms", "cpu")
      opts = snapstore.SnapshotOptions(store=snapstore.HostFiles(dir={str(store_dir)!r}),
                                       run_id="hard", keep=1)
      with snapstore.SnapshotManager(opts) as mgr:
        mgr.save(1, {{"w": np.arange(1000, dtype=np.float32)}})
        mgr.wait_until_finished()
        mgr.save(2, {{"w": np.arange(300000, dtype=np.float32)}})
        mgr.wait_until_finished()
  """)
  proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                        env=dict(os.environ, SNAPSTORE_FAULT="manifest@2"), timeout=120)
  assert proc.returncode == -9, proc.stderr
  with snapstore.SnapshotManager(opts(store_dir, keep=1)) as mgr:
    r = mgr.restore({"w": np.zeros(1000, np.float32)})
  assert r.step == 1
  assert r.state["w"].tobytes() == np.arange(1000, dtype=np.float32).tobytes()


@pytest.mark.parametrize("policy", list(snapstore.FailurePolicy))
def test_a_failed_drain_of_a_resized_state_loses_nothing(store_dir, policy):
  """CONTINUE (the default) counts the failed step and says so; RAISE raises
  it. Either way the step before it restores bitwise, and leaving the
  ``with`` raises nothing more under CONTINUE."""
  with snapstore.SnapshotManager(opts(store_dir, keep=1, failure_policy=policy)) as mgr:
    refs = save_steps(mgr, [1])

    def fail(pending):
      raise OSError("the RAM disk went away")
    mgr._backend.drain = fail
    mgr.save(2, state_at(2, rows=64))
    if policy is snapstore.FailurePolicy.RAISE:
      with pytest.raises(snapstore.DrainFailedError, match="step 2 failed") as e:
        mgr.wait_until_finished()
      assert e.value.step == 2
    else:
      assert mgr.wait_until_finished() is False
      assert mgr.metrics.store_failures == 1
      assert mgr.metrics.last_store_failure.startswith("step 2: ")
      mgr.save(3, state_at(3, rows=64))  # fails too: the restore finds it, counts it
    r = mgr.restore(abstract())
    assert mgr.wait_until_finished() is True  # (nothing in flight)
    if policy is snapstore.FailurePolicy.CONTINUE:
      assert mgr.metrics.store_failures == 2
      assert mgr.metrics.last_store_failure.startswith("step 3: ")
      assert any("snapshot in flight was not completed" in n for n in r.notes), r.notes
  assert r.step == 1
  assert_bitwise_equal(refs[1], r.state)


def test_a_failed_drain_never_replaces_an_error_leaving_the_with_block(store_dir):
  """A failed last snapshot under RAISE: ``close`` raises it, but not over
  an error already on its way out of the ``with`` block."""
  with pytest.raises(KeyError, match="the loop's own"):
    with snapstore.SnapshotManager(opts(store_dir, failure_policy=snapstore.FailurePolicy.RAISE)
                                   ) as mgr:
      save_steps(mgr, [1])

      def fail(pending):
        raise OSError("the RAM disk went away")
      mgr._backend.drain = fail
      mgr.save(2, state_at(2))
      raise KeyError("the loop's own")
  with pytest.raises(snapstore.DrainFailedError):
    with snapstore.SnapshotManager(opts(store_dir, failure_policy=snapstore.FailurePolicy.RAISE)
                                   ) as mgr:
      mgr._backend.drain = fail
      mgr.save(3, state_at(3))


def test_unsupported_leaves_are_refused_at_save_naming_the_leaf(store_dir):
  with snapstore.SnapshotManager(opts(store_dir)) as mgr:
    save_steps(mgr, [1])
    structured = np.zeros(3, dtype=[("a", np.int32), ("b", np.float32)])
    with pytest.raises(snapstore.UnsupportedLeafError, match="rec") as e:
      mgr.save(2, dict(state_at(2), rec=structured))
    assert e.value.leaf == "rec"
    with pytest.raises(snapstore.UnsupportedLeafError, match="big"):
      mgr.save(3, dict(state_at(3), big=2**70))
    mgr.wait_until_finished()
    assert mgr.snapshot_steps() == [1]
    assert mgr.restore(abstract()).step == 1


def test_a_zombie_older_incarnation_does_not_overwrite_the_newer_one(store_dir):
  with snapstore.SnapshotManager(opts(store_dir, incarnation=5, keep=3)) as mgr:
    refs = save_steps(mgr, [1, 2, 3])
  with snapstore.SnapshotManager(opts(store_dir, incarnation=4, keep=3)) as zombie:
    zombie.save(3, state_at(99))
    zombie.wait_until_finished()
  with snapstore.SnapshotManager(opts(store_dir, keep=3)) as mgr:
    r = mgr.restore(abstract())
  assert r.step == 3
  assert_bitwise_equal(refs[3], r.state)


# ------------------------------------------------------ fall back, not crash
def test_a_slot_truncated_under_a_live_mapping_falls_back(store_dir):
  with snapstore.SnapshotManager(opts(store_dir, keep=2)) as mgr:
    refs = save_steps(mgr, [1, 2])  # this process has both slots mapped
    slot = slot_of(only_store(mgr).root, 2)
    subprocess.run(["truncate", "-s", str(slot.stat().st_size // 3), str(slot)], check=True)
    r = mgr.restore(abstract())
  assert r.step == 1
  assert_bitwise_equal(refs[1], r.state)


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_fifo_or_directory_in_place_of_a_slot_falls_back(store_dir, kind):
  with snapstore.SnapshotManager(opts(store_dir, keep=2)) as mgr:
    refs = save_steps(mgr, [1, 2])
    slot = slot_of(only_store(mgr).root, 2)
  slot.unlink()
  os.mkfifo(slot) if kind == "fifo" else slot.mkdir()
  with snapstore.SnapshotManager(opts(store_dir, keep=2)) as mgr:
    r = mgr.restore(abstract())
    assert r.step == 1
    assert_bitwise_equal(refs[1], r.state)
    save_steps(mgr, [3])  # and saving goes on
    assert mgr.restore(abstract()).step == 3


def test_a_manifest_with_a_huge_incarnation_is_ignored_and_saves_go_on(store_dir):
  with snapstore.SnapshotManager(opts(store_dir, keep=3)) as mgr:
    save_steps(mgr, [1])
    root = only_store(mgr).root
    (path,) = root.glob("step-*.manifest")
  m = decode(path.read_bytes())
  import dataclasses
  (root / f"step-{9:010d}-inc{2**64 - 1}.manifest").write_bytes(
      encode(dataclasses.replace(m, step=9, incarnation=2**64 - 1)))
  with snapstore.SnapshotManager(opts(store_dir, keep=3)) as mgr:
    refs = save_steps(mgr, [2])
    r = mgr.restore(abstract())
  assert r.step == 2
  assert_bitwise_equal(refs[2], r.state)


# ---------------------------------------------------------------- inspect
def test_inspect_gives_each_manifest_a_verdict_the_lineage_and_the_pick(store_dir, capsys):
  import json

  from snapstore import cli
  with snapstore.SnapshotManager(opts(store_dir, keep=4)) as mgr:
    save_steps(mgr, [1, 2, 3])
    first = mgr.incarnation
    root = only_store(mgr).root
    old3 = root / f"step-{3:010d}-inc{first}.manifest"
    abandoned = old3.read_bytes()
    mgr.restore(abstract(), step=2)  # a new branch from step 2
    save_steps(mgr, [3])  # retention deletes the abandoned step 3 ...
  old3.write_bytes(abandoned)  # ... which a zombie writes back
  (path1,) = root.glob(f"step-{1:010d}-inc*.manifest")
  path1.write_bytes(path1.read_bytes()[:-3])
  slot = slot_of(root, 2)
  with open(slot, "r+b") as f:
    f.seek(5)
    b = f.read(1)
    f.seek(5)
    f.write(bytes([b[0] ^ 1]))
  assert cli.main(["inspect", str(store_dir / "hard"), "--verify"]) == 0
  report = json.loads(capsys.readouterr().out)
  verdicts = {(r["file"]): r["verdict"] for r in report["manifests"]}
  assert verdicts[path1.name].startswith("invalid")
  (path2,) = root.glob(f"step-{2:010d}-inc*.manifest")
  assert "checksum mismatch" in verdicts[path2.name]
  assert verdicts[old3.name].startswith("superseded")
  # incarnation `first` keeps only its abandoned step 3 valid-but-superseded
  assert report["lineage"][str(first)] == {"steps": [3], "live_steps": []}
  assert report["lineage"][str(first + 1)] == {"steps": [3], "live_steps": [3]}
  assert report["restore_would_pick"]["step"] == 3
  assert report["restore_would_pick"]["incarnation"] == first + 1


def test_a_read_only_store_restores_and_refuses_saves_deleting_nothing(store_dir, tmp_path):
  with snapstore.SnapshotManager(opts(store_dir, keep=2)) as mgr:
    refs = save_steps(mgr, [1, 2])
  ro = tmp_path / "ro"
  ro.mkdir()
  if subprocess.run(["mount", "--bind", str(store_dir), str(ro)]).returncode != 0:
    pytest.skip("cannot bind-mount here (needs CAP_SYS_ADMIN)")
  try:
    assert subprocess.run(["mount", "-o", "remount,bind,ro", str(ro)]).returncode == 0
    with snapstore.SnapshotManager(opts(ro, keep=2)) as mgr:
      r = mgr.restore(abstract())
      assert r.step == 2
      assert_bitwise_equal(refs[2], r.state)
      with pytest.raises(snapstore.StoreError, match="untouched"):
        mgr.save(3, state_at(3))
      assert mgr.restore(abstract()).step == 2
  finally:
    subprocess.run(["umount", "-l", str(ro)])
  assert len(list((store_dir / "hard" / "host-0").glob("*.manifest"))) == 2


# ------------------------------------------- found by red-teaming restore
def test_a_restored_state_owns_its_memory_later_saves_do_not_change_it(store_dir):
  """keep=1: the next saves reuse the slots the restore read from."""
  with snapstore.SnapshotManager(opts(store_dir, keep=1)) as mgr:
    refs = save_steps(mgr, [1, 2])
    r = mgr.restore(abstract())
    save_steps(mgr, [3, 4])
    assert r.step == 2
    assert_bitwise_equal(refs[2], r.state)


def test_truncating_a_slot_after_restore_cannot_crash_the_restored_state(store_dir):
  script = textwrap.dedent(f"""
      import os, jax, numpy as np, snapstore
      jax.config.update("jax_platforms", "cpu")
      opts = snapstore.SnapshotOptions(store=snapstore.HostFiles(dir={str(store_dir)!r}),
                                       run_id="hard")
      w = np.arange(1 << 16, dtype=np.float32)
      with snapstore.SnapshotManager(opts) as mgr:
        mgr.save(1, {{"w": jax.numpy.asarray(w)}})
        mgr.wait_until_finished()
        r = mgr.restore({{"w": jax.ShapeDtypeStruct(w.shape, w.dtype)}})
        for p in (mgr._backend.stores[0].root).glob("slot-*.bin"):
          os.truncate(p, 0)
        assert np.asarray(r.state["w"]).tobytes() == w.tobytes()
      print("ok")
  """)
  proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                        timeout=120)
  assert proc.returncode == 0 and "ok" in proc.stdout, (proc.returncode, proc.stderr[-500:])


def test_steps_beyond_ten_digits_are_saved_and_restored_and_absurd_ones_refused(store_dir):
  with snapstore.SnapshotManager(opts(store_dir)) as mgr:
    mgr.save(10**12, state_at(1))
    mgr.wait_until_finished()
    assert mgr.restore(abstract()).step == 10**12
    with pytest.raises(ValueError, match="step"):
      mgr.save(2**70, state_at(2))
    mgr.save(10**12 + 1, state_at(3))  # the manager still works
    mgr.wait_until_finished()
    r = mgr.restore(abstract())
  assert r.step == 10**12 + 1
  assert_bitwise_equal(host_copy(state_at(3)), r.state)


def test_nan_scalars_and_extras_restore_and_a_store_that_lies_is_not_believed(store_dir):
  import dataclasses
  devs = jax.devices()
  with snapstore.SnapshotManager(opts(store_dir, store=snapstore.HostFiles(dir=store_dir),
                                      keep=3),
                                 slices={0: devs[:4], 1: devs[4:]}) as mgr:
    for s in (1, 2):
      mgr.save(s, dict(state_at(s), loss=float("nan"), flag=True), extra={"x": float("nan")})
    mgr.wait_until_finished()
    target = dict(abstract(), loss=0.0, flag=False)
    r = mgr.restore(target)
    assert r.step == 2 and r.state["loss"] != r.state["loss"] and r.extra["x"] != r.extra["x"]
    store1 = mgr._backend.stores[1]
    m = next(m for m in store1.manifests() if m.step == 2)
    flag = next(i for i, s in enumerate(m.leaves) if s.path == "flag")
    store1.commit(dataclasses.replace(m, scalars={**m.scalars, flag: 1.0}))
    assert mgr.restore(target).step == 1  # True vs 1.0: the stores disagree


def test_hostile_manifests_are_refused_cheaply(store_dir):
  """A manifest of 3000 tiny diagonal pieces (a grid of 9M cells) and an
  envelope claiming 8M entries are refused without quadratic time or memory."""
  import dataclasses

  from snapstore._manifest import PieceRecord
  with snapstore.SnapshotManager(opts(store_dir)) as mgr:
    save_steps(mgr, [1])
    (path,) = only_store(mgr).root.glob("step-*.manifest")
  m = decode(path.read_bytes())
  w = next(i for i, s in enumerate(m.leaves) if s.path == "w")
  big = dataclasses.replace(m.leaves[w], shape=(3000, 3000))
  leaves = tuple(big if i == w else s for i, s in enumerate(m.leaves))
  pieces = tuple(PieceRecord(w, ((i, i + 1), (i, i + 1)), 0, 4, (0,), 0) for i in range(3000))
  from snapstore._tree import tree_digest
  hostile = dataclasses.replace(m, leaves=leaves, pieces=pieces, tree_digest=tree_digest(leaves))
  with pytest.raises(snapstore.CorruptSnapshotError, match="overlap"):
    decode(encode(hostile))
  bomb = b"\xdd" + (8 << 20).to_bytes(4, "big") + b"\x90" * (8 << 20)
  with pytest.raises(snapstore.CorruptSnapshotError, match="max_array_len"):
    decode(bomb)


def test_odd_keys_and_a_progress_directory_get_clear_errors_or_go_on(store_dir):
  with snapstore.SnapshotManager(opts(store_dir)) as mgr:
    with pytest.raises(snapstore.UnsupportedLeafError, match="share the key path"):
      mgr.save(1, {"a/b": np.zeros(2), "a": {"b": np.ones(2)}})
    with pytest.raises(snapstore.UnsupportedLeafError, match="UTF-8"):
      mgr.save(1, {"bad\ud800": np.zeros(2)})
    root = only_store(mgr).root
    (root / "PROGRESS").unlink(missing_ok=True)
    (root / "PROGRESS").mkdir()
    refs = save_steps(mgr, [2])
    r = mgr.restore(abstract())
  assert r.step == 2
  assert_bitwise_equal(refs[2], r.state)


def test_a_64_bit_leaf_is_not_narrowed_into_a_jax_array_without_x64(store_dir):
  """numpy float64/int64 leaves saved; restoring them as jax.Arrays with
  jax_enable_x64 off would hand back float32/int32 with changed values:
  refused, naming the leaf; as numpy they come back bitwise (found by a
  red-team helper)."""
  assert not jax.config.jax_enable_x64
  state = {"f": np.linspace(0, 1, 5) / 3, "i": np.arange(4, dtype=np.int64) << 40}
  sharding = single_device_sharding(jax.devices()[0])
  with snapstore.SnapshotManager(opts(store_dir)) as mgr:
    mgr.save(1, state)
    mgr.wait_until_finished()
    for leaf in ("f", "i"):
      target = dict(state)
      target[leaf] = jax.ShapeDtypeStruct(state[leaf].shape, state[leaf].dtype, sharding=sharding)
      with pytest.raises(snapstore.TreeMismatchError, match=f"'{leaf}'.*jax_enable_x64"):
        mgr.restore(target)
    assert_bitwise_equal(state, mgr.restore(state).state)


def test_every_public_error_is_a_snapstore_error():
  """One root: ``except snapstore.SnapstoreError`` catches every error the
  library defines, the in-place ones too."""
  from snapstore import errors, recovery
  defined = [v for m in (errors, recovery) for v in vars(m).values()
             if isinstance(v, type) and issubclass(v, BaseException)]
  assert {e.__name__ for e in defined} >= {"RestartRequired", "PeerFailed", "MembersMissing",
                                           "StoreError", "DrainFailedError"}
  assert [e for e in defined if not issubclass(e, errors.SnapstoreError)] == []
