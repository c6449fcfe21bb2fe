"""snapstore._stream (a copy fused with its crc32c, streaming stores) and
``_checksum.copy_crc`` on it: the same bytes and the same checksums as numpy's
copy and the crc32c package, with or without the extension."""

from __future__ import annotations

import contextlib
import platform
import shutil
import sys
import threading

import crc32c
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from snapstore import HostFiles, SnapshotManager, SnapshotOptions, _checksum
from tests.helpers import assert_bitwise_equal, host_copy

SIZES = [0, 1, 7, 8, 9, 23, 24, 25, 255, 256, 257, 4095, 4096, 4097, 6143, 12288 + 23,
         65536 + 5, (1 << 20) + 13]


def _stream():
  mod = pytest.importorskip("snapstore._stream", reason="built without a C compiler")
  if not mod.FUSED:
    pytest.skip("no SSE4.2 here")
  return mod


def _sse42() -> bool:
  try:
    with open("/proc/cpuinfo") as f:
      return "sse4_2" in f.read()
  except OSError:
    return False


def test_the_extension_is_built_where_it_can_be():
  if platform.machine() not in ("x86_64", "AMD64") or not sys.platform.startswith("linux") \
      or shutil.which("cc") is None or not _sse42():
    pytest.skip("the fused copy is built on x86-64 Linux with SSE4.2 and a C compiler")
  # The build, not whether it is used: SNAPSTORE_FUSED_COPY=0 turns the copy
  # off (_checksum.FUSED), and the suite passes with it set either way.
  assert _checksum._stream is not None, "snapstore._stream did not build: copies go through numpy"
  assert _checksum._stream.FUSED, "snapstore._stream was built without its fused copy"


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dst_at,src_at", [(0, 0), (1, 0), (0, 3), (7, 5), (4, 4)])
@pytest.mark.parametrize("ndst", [1, 2, 3, 5])
def test_a_fused_copy_is_the_source_and_its_crc32c(n, dst_at, src_at, ndst):
  copy_crc32c = _stream().copy_crc32c
  rng = np.random.default_rng(n + 31 * dst_at + src_at)
  src = rng.integers(0, 256, n + src_at, dtype=np.uint8)[src_at:]
  seed = int(rng.integers(0, 1 << 32))
  bufs = [np.full(n + 64 + dst_at + k, 0xA5, np.uint8) for k in range(ndst)]
  dsts = [b[dst_at + k:dst_at + k + n] for k, b in enumerate(bufs)]
  assert copy_crc32c(seed, src, *dsts) == crc32c.crc32c(src, seed)
  for k, (b, d) in enumerate(zip(bufs, dsts, strict=True)):
    np.testing.assert_array_equal(d, src)
    lo = dst_at + k
    assert (b[:lo] == 0xA5).all() and (b[lo + n:] == 0xA5).all()  # nothing outside


def test_a_fused_copy_refuses_what_it_cannot_copy():
  copy_crc32c = _stream().copy_crc32c
  src = np.zeros(100, np.uint8)
  with pytest.raises(ValueError, match="a dst has 99 bytes, src 100"):
    copy_crc32c(0, src, np.zeros(100, np.uint8), np.zeros(99, np.uint8))
  frozen = np.zeros(100, np.uint8)
  frozen.flags.writeable = False
  with pytest.raises((BufferError, ValueError)):
    copy_crc32c(0, src, frozen)
  with pytest.raises((BufferError, ValueError)):
    copy_crc32c(0, src, np.zeros(200, np.uint8)[::2])
  both = np.zeros(200, np.uint8)
  with pytest.raises(ValueError, match="overlaps"):
    copy_crc32c(0, both[:100], both[50:150])
  with pytest.raises(ValueError, match="two dsts overlap"):
    copy_crc32c(0, src, both[:100], both[99:199])
  with pytest.raises(TypeError, match="Python objects"):  # references copied uncounted
    copy_crc32c(0, np.array([object()] * 4), np.empty(4, object))
  with pytest.raises(OverflowError):
    copy_crc32c(1 << 32, src, np.zeros(100, np.uint8))
  with pytest.raises(TypeError):
    copy_crc32c(0, src)
  with pytest.raises(TypeError):
    copy_crc32c(0, src, *[np.zeros(100, np.uint8) for _ in range(9)])


