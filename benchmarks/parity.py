"""Parity vs replica snapshots on a 4-host job: RAM per host, bytes moved per
snapshot, per-step overhead, restore of a lost host, side by side.

``python -m benchmarks.parity --mb 256``: 4 local host processes
(``snapstore launch``, ``jax.distributed`` on CPU with gloo, 2 devices each),
each its own failure domain; the state is ``--mb`` MB of float32 leaves
sharded over all 8 devices (no data-parallel twin: every byte needs
redundancy). In the same processes, blocks of steps without snapshots, with
``replicas=1`` and with ``redundancy="parity"`` (k = 3) alternate (best of
``--rounds``). RAM is measured from the stores (slot files); then host 1's
store is wiped and every host restores the newest step: replicas, or a
parity rebuild (median of ``--repeats``), checked bitwise. All four
processes share this machine's cores: the ratios are the result. Also
prints ``snapstore plan`` for a TPU v5p-sized job (175B params, 14 bytes a
param, 1,024 hosts).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from pathlib import Path

from benchmarks._common import cleanup, emit, ram_dir


def run(mb: int, steps: int, rounds: int, repeats: int, k: int, step_s: float) -> dict:
  from snapstore.launch import launch  # noqa: PLC0415
  work = ram_dir("snapstore-parity-bench-")
  root = str(Path(__file__).resolve().parents[1])
  env = {"PYTHONPATH": os.pathsep.join(
      [root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
  try:
    out = work / "result.json"
    launch("benchmarks._parity_worker",
           ["--mb", str(mb), "--steps", str(steps), "--rounds", str(rounds),
            "--repeats", str(repeats), "--parity-k", str(k), "--step-s", str(step_s),
            "--out", str(out), "--store", str(work / "store")],
           num_hosts=4, devices_per_host=2, store_dir=work / "store", run_id="parity",
           max_incarnations=1, timeout_s=1200, log_dir=work, env=env)
    return json.loads(out.read_text())
  except RuntimeError as e:
    logs = "".join(p.read_text()[-2000:] for p in sorted(work.glob("inc0-host*.log")))
    raise RuntimeError(f"{e}\n{logs}") from e
  finally:
    cleanup(work)


def v5p_plan() -> dict:
  from snapstore.plan import from_size  # noqa: PLC0415
  state = int(175e9 * 14)
  return {"params": 175e9, "bytes_per_param": 14, "hosts": 1024, "keep": 2,
          "ram_bytes_per_host": 448 * 10**9,
          "plans": [p.as_dict() for p in from_size(state, hosts=1024, keep=2)]}


def main(argv: Sequence[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog="benchmarks.parity", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--mb", type=int, default=256)
  p.add_argument("--steps", type=int, default=6)
  p.add_argument("--rounds", type=int, default=2)
  p.add_argument("--repeats", type=int, default=2)
  p.add_argument("--parity-k", type=int, default=3)
  p.add_argument("--step-s", type=float, default=0.5,
                 help="step time: the state update, padded with a sleep that stands "
                      "for accelerator compute (host cores free)")
  p.add_argument("--out", default="bench-results/parity.json")
  args = p.parse_args(argv)
  result = run(args.mb, args.steps, args.rounds, args.repeats, args.parity_k, args.step_s)
  emit("parity", dict(result, v5p_plan=v5p_plan()), args.out)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
