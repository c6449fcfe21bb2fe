"""Stores of other host indices on this machine (:mod:`snapstore._backends.hostfiles.adopt`):
the claim lock, what is adoptable, a store's snapshots sent and written home
bitwise, and when an adopted store is deleted. One process here; the
renumbered restart with real processes is in tests/test_multihost.py."""

import dataclasses
import os
import signal
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import snapstore
from snapstore._backends.hostfiles import adopt
from snapstore._backends.hostfiles.store import HostStore, host_dir
from tests.helpers import assert_bitwise_equal, host_copy, opts


def state_at(step):
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("d",))
  return {"w": jax.device_put(jnp.arange(256, dtype=jnp.float32).reshape(32, 8) * step,
                              NamedSharding(mesh, P("d"))), "step": step}


def abstract():
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                      if isinstance(x, jax.Array) else x, state_at(1))


def test_a_locked_store_is_never_adoptable_and_one_lock_wins(tmp_path):
  run = tmp_path / "run"
  for q in (0, 1, 2):
    (run / f"host-{q}").mkdir(parents=True)
  (run / "host-x").mkdir()  # not a store
  held = adopt.lock(run / "host-1")  # a live process's claim
  assert held is not None
  assert adopt.unclaimed(run, mine={0}) == [2]
  assert adopt.lock(run / "host-1") is None  # a second open file never gets it
  first = adopt.lock(run / "host-2")
  assert first is not None and adopt.lock(run / "host-2") is None
  adopt.unlock(held)
  assert adopt.unclaimed(run, mine={0}) == [1]  # host-2 still held by `first`
  adopt.unlock(first)
  assert adopt.unclaimed(run, mine={0}) == [1, 2]
  assert adopt.lock(tmp_path / "gone") is None


def test_an_adopted_store_goes_home_bitwise_and_is_deleted_after_a_newer_agreed_step(
    tmp_path):
  """Host 0's snapshots, found on "another machine" (directory A) by a
  process that has another index there, are packed, sent (here: handed
  over), written into host 0's own store on its machine (B) and restored
  bitwise from B; A's copy goes once a newer step is agreed, not before."""
  a, b = tmp_path / "a", tmp_path / "b"
  with snapstore.SnapshotManager(opts(a, run_id="r", keep=1)) as mgr:
    for step in (1, 2):
      mgr.save(step, state_at(step))
    mgr.wait_until_finished()
  refused: set[int] = set()
  found = adopt.adopt(a / "r", mine={5}, held={}, run_id="r", keep=1, refused=refused)
  assert list(found) == [0] and found[0].newest[1] == 2
  assert adopt.adopt(a / "r", mine={5}, held={}, run_id="r", keep=1,
                     refused=refused) == {}  # locked: ours
  segments, size = adopt.payload(found[0].store, "r")
  data = adopt.chunk(segments, 0, size)
  assert data.size == size
  own = HostStore(host_dir(b, "r", 0), run_id="r", host=0, keep=1, budget_bytes=None)
  assert adopt.receive(own, data) == ([1, 2], [])
  assert adopt.receive(own, data) == ([], [])  # already there
  assert adopt.receive(own, data[:20])[1]  # a cut payload: said so, nothing raised
  own.close()
  with snapstore.SnapshotManager(opts(b, run_id="r", keep=1)) as mgr:
    r = mgr.restore(abstract())
  assert r.step == 2 and r.source is snapstore.Source.SNAPSHOT
  assert_bitwise_equal(host_copy(state_at(2)), r.state)
  held = dict(found)
  assert adopt.release(held, watermark=5) == []  # not sent home yet
  held[0].sent = True
  adopt.settle(held, restored=2)  # the restore after it chose step 2
  assert adopt.release(held, watermark=2) == []  # no newer step held by every store
  assert os.path.isdir(a / "r" / "host-0")
  assert adopt.release(held, watermark=3) == [0] and held == {}
  assert not os.path.exists(a / "r" / "host-0")


def test_an_adopted_store_someone_writes_to_is_let_go_not_deleted(tmp_path):
  """A process that could not claim its own store (an old one still held
  it) writes to it anyway: an adopter sees its PROGRESS move and keeps it."""
  with snapstore.SnapshotManager(opts(tmp_path, run_id="r", keep=1)) as mgr:
    mgr.save(1, state_at(1))
    mgr.wait_until_finished()
    held = adopt.adopt(tmp_path / "r", mine={5}, held={}, run_id="r", keep=1, refused=set())
    held[0].sent = True
    adopt.settle(held, restored=None)  # (restored from the persistent tier: floor -1)
    mgr.save(2, state_at(2))  # the live writer
    mgr.wait_until_finished()
    assert adopt.release(held, watermark=3) == [] and held == {}
  assert os.path.isdir(tmp_path / "r" / "host-0")
  assert adopt.unclaimed(tmp_path / "r", mine=set()) == [0]  # let go


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded")
@pytest.mark.filterwarnings("ignore:os.fork\\(\\) was called")
def test_a_forked_child_does_not_keep_a_lock(tmp_path):
  """A data loader forked from the trainer lives on after the trainer lets
  go of its store: the store is free (the child closed its copy at fork)."""
  (tmp_path / "host-0").mkdir()
  fd = adopt.lock(tmp_path / "host-0")
  pid = os.fork()
  if pid == 0:  # the child: alive while the parent lets go
    time.sleep(30)
    os._exit(0)
  try:
    adopt.unlock(fd)
    deadline = time.monotonic() + 10  # (the child closes its copy once it runs)
    while adopt.unclaimed(tmp_path, mine=set()) != [0] and time.monotonic() < deadline:
      time.sleep(0.05)
    assert adopt.unclaimed(tmp_path, mine=set()) == [0]
  finally:
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)