def test_a_fused_copy_takes_numpy_integers_for_the_crc():
  copy_crc32c = _stream().copy_crc32c
  src = np.arange(1000, dtype=np.uint16).view(np.uint8)
  want = crc32c.crc32c(src, 77)
  assert copy_crc32c(np.uint32(77), src, np.empty_like(src)) == want
  assert copy_crc32c(np.int64(77), src, np.empty_like(src)) == want


def test_a_fused_copy_of_over_one_and_a_half_gib_has_the_right_crc():
  """Its thirds then reach 2**29 bytes: joining their crcs needs x**(2**32)
  mod the polynomial, which zlib's table (built for CRC-32, whose powers
  repeat every 32) gets wrong for CRC-32C (every 31)."""
  copy_crc32c = _stream().copy_crc32c
  n = 3 * (1 << 29) + 4096 + 5
  src = np.zeros(n, np.uint8)  # (untouched pages: the zero page, no memory)
  src[[0, 1 << 29, n // 2, n - 1]] = [1, 2, 3, 4]
  dst = np.empty(n, np.uint8)
  got = copy_crc32c(9, src, dst)
  assert got == crc32c.crc32c(dst, 9) == crc32c.crc32c(src, 9)
  assert dst[n - 1] == 4


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "numpy"])
@pytest.mark.parametrize("n", [0, 5, 4096, _checksum.CACHE_BYTES, 3 * _checksum.CACHE_BYTES + 77])
@pytest.mark.parametrize("twins", [0, 2])
def test_copy_crc_checksums_the_bytes_it_copies(n, twins, fused, monkeypatch):
  if fused:
    _stream()
  else:
    monkeypatch.setattr(_checksum, "FUSED", False)
  src = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
  dst, *more = (np.zeros(n, np.uint8) for _ in range(1 + twins))
  assert _checksum.copy_crc(dst, src, 1234, more) == crc32c.crc32c(src, 1234)
  for out in (dst, *more):
    np.testing.assert_array_equal(out, src)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "numpy"])
def test_copy_crc_many_copies_and_checksums_each_part(fused, monkeypatch):
  """Parts of a run (odd sizes and places, empty ones, gaps left alone):
  each is copied to its place and gets the crc32c of its bytes from its
  own seed; nothing between them is written."""
  if fused:
    _stream()
  monkeypatch.setattr(_checksum, "FUSED", fused)
  rng = np.random.default_rng(5)
  src = rng.integers(0, 256, 300_000, dtype=np.uint8)
  dst = np.full_like(src, 0xA5)
  parts = [(0, 0), (0, 9), (16, 65536), (65600, 1), (65608, 100_000), (200_000, 99_999)]
  rows = [v for a, n in parts for v in (a, n, int(rng.integers(0, 1 << 32)))]
  crcs = _checksum.copy_crc_many(src, dst, rows)
  assert crcs == [crc32c.crc32c(src[a:a + n], seed)
                  for a, n, seed in zip(rows[::3], rows[1::3], rows[2::3], strict=True)]
  written = np.zeros(src.size, bool)
  for a, n in parts:
    written[a:a + n] = True
  np.testing.assert_array_equal(dst[written], src[written])
  assert (dst[~written] == 0xA5).all()


