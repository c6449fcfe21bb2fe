"""snapstore._stream (a copy with streaming stores) and a save's copy that
uses it (``_checksum.stream_crc``): the same bytes and the same checksums as
numpy's copy, with or without the extension."""

from __future__ import annotations

import platform
import shutil
import sys

import crc32c
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from snapstore import SnapshotManager, SnapshotOptions, StoreKind, _checksum
from snapstore._backends.hostfiles import capture as hostfiles_capture
from tests.helpers import assert_bitwise_equal, host_copy

SIZES = [0, 1, 15, 16, 17, 63, 64, 65, 4095, 4096, 4097, 4096 + 63, 65536 + 5, (1 << 20) + 13]


def _stream():
  return pytest.importorskip("snapstore._stream", reason="built without a C compiler")


def test_the_extension_is_built_where_it_can_be():
  if platform.machine() not in ("x86_64", "AMD64") or not sys.platform.startswith("linux") \
      or shutil.which("cc") is None:
    pytest.skip("streaming copies are built on x86-64 Linux with a C compiler")
  assert _checksum.STREAMING, "snapstore._stream did not build: saves copy with numpy"
  assert _checksum.stream_copy is _stream().copy


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dst_at,src_at", [(0, 0), (1, 0), (0, 3), (7, 5), (15, 8)])
def test_a_stream_copy_is_the_source_at_any_size_and_alignment(n, dst_at, src_at):
  copy = _stream().copy
  rng = np.random.default_rng(n + 31 * dst_at + src_at)
  src = rng.integers(0, 256, n + src_at, dtype=np.uint8)[src_at:]
  dst = np.full(n + dst_at + 64, 0xA5, np.uint8)
  copy(dst[dst_at:dst_at + n], src)
  np.testing.assert_array_equal(dst[dst_at:dst_at + n], src)
  assert (dst[:dst_at] == 0xA5).all() and (dst[dst_at + n:] == 0xA5).all()  # nothing outside


def test_an_overlapping_stream_copy_moves_like_memmove():
  copy = _stream().copy
  for shift in (1, 64, 5000):
    a = np.arange(1 << 16, dtype=np.uint32).view(np.uint8)
    want = a.copy()
    want[shift:] = a[:-shift]
    copy(a[shift:], a[:-shift])
    np.testing.assert_array_equal(a, want)


def test_a_stream_copy_refuses_what_it_cannot_copy():
  copy = _stream().copy
  src = np.zeros(100, np.uint8)
  with pytest.raises(ValueError, match="dst has 99 bytes, src 100"):
    copy(np.zeros(99, np.uint8), src)
  frozen = np.zeros(100, np.uint8)
  frozen.flags.writeable = False
  with pytest.raises((BufferError, ValueError)):
    copy(frozen, src)
  with pytest.raises((BufferError, ValueError)):
    copy(np.zeros(200, np.uint8)[::2], src)
  with pytest.raises(TypeError):
    copy(np.zeros(100, np.uint8))


@pytest.mark.parametrize("streaming", [True, False], ids=["streaming", "numpy"])
@pytest.mark.parametrize("n", [0, 5, 4096, _checksum.STREAM_PART, 3 * _checksum.STREAM_PART + 77])
@pytest.mark.parametrize("twins", [0, 2])
def test_a_saves_copy_checksums_the_bytes_it_copies(n, twins, streaming, monkeypatch):
  if streaming:
    _stream()
  else:
    monkeypatch.setattr(_checksum, "STREAMING", False)
  src = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
  dst, *more = (np.zeros(n, np.uint8) for _ in range(1 + twins))
  got = _checksum.stream_crc(dst, src, 1234, more)
  assert got == crc32c.crc32c(src, 1234)
  for out in (dst, *more):
    np.testing.assert_array_equal(out, src)


def _state(step: int):
  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("replica", "model"))
  put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
  # big pieces (several stream parts, a twin in the other slice) and small ones
  return {"big": put(jnp.arange(2 << 20, dtype=jnp.float32).reshape(512, 4096) * step,
                     P(None, "model")),
          "small": put(jnp.arange(8 * 64, dtype=jnp.int32).reshape(8, 64) + step,
                       P("replica", "model"))}


def test_saves_with_and_without_streaming_store_the_same_checksums(tmp_path, monkeypatch):
  """The same state saved with streaming copies and with numpy's: the same
  checksums in every manifest, and each restores bitwise."""
  _stream()
  devs = jax.devices()
  checksums = {}
  for streaming in (True, False):
    if not streaming:
      monkeypatch.setattr(_checksum, "STREAMING", False)
      monkeypatch.setattr(hostfiles_capture, "STREAMING", False)
      monkeypatch.setattr(hostfiles_capture, "stream_copy", np.copyto)
    state = _state(3)
    mgr = SnapshotManager(SnapshotOptions(store=StoreKind.HOST_FILES,
                                          store_dir=tmp_path / str(streaming), run_id="s"),
                          slices={0: devs[:4], 1: devs[4:]})
    try:
      assert mgr.save(3, state)
      mgr.wait_until_finished()
      checksums[streaming] = {
          sid: sorted((p.leaf, p.index, p.checksum) for m in store.manifests() for p in m.pieces)
          for sid, store in mgr.backend.stores.items()}
      abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                             sharding=x.sharding), state)
      got = mgr.restore(abstract)
      assert got.step == 3
      assert_bitwise_equal(host_copy(got.state), host_copy(state))
    finally:
      mgr.close()
  assert checksums[True] == checksums[False]
  assert all(checksums[True].values())