@pytest.mark.parametrize("at, n", [(0, 3), (2, 10), (7, 100), (40, 5)])
def test_chunks_of_the_segments_are_their_bytes_end_to_end(at, n):
  segments = [np.arange(5, dtype=np.uint8), np.arange(10, 30, dtype=np.uint8),
              np.arange(100, 120, dtype=np.uint8)]
  whole = np.concatenate(segments)
  assert adopt.chunk(segments, at, n).tobytes() == whole[at:at + n].tobytes()


def test_rounds_send_and_receive_one_store_each_at_most():
  moves = [(0, 1, 10), (0, 2, 10), (3, 1, 5), (2, 0, 7)]
  rounds = adopt._rounds(moves)
  assert sorted(m for r in rounds for m in r) == sorted(moves)
  for r in rounds:
    assert len({p for p, _, _ in r}) == len(r) == len({q for _, q, _ in r})


class _Group:
  """The collective of ``n`` threads, one a host: sums and permutes."""

  def __init__(self, n):
    self.n, self.put, self.out = n, {}, None
    self.barrier = threading.Barrier(n, action=self._combine)
    self.after = threading.Barrier(n)

  def _combine(self):
    kind = next(iter(self.put.values()))[0]
    if kind == "sum":
      self.out = np.sum([v for _, v in self.put.values()], axis=0, dtype=np.uint8)
    else:  # permute: receiver -> its sender's payload, zero-padded to the width
      pairs, width = next(iter(self.put.values()))[1][0], self.put[0][1][2]
      self.out = {}
      for src, dst in pairs:
        buf = np.zeros(width, np.uint8)
        payload = self.put[src][1][1]
        if payload is not None:
          buf[:payload.size] = payload
        self.out[dst] = buf
    self.put = {}

  def call(self, host, kind, value):
    self.put[host] = (kind, value)
    self.barrier.wait()
    out = self.out
    self.after.wait()
    return out


class _Fake:
  def __init__(self, group, host):
    self.group, self.host, self.num_hosts = group, host, group.n

  def sum_bytes(self, buf):
    return self.group.call(self.host, "sum", np.ascontiguousarray(buf).view(np.uint8)).copy()

  def permute(self, pairs, payload, width):
    got = self.group.call(self.host, "perm", (tuple(pairs), payload, width))
    return got.get(self.host)


def test_stores_found_on_other_machines_go_home_in_rounds_and_chunks(tmp_path, monkeypatch):
  """4 processes, host h now on machine h, which holds other indices' stores:
  machine 0 those of hosts 3 and 1 (two rounds: one sender, two stores),
  machine 1 host 0's and a stale copy of host 2's (step 1 only), machine 3
  host 2's. Chunks of 4 KiB, so each store takes several permutes. Every
  process ends with its own snapshots, bitwise; host 2 with the newer copy."""
  monkeypatch.setattr(adopt, "CHUNK_BYTES", 4096)
  src = tmp_path / "src"
  with snapstore.SnapshotManager(opts(src, run_id="r", keep=1)) as mgr:
    for step in (1, 2):
      mgr.save(step, state_at(step))
    mgr.wait_until_finished()
  base = HostStore(host_dir(src, "r", 0), run_id="r", host=0, keep=1, budget_bytes=None)
  machines = [tmp_path / f"m{m}" for m in range(4)]

  def make(m, q, steps):  # host q's store on machine m, relabelled from host 0's
    store = HostStore(host_dir(machines[m], "r", q), run_id="r", host=q, keep=1,
                      budget_bytes=None)
    for man in base.manifests():
      if man.step in steps:
        data = base.read_buffer(man.slot, adopt.slot_bytes(man))
        slot = store.reserve(man.step, data.nbytes)
        store.slot_buffer(slot)[:data.nbytes] = data
        store.commit(dataclasses.replace(man, store=q, slot=slot))
    store.close()
  make(0, 3, (1, 2))
  make(0, 1, (1, 2))
  make(1, 0, (1, 2))
  make(1, 2, (1,))  # stale
  make(3, 2, (1, 2))
  group, notes, owns = _Group(4), {}, {}

  errors = {}

  def host(h):
    try:
      run = machines[h] / "r"
      owns[h] = own = HostStore(run / f"host-{h}", run_id="r", host=h, keep=1,
                                budget_bytes=None)
      held = adopt.adopt(run, mine={h}, held={}, run_id="r", keep=1, refused=set())
      notes[h] = (sorted(held), adopt.repatriate(_Fake(group, h), own, held, "r", set()),
                  {q: a.sent for q, a in held.items()})
    except Exception as e:  # noqa: BLE001 - the others stop waiting for this one
      errors[h] = e
      group.barrier.abort()
      group.after.abort()
  threads = [threading.Thread(target=host, args=(h,)) for h in range(4)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(60)
  assert not errors, errors
  assert [notes[h][0] for h in range(4)] == [[1, 3], [0, 2], [], [2]]
  assert notes[1][2] == {0: True}  # (its stale copy of host 2's lost: let go)
  want = {m.step: base.read_buffer(m.slot, adopt.slot_bytes(m)).tobytes()
          for m in base.manifests()}
  for h, own in owns.items():
    got = {m.step: own.read_buffer(m.slot, adopt.slot_bytes(m)).tobytes()
           for m in own.manifests()}
    assert all(m.store == h for m in own.manifests())
    assert got == want, (h, sorted(got), notes[h])