def test_copy_crc32c_many_refuses_bad_tables():
  many = _stream().copy_crc32c_many
  src, dst = np.zeros(100, np.uint8), np.zeros(100, np.uint8)
  crcs = np.zeros(1, np.uint32)
  ok = np.array([[0, 100, 0]], np.int64)
  many(src, dst, ok, crcs)
  for table, err in [
      (np.array([[1, 100, 0]], np.int64), ValueError),        # past the end
      (np.array([[-1, 10, 0]], np.int64), ValueError),        # before the start
      (np.array([[0, -1, 0]], np.int64), ValueError),         # negative length
      (np.array([[2**62, 2**62, 0]], np.int64), ValueError),  # overflowing sum
      (np.array([[0, 10, 2**32]], np.int64), OverflowError),  # seed not a uint32
      (np.array([[0, 10, -1]], np.int64), OverflowError),
      (np.array([[0, 10, 0]], np.int32), TypeError),          # not int64
      (np.array([0, 10], np.int64), TypeError)]:              # not rows of 3
    with pytest.raises(err):
      many(src, dst, table, crcs)
  with pytest.raises(TypeError):  # crcs of the wrong count or type
    many(src, dst, ok, np.zeros(2, np.uint32))
  with pytest.raises(TypeError):
    many(src, dst, ok, np.zeros(1, np.int64))
  with pytest.raises(ValueError):  # dst of another size
    many(src, np.zeros(99, np.uint8), ok, crcs)
  with pytest.raises(ValueError):  # dst overlapping src
    many(src[:60], src[40:], np.array([[0, 60, 0]], np.int64), crcs)
  frozen = np.zeros(100, np.uint8)
  frozen.flags.writeable = False
  with pytest.raises((BufferError, ValueError)):  # a read-only dst
    many(src, frozen, ok, crcs)
  with pytest.raises((BufferError, ValueError)):  # not contiguous
    many(src, np.zeros(200, np.uint8)[::2], ok, crcs)
  with pytest.raises(TypeError, match="Python objects"):
    many(np.array([object()] * 100), np.empty(100, object), ok, crcs)
  with pytest.raises(TypeError):
    many(src, dst, ok)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "numpy"])
def test_the_crc_is_of_the_bytes_written_while_the_source_changes(fused, monkeypatch):
  """Another thread rewrites the source during every copy (as another process
  may rewrite a slot a restore reads): the crc32c returned is always that
  of the bytes in the destination, never of bytes that were not copied."""
  if fused:
    _stream()
  else:
    monkeypatch.setattr(_checksum, "FUSED", False)
  n = 8 << 20
  src = np.zeros(n, np.uint8)
  dst = np.empty(n, np.uint8)
  with _scribbled(src, seed=0):
    for i in range(40 if fused else 4):  # (numpy's parts wait for the GIL the scribbler holds)
      assert _checksum.copy_crc(dst, src, i) == crc32c.crc32c(dst, i)


@contextlib.contextmanager
def _scribbled(src: np.ndarray, *, seed: int):
  """While the block runs, another thread flips 4 KiB of ``src`` at a time."""
  stop = threading.Event()

  def scribble():
    rng = np.random.default_rng(seed)
    while not stop.is_set():
      at = int(rng.integers(0, src.size - 4096))
      src[at:at + 4096] ^= 0xFF
  t = threading.Thread(target=scribble)
  t.start()
  try:
    yield
  finally:
    stop.set()
    t.join()


@pytest.mark.parametrize("ndst", [2, 3])
def test_every_destination_gets_the_bytes_checked_while_the_source_changes(ndst):
  """Two or more destinations (twins) pass through one bounce buffer: while
  another thread rewrites the source, every destination still gets the same
  bytes, and the crc32c returned is theirs."""
  copy_crc32c = _stream().copy_crc32c
  n = 8 << 20
  src = np.zeros(n + 64, np.uint8)[64 - 16:64 - 16 + n]  # (a page offset JAX's buffers have)
  dsts = [np.empty(n, np.uint8) for _ in range(ndst)]
  with _scribbled(src, seed=1):
    for i in range(20):
      crc = copy_crc32c(i, src, *dsts)
      assert crc == crc32c.crc32c(dsts[0], i)
      for d in dsts[1:]:
        assert np.array_equal(d, dsts[0])


