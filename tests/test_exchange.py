"""The multi-host exchange's sizes (its collectives run in tests/test_multihost.py)."""

from snapstore._multihost.exchange import bucket


def test_an_exchange_is_padded_to_one_of_few_sizes_and_at_most_an_eighth():
  seen = set()
  for n in range(0, 1 << 20, 97):
    b = bucket(n)
    assert n <= b <= max(4096, n + n // 8), (n, b)
    assert b % 512 == 0
    seen.add(b)
  # 8 sizes per doubling above 4 KiB: compiled once each, not once per size
  assert len(seen) <= 1 + 8 * 8, len(seen)
