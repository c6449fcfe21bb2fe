"""Parity arithmetic, manifests and planning, in one process (8 CPU devices).

The multi-process cases (a SIGKILLed host rebuilt from parity, two lost in a
group, flipped bytes) are in test_multihost.py.
"""

import dataclasses

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from snapstore import Parity, SnapshotOptions, _parity, _planner, errors
from snapstore._checksum import ChecksumKind
from snapstore._index import to_slices
from snapstore._manifest import (
  PARITY_LEAF,
  Manifest,
  ParityRecord,
  PieceRecord,
  decode,
  encode,
  member_length,
)
from snapstore._tree import flatten, tree_digest
from tests.helpers import assert_bitwise_equal


def _stripes(k):
  """The 8 devices as 8 / (k+1) stripes of k+1 members (one process stands
  for every host: the arithmetic is what is tested here)."""
  n = k + 1
  devs = jax.devices()[: (8 // n) * n]
  grid = np.empty((len(devs) // n, n), object)
  for i, d in enumerate(devs):
    grid[i // n, i % n] = d
  return _parity.Stripes(k, grid)


def _state(mesh, seed):
  rng = np.random.default_rng(seed)
  sh, rep = NamedSharding(mesh, P("x")), NamedSharding(mesh, P())
  host = {
      "w": rng.standard_normal((16, 5)).astype(np.float32),
      "b": rng.integers(0, 255, (8, 3)).astype(np.uint8),  # 3 bytes a shard: padded
      "bf": rng.standard_normal((24,)).astype(ml_dtypes.bfloat16),
      "m": rng.integers(0, 2, (8, 1)).astype(bool),
      "r": rng.standard_normal((3,)).astype(np.float16),  # replicated
  }
  arrays = {k: jax.device_put(v, rep if k == "r" else sh) for k, v in host.items()}
  return host, arrays


@pytest.mark.parametrize("k", [1, 3])
def test_any_one_member_is_rebuilt_bitwise_from_parity_and_the_others(k):
  st = _stripes(k)
  mesh = jax.sharding.Mesh(np.array(list(st.grid.flat)), ("x",))
  host, arrays = _state(mesh, seed=k)
  names = sorted(arrays)
  layouts, length = _parity.layout(st, list(range(len(names))), [arrays[n] for n in names])
  out = _parity.encode(st, [arrays[n] for n in names], length)
  assert length % (4 * k) == 0 and out.shape[1] * 4 == length // k
  other = _parity.encode(st, [arrays[n] for n in names], length, op="sum_reduce_scatter")
  np.testing.assert_array_equal(np.asarray(other), np.asarray(out))  # two ways, one parity
  itemsize = lambda leaf: host[names[leaf]].dtype.itemsize  # noqa: E731
  piece = lambda leaf, idx: np.ascontiguousarray(  # noqa: E731
      host[names[leaf]][to_slices(idx)]).reshape(-1).view(np.uint8)
  blocks = {st.where[s.device]: np.asarray(s.data).reshape(-1) for s in out.addressable_shards}
  for s in range(st.grid.shape[0]):
    layout = _parity.StripeMembers(tuple(range(st.n)),
                                   tuple(layouts[s * st.n + m] for m in range(st.n)),
                                   length)
    for lost in range(st.n):
      buf = _parity.contribution(layout, lost, itemsize, piece, lambda j, s=s: blocks[(s, j)])
      got = _parity.split(layout, lost, buf, itemsize)
      assert [(lf, idx) for lf, idx, _ in got] == list(layout.pieces[lost])
      for leaf, idx, raw in got:
        assert raw.tobytes() == piece(leaf, idx).tobytes(), (s, lost, names[leaf])
      # A flipped bit in any block used changes the rebuilt bytes: the
      # blocks' checksums are what stands between it and a restore.
      j = (lost + 1) % st.n
      bad = {**{jj: blocks[(s, jj)] for jj in range(st.n)}, j: blocks[(s, j)] ^ np.uint32(1)}
      buf = _parity.contribution(layout, lost, itemsize, piece, bad.__getitem__)
      assert any(raw.tobytes() != piece(leaf, idx).tobytes()
                 for leaf, idx, raw in _parity.split(layout, lost, buf, itemsize))


def test_groups_must_divide_the_domains():
  assert _parity.groups_error(4, 3) is None and _parity.groups_error(1, 3) is None
  assert "groups of 4" in _parity.groups_error(6, 3)
  with pytest.raises(TypeError, match="redundancy"):
    SnapshotOptions(redundancy="erasure")
  with pytest.raises(ValueError, match=r"Parity\.k"):
    SnapshotOptions(redundancy=Parity(k=0))


def test_parity_with_host_files_on_a_single_controller_is_refused(store_dir):
  from snapstore import HostFiles, SnapshotManager
  devs = jax.devices()
  with pytest.raises(ValueError, match="pinned_host store"):
    SnapshotManager(SnapshotOptions(store=HostFiles(dir=store_dir), redundancy=Parity(3)),
                    slices={0: devs[:4], 1: devs[4:]})


# ---------------------------------------------------------------- manifests
def _manifests(k=3):
  """One step's manifests of k+1 hosts, one piece each (leaf 0, rows of 4),
  each host keeping its parity block of the one stripe."""
  n = k + 1
  specs, _, _ = flatten({"w": jax.ShapeDtypeStruct((4 * n, 2), np.float32)})
  layout = tuple((((0, ((4 * h, 4 * h + 4), (0, 2))),)) for h in range(n))
  length = member_length(32, k)
  out = []
  for h in range(n):
    piece = PieceRecord(0, ((4 * h, 4 * h + 4), (0, 2)), 0, 32, (0,), h)
    block = PieceRecord(PARITY_LEAF, ((7, h),), 4096, length // k, (0,), h)
    out.append(Manifest(run_id="r", incarnation=0, step=5, store=h, num_hosts=n,
                        tree_digest=tree_digest(specs), slot=0, chunk_bytes=1 << 20,
                        leaves=tuple(specs), pieces=(piece,), scalars={},
                        parity=(ParityRecord(block, tuple(range(n)), layout, length),)))
  return out


def test_a_parity_record_survives_the_manifest_round_trip():
  for m in _manifests():
    assert decode(encode(m)) == m


@pytest.mark.parametrize("change", [
    lambda r: dataclasses.replace(r, members=(0, 1, 2, 2)),       # a host twice
    lambda r: dataclasses.replace(r, members=(9, 1, 2, 3)),       # block 0 not its holder's
    lambda r: dataclasses.replace(r, length=r.length + 4),        # not k blocks
    lambda r: dataclasses.replace(r, layout=r.layout[:3]),        # a member without layout
    lambda r: dataclasses.replace(r, layout=(((0, ((0, 99), (0, 2))),), *r.layout[1:])),
    lambda r: dataclasses.replace(r, layout=(((3, ((0, 4), (0, 2))),), *r.layout[1:])),
    lambda r: dataclasses.replace(r, piece=r.piece._replace(leaf=0)),
    lambda r: dataclasses.replace(r, length=1 << 40, piece=r.piece._replace(
        nbytes=(1 << 40) // 3)),                          # a length no member makes
    lambda r: dataclasses.replace(                                 # members of unequal sizes
        r, layout=((*r.layout[0], (0, ((12, 16), (0, 2)))), *r.layout[1:])),
    lambda r: dataclasses.replace(
        r, piece=r.piece._replace(kind=ChecksumKind.DEVICE_SUM)),
])
def test_a_malformed_parity_record_is_corruption(change):
  m = _manifests()[0]
  bad = dataclasses.replace(m, parity=(change(m.parity[0]),))
  with pytest.raises(errors.CorruptSnapshotError):
    decode(encode(bad))


def test_the_planner_rebuilds_one_lost_member_and_names_the_group_when_two_are_lost():
  ms = _manifests()
  plan = _planner.choose(ms[:1] + ms[2:])  # host 1 lost
  assert plan is not None and plan.step == 5
  (rb,) = plan.rebuilds
  assert rb.lost == 1 and sorted(rb.blocks) == [0, 2, 3]
  (copy,) = plan.copies[(0, ((4, 8), (0, 2)))]
  assert copy.store == _planner.REBUILT
  reasons = []
  assert _planner.choose(ms[:1] + ms[3:], reasons=reasons) is None  # hosts 1 and 2
  assert "group of hosts [0, 1, 2, 3]" in reasons[0] and "[1, 2]" in reasons[0]
  bad = {(2, 5, PARITY_LEAF, ((7, 2),))}  # host 1 lost and host 2's block bad
  reasons = []
  assert _planner.choose(ms[:1] + ms[2:], bad=bad, reasons=reasons) is None
  assert "parity blocks of hosts [2]" in reasons[0]
  assert _planner.choose(ms).rebuilds == ()  # nothing lost, nothing rebuilt
  # Two stores claim one block: every host (whichever it prefers) refuses
  # the stripe alike, or they would run different collectives.
  twin = dataclasses.replace(ms[3], parity=(dataclasses.replace(
      ms[3].parity[0], piece=ms[3].parity[0].piece._replace(index=((7, 2),))),))
  for prefer in (0, 2, 3):
    reasons = []
    assert _planner.choose([ms[0], ms[2], twin], prefer_store=prefer, reasons=reasons) is None
    assert "disagree" in reasons[0]


# ---------------------------------------------------------------- single controller
def test_pinned_store_never_rebuilds_from_a_flipped_byte(store_dir):
  """4 slices of 2 devices, parity k=3, the pinned-host store; slice 1 is
  lost. At step 3 slice 2's parity block has a flipped byte, at step 2 slice
  3's own piece (used by the rebuild, no other copy): step 1 is restored,
  slice 1's pieces rebuilt, bitwise."""
  import ctypes

  from snapstore import PinnedHost, SnapshotManager
  from snapstore.testing.backend_suite import abstract, awkward_state, save_steps
  devs = jax.devices()
  s2d = {k: devs[2 * k:2 * k + 2] for k in range(4)}
  opts = SnapshotOptions(store=PinnedHost(), keep=3, redundancy=Parity(k=3))
  with SnapshotManager(opts, slices=s2d) as mgr:
    refs = save_steps(mgr, [1, 2, 3])

    def flip(sid, step, pick):
      store = mgr._backend.stores[sid]
      (m,) = [m for m in store.manifests() if m.step == step]
      rec = pick(m)
      arr = store.array(m.slot, rec.offset)
      ctypes.c_uint8.from_address(arr.unsafe_buffer_pointer() + rec.nbytes // 2).value ^= 4

    flip(2, 3, lambda m: m.parity[0].piece)
    flip(3, 2, lambda m: next(p for p in m.pieces
                              if m.leaves[p.leaf].path == "tp" and p.owner == 3))
    mgr.forget_domains([1], "slice lost")
    r = mgr.restore(abstract(awkward_state(devs, 0)))
  assert r.step == 1 and r.bytes_read["rebuilt"] > 0
  assert_bitwise_equal(refs[1], r.state)
  assert any("step 3" in n and "parity block" in n and "slice 2" in n for n in r.notes), r.notes
  assert any("step 2" in n and "'tp'" in n and "slice 3" in n for n in r.notes), r.notes


def test_the_xor_variant_benchmarked_beside_the_sum_is_the_classic_parity():
  st = _stripes(3)
  mesh = jax.sharding.Mesh(np.array(list(st.grid.flat)), ("x",))
  host, arrays = _state(mesh, seed=7)
  names = sorted(arrays)
  layouts, length = _parity.layout(st, list(range(len(names))), [arrays[n] for n in names])
  out = _parity.encode(st, [arrays[n] for n in names], length, op="xor")
  itemsize = lambda leaf: host[names[leaf]].dtype.itemsize  # noqa: E731
  for shard in out.addressable_shards:
    s, j = st.where[shard.device]
    layout = _parity.StripeMembers(tuple(range(4)),
                                   tuple(layouts[s * 4 + m] for m in range(4)), length)
    want = np.zeros(length // 12, np.uint32)
    for d in range(4):
      if d != j:
        buf = np.zeros(length, np.uint8)
        for leaf, idx, at, nb in layout.offsets(d, itemsize):
          buf[at:at + nb] = np.ascontiguousarray(host[names[leaf]][to_slices(idx)]).reshape(
              -1).view(np.uint8)
        sub = _parity.sub_block(j, d, 4)
        want ^= buf.view(np.uint32)[sub * (length // 12):(sub + 1) * (length // 12)]
    np.testing.assert_array_equal(np.asarray(shard.data).reshape(-1), want)


@pytest.mark.parametrize("checksum", ["host", "device"])
def test_leaves_in_host_memory_or_complex_keep_full_replicas_not_parity(store_dir, checksum):
  """The parity collective reads device memory as uint32 words: a leaf in
  pinned_host memory (offloaded) or of a complex dtype keeps a full replica
  instead, and the user's pinned_host array is copied, never kept (retention
  frees what a store holds)."""
  import jax.numpy as jnp

  from snapstore import PinnedChecksum, PinnedHost, SnapshotManager
  devs = jax.devices()
  s2d = {k: devs[2 * k:2 * k + 2] for k in range(4)}
  mesh = jax.sharding.Mesh(np.array(devs), ("x",))
  st = _parity.slice_stripes(s2d, 3)
  sh = NamedSharding(mesh, P("x"))
  state = {
      "w": jax.device_put(jnp.arange(64, dtype=jnp.float32), sh),
      "off": jax.device_put(jnp.arange(64, dtype=jnp.float32) * 2,
                            sh.with_memory_kind("pinned_host")),
      "z": jax.device_put(jnp.arange(16, dtype=jnp.complex64) * 1j, sh),
  }
  assert _parity.evenly_sharded(st, state["w"])
  assert not _parity.evenly_sharded(st, state["off"]) and not _parity.evenly_sharded(st, state["z"])
  abstract_state = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
  expected = {k: np.asarray(v).copy() for k, v in state.items()}
  opts = SnapshotOptions(store=PinnedHost(checksum=PinnedChecksum(checksum)), keep=1,
                         redundancy=Parity(3))
  with SnapshotManager(opts, slices=s2d) as mgr:
    for step in (1, 2, 3):  # retention frees the older slots
      mgr.save(step, state)
      mgr.wait_until_finished()
    assert not any(v.is_deleted() for v in state.values())
    mgr.forget_domains([1], "slice lost")
    r = mgr.restore(abstract_state)
  assert r.step == 3 and r.bytes_read["rebuilt"] > 0
  for k, v in r.state.items():
    assert np.asarray(v).tobytes() == expected[k].tobytes(), k


def test_a_rebuild_sum_larger_than_a_batch_is_summed_in_batches(monkeypatch):
  from snapstore._multihost import exchange
  monkeypatch.setattr(exchange, "BATCH_BYTES", 64)
  words = np.arange(1000, dtype=np.uint32) * np.uint32(2654435761)
  np.testing.assert_array_equal(exchange.sum_words(words), words)  # one process: itself


def test_inspect_verifies_parity_blocks_and_says_what_restore_would_rebuild(store_dir, capsys):
  """Four host stores written by hand (one piece and one parity block each,
  real checksums): with host 1's store gone, inspect says restore would
  rebuild it from stripe 7; a flipped byte in host 2's parity block makes
  that manifest invalid, and with it the rebuild impossible."""
  import json
  import shutil

  from snapstore import cli
  from snapstore._backends.hostfiles.store import HostStore, host_dir
  from snapstore._checksum import crc_chunks, piece_key
  rng = np.random.default_rng(3)
  ms = _manifests()
  r0 = ms[0].parity[0]
  words = r0.length // 4 // 3
  bufs = {h: np.zeros(r0.length, np.uint8) for h in range(4)}
  for h in range(4):
    bufs[h][:32] = rng.integers(0, 256, 32, dtype=np.uint8)
  for h, m in enumerate(ms):
    block = np.zeros(words, np.uint32)
    for d in range(4):
      if d != h:
        sub = _parity.sub_block(h, d, 4)
        block += bufs[d].view(np.uint32)[sub * words:(sub + 1) * words]
    store = HostStore(host_dir(store_dir, "r", h), run_id="r", host=h, keep=1,
                      budget_bytes=None)
    slot = store.reserve(5, 8192)
    out = store.slot_buffer(slot)
    out[:32] = bufs[h][:32]
    out[4096:4096 + block.nbytes] = block.view(np.uint8)
    piece = m.pieces[0]._replace(checksum=crc_chunks(
        bufs[h][:32], chunk_bytes=m.chunk_bytes, key=piece_key("w", m.pieces[0].index)))
    rec = m.parity[0]
    rec = dataclasses.replace(rec, piece=rec.piece._replace(checksum=crc_chunks(
        block, chunk_bytes=m.chunk_bytes, key=piece_key(_parity.PARITY_PATH, rec.piece.index))))
    store.commit(dataclasses.replace(m, slot=slot, pieces=(piece,), parity=(rec,)))
  shutil.rmtree(host_dir(store_dir, "r", 1))

  def inspect():
    assert cli.main(["inspect", str(store_dir / "r"), "--verify"]) == 0
    return json.loads(capsys.readouterr().out)
  report = inspect()
  assert all(r["verdict"] == "valid" and r["parity_blocks"] == 1 for r in report["manifests"])
  assert report["restore_would_pick"]["step"] == 5
  assert report["restore_would_pick"]["rebuilt_from_parity"] == [{"stripe": 7, "host": 1}]
  with open(host_dir(store_dir, "r", 2) / "slot-0.bin", "r+b") as f:
    f.seek(4097)
    b = f.read(1)
    f.seek(4097)
    f.write(bytes([b[0] ^ 1]))
  report = inspect()
  verdicts = {r["host"]: r["verdict"] for r in report["manifests"]}
  assert verdicts[2] == "invalid: checksum mismatch in parity block 2 of stripe 7", verdicts
  assert report["restore_would_pick"]["step"] is None