@pytest.mark.parametrize("src_page_at", [0, 64, 4032])
def test_two_destinations_copy_exactly_at_the_page_offsets_that_alias(src_page_at):
  """The page offsets where streaming two destinations straight from the
  source ran 50x slower (4K aliasing; see ``three_n`` in _stream.c): the
  copy through the bounce buffer is exact there too."""
  copy_crc32c = _stream().copy_crc32c
  n = 1 << 20
  raw = np.random.default_rng(src_page_at).integers(0, 256, n + 8192, dtype=np.uint8)
  base = (-raw.ctypes.data) % 4096
  src = raw[base + src_page_at: base + src_page_at + n]
  bufs = [np.zeros(n + 8192, np.uint8) for _ in range(2)]
  dsts = [b[(-b.ctypes.data) % 4096:][:n] for b in bufs]
  assert copy_crc32c(5, src, *dsts) == crc32c.crc32c(src, 5)
  for d in dsts:
    np.testing.assert_array_equal(d, src)


def _state(step: int):
  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("replica", "model"))
  put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
  # big pieces (a twin in the other slice) and small ones (copied in runs)
  return {"big": put(jnp.arange(2 << 20, dtype=jnp.float32).reshape(512, 4096) * step,
                     P(None, "model")),
          "small": put(jnp.arange(8 * 64, dtype=jnp.int32).reshape(8, 64) + step,
                       P("replica", "model"))}


def test_saves_with_and_without_the_fused_copy_store_the_same_checksums(tmp_path,
                                                                        monkeypatch):
  """The same state saved and restored with the fused copy and with numpy's:
  the same checksums in every manifest, and each restores bitwise."""
  _stream()
  devs = jax.devices()
  checksums = {}
  for fused in (True, False):
    monkeypatch.setattr(_checksum, "FUSED", fused)
    state = _state(3)
    mgr = SnapshotManager(SnapshotOptions(store=HostFiles(dir=tmp_path / str(fused)),
                                          run_id="s"),
                          slices={0: devs[:4], 1: devs[4:]})
    try:
      assert mgr.save(3, state)
      mgr.wait_until_finished()
      checksums[fused] = {
          sid: sorted((p.leaf, p.index, p.checksum) for m in store.manifests() for p in m.pieces)
          for sid, store in mgr._backend.stores.items()}
      abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                             sharding=x.sharding), state)
      got = mgr.restore(abstract)
      assert got.step == 3
      assert_bitwise_equal(host_copy(got.state), host_copy(state))
    finally:
      mgr.close()
  assert checksums[True] == checksums[False]
  assert all(checksums[True].values())


