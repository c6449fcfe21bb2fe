"""The snapstore command line (placeholder until the demo lands)."""
from __future__ import annotations
import argparse
def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="snapstore")
  p.parse_args(argv)
  return 0
