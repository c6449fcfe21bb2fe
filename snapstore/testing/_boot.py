"""``python -m snapstore.testing._boot MODULE ARGS...``: runs ``python -m MODULE
ARGS...`` with every thread's Python stack written to stderr on ``SIGUSR1``
(the supervisor's stall watch asks for it, :mod:`.stall`), from the
process's first line, before the module imports anything."""

from __future__ import annotations

import faulthandler
import runpy
import signal
import sys


def main() -> None:
  if len(sys.argv) < 2:
    raise SystemExit("usage: python -m snapstore.testing._boot MODULE [ARGS...]")
  faulthandler.register(signal.SIGUSR1, all_threads=True)
  module = sys.argv[1]
  sys.argv = [module, *sys.argv[2:]]
  runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
  main()