def test_copy_crc32c_gather_refuses_bad_sources_and_tables():
  gather = _stream().copy_crc32c_gather
  dst = np.zeros(100, np.uint8)
  crcs = np.zeros(2, np.uint32)
  srcs = [np.ones(40, np.uint8), np.ones(60, np.uint8)]
  ok = np.array([[0, 7], [40, 9]], np.int64)
  gather(dst, ok, crcs, srcs)
  assert crcs.tolist() == [crc32c.crc32c(srcs[0], 7), crc32c.crc32c(srcs[1], 9)]
  assert (dst == 1).all()
  for table, err in [
      (np.array([[0, 0], [41, 0]], np.int64), ValueError),    # the second past the end
      (np.array([[-1, 0], [40, 0]], np.int64), ValueError),   # before the start
      (np.array([[0, 2**32], [40, 0]], np.int64), OverflowError),
      (np.array([[0, 0], [40, 0]], np.int32), TypeError),     # not int64
      (np.array([[0, 0, 0], [40, 0, 0]], np.int64), TypeError)]:  # rows of 3
    with pytest.raises(err):
      gather(dst, table, crcs, srcs)
  with pytest.raises(ValueError):  # a source for each row
    gather(dst, ok, crcs, srcs[:1])
  with pytest.raises(ValueError):  # a source overlapping dst
    gather(dst, ok, crcs, [srcs[0], dst[:60]])
  with pytest.raises(TypeError, match="Python objects"):
    gather(dst, ok, crcs, [srcs[0], np.array([object()] * 60)])
  with pytest.raises((BufferError, ValueError)):  # not contiguous
    gather(dst, ok, crcs, [srcs[0], np.ones(120, np.uint8)[::2]])
  with pytest.raises(TypeError):
    gather(dst, ok, crcs, 5)
  with pytest.raises(ValueError):  # crcs overlapping dst
    gather(dst, np.array([[0, 0]], np.int64), dst[:4].view(np.uint32), [srcs[0][:4]])


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "numpy"])
def test_copy_crc_gather_copies_and_checksums_each_source(fused, monkeypatch):
  if fused:
    _stream()
  monkeypatch.setattr(_checksum, "FUSED", fused)
  rng = np.random.default_rng(11)
  sizes = [0, 3, 4096, 65536 + 7, 100]
  srcs = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
  dst = np.full(200_000, 0xA5, np.uint8)
  parts, at = [], 5
  for src in srcs:
    parts.append((src, at, int(rng.integers(0, 1 << 32))))
    at += src.nbytes + 11  # gaps between them stay untouched
  crcs = _checksum.copy_crc_gather(dst, parts)
  assert crcs == [crc32c.crc32c(src, seed) for src, _, seed in parts]
  written = np.zeros(dst.size, bool)
  for src, a, _ in parts:
    np.testing.assert_array_equal(dst[a:a + src.nbytes], src)
    written[a:a + src.nbytes] = True
  assert (dst[~written] == 0xA5).all()


def test_a_row_cannot_change_between_its_check_and_its_copy():
  """Found by a red team: the rows were checked, then read again from the
  caller's table, which the copy itself (a table inside dst), a source's
  buffer export, or another thread could rewrite in between, so a row
  that passed could write past dst. Now they are checked and used from a
  private copy: nothing is written outside dst."""
  many, gather = _stream().copy_crc32c_many, _stream().copy_crc32c_gather
  n = 4096
  big, srcbig = np.zeros(2 * n, np.uint8), np.zeros(2 * n, np.uint8)
  dst, src = big[:n], srcbig[:n]
  srcbig[n + 100:n + 108] = 0xEE
  table = big[:48].view(np.int64).reshape(2, 3)  # inside dst
  table[0], table[1] = (24, 24, 0), (0, 0, 0)    # row 0 copies over row 1
  src[24:48].view(np.int64)[:] = (n + 100, 8, 0)
  many(src, dst, table, np.zeros(2, np.uint32))
  assert not big[n:].any(), "written past dst"
  rows = big[:32].view(np.int64).reshape(2, 2)
  rows[0], rows[1] = (16, 0), (0, 0)  # source 0 lands on row 1
  gather(dst, rows, np.zeros(2, np.uint32),
         [np.array([n + 100, 0], np.int64).view(np.uint8), np.full(8, 0xEE, np.uint8)])
  assert not big[n:].any(), "written past dst"


@pytest.mark.skipif(sys.version_info < (3, 12), reason="__buffer__ is Python 3.12's")
def test_a_source_whose_export_runs_python_cannot_move_rows_or_sources():
  gather = _stream().copy_crc32c_gather
  n = 4096
  big = np.zeros(2 * n, np.uint8)
  dst = big[:n]
  table = np.array([(0, 0), (8, 0)], np.int64)
  srcs: list = []

  class Rewrites:
    def __buffer__(self, flags):
      table[0, 0] = n + 100  # row 0's place, after it would have been checked
      srcs.clear()           # and the list of sources
      return memoryview(bytearray(8))
  srcs += [np.full(8, 0xEE, np.uint8), Rewrites()]
  crcs = np.zeros(2, np.uint32)
  gather(dst, table, crcs, srcs)
  assert not big[n:].any(), "written past dst"
  assert (dst[:8] == 0xEE).all() and crcs[0] == crc32c.crc32c(bytes([0xEE] * 8), 0)
