"""A launch worker that reports where the coordination service listens
(``tests/test_launch.py``): host 0 lists the local addresses of the sockets
listening on the coordinator's port, from /proc/net/tcp."""

import json
import os
import sys

from snapstore.testing import init_from_env


def _v4(word: str) -> str:
  return ".".join(str(int(word[i:i + 2], 16)) for i in (6, 4, 2, 0))


def listening(port: int) -> list[str]:
  """Local addresses listening on ``port`` (IPv4-mapped IPv6 shown as IPv4,
  the IPv6 wildcard as '::')."""
  out = []
  for table in ("/proc/net/tcp", "/proc/net/tcp6"):
    with open(table) as f:
      for line in f.readlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        addr, p = local.split(":")
        if int(p, 16) != port or state != "0A":  # LISTEN
          continue
        if len(addr) == 8:
          out.append(_v4(addr))
        elif addr.startswith("0000000000000000FFFF0000"):
          out.append(_v4(addr[24:]))
        else:
          out.append("::" if set(addr) == {"0"} else addr)
  return sorted(out)


if __name__ == "__main__":
  host, _, _ = init_from_env()
  if host == 0:
    port = int(os.environ["SNAPSTORE_COORDINATOR"].rsplit(":", 1)[1])
    with open(sys.argv[1], "w") as f:
      json.dump(listening(port), f)
