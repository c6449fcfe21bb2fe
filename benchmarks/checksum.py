"""The pinned-host store's two integrity checks, side by side on one shard.

``python -m benchmarks.checksum --mb 64``: bytes per second of crc32c on the
host buffer (``PinnedHost(checksum=PinnedChecksum.HOST)``) and of snapstore's on-device sum
computed by XLA (``DEVICE``), on a CPU device, each as a ratio to a
single-thread memcpy measured in the same process. On CPU devices ``AUTO``
picks the host crc32c; this is why. (On TPU the device sum runs in HBM and
the host copy is not addressable by the controller, so the choice flips.)
"""

from __future__ import annotations

from collections.abc import Sequence

from benchmarks._common import median_seconds, memcpy_bandwidth, sized_main


def run(mb: int, repeats: int) -> dict:
  import crc32c
  import jax
  import numpy as np

  from snapstore._checksum import device_checksum
  nbytes = mb << 20
  host = np.random.default_rng(0).standard_normal(nbytes // 4).astype(np.float32)
  dev = jax.device_put(host, jax.devices()[0])
  device_checksum(dev).block_until_ready()  # compile
  crc_s = median_seconds(lambda: crc32c.crc32c(host), repeats)
  dev_s = median_seconds(lambda: device_checksum(dev).block_until_ready(), repeats)
  memcpy = memcpy_bandwidth(nbytes, repeats)
  bps = {"memcpy": memcpy, "host_crc32c": nbytes / crc_s, "device_sum": nbytes / dev_s}
  return {"shard_mb": mb, "bytes_per_s": bps,
          "ratio_to_memcpy": {k: v / memcpy for k, v in bps.items() if k != "memcpy"},
          "device_sum_over_host_crc32c_s": dev_s / crc_s}


def main(argv: Sequence[str] | None = None) -> int:
  return sized_main("checksum", __doc__, run, argv)


if __name__ == "__main__":
  raise SystemExit(main())
