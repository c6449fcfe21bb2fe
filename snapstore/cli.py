"""The snapstore command line: ``demo``, ``launch``, ``inspect``, ``bench``.

Output goes through rich; the library itself never configures logging.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def _demo(args: argparse.Namespace) -> int:
  from rich.console import Console  # noqa: PLC0415
  from rich.progress import Progress  # noqa: PLC0415
  from rich.table import Table  # noqa: PLC0415

  from ._demo import HOSTS, KILLED_HOST, run_demo  # noqa: PLC0415
  console = Console()
  console.print(f"[bold]snapstore demo[/]: a small transformer on {HOSTS} local host "
                f"processes (jax.distributed, 2 CPU devices each), snapshot every step, "
                f"Orbax every {args.checkpoint_every} steps on "
                f"{args.persistent_dir or 'a local GCS emulator'}; SIGKILL host "
                f"{KILLED_HOST} at step {args.kill_step} and replace it; then the same "
                "with GCS only")
  with Progress(console=console) as bar:
    tasks: dict[str, int] = {}

    def progress(run: str, step: int) -> None:
      if run not in tasks:
        tasks[run] = bar.add_task(run, total=args.total_steps)
      bar.update(tasks[run], completed=step)

    try:
      out = run_demo(kill_step=args.kill_step, checkpoint_every=args.checkpoint_every,
                     total_steps=args.total_steps, step_s=args.step_s,
                     persistent_dir=args.persistent_dir,
                     report=args.report, plot=args.plot, progress=progress)
    except (RuntimeError, OSError, ValueError, TimeoutError) as e:
      console.print(f"[red]demo failed:[/] {e}")
      return 1
  table = Table(title=f"SIGKILL host {KILLED_HOST} at step {args.kill_step}: recovery")
  table.add_column("")
  for run in out["runs"]:
    table.add_column(run, justify="right")
  rows = [("restored step", "restored_step", "{}"), ("source", "source", "{}"),
          ("rewind (steps recomputed)", "rewind_steps", "{}"),
          ("detection (s)", "detection_s", "{:.2f}"),
          ("restart: processes, jax, model (s)", "restart_s", "{:.2f}"),
          ("restore (s)", "restore_s", "{:.2f}"),
          ("first step after restore, warm-up (s)", "first_step_s", "{:.2f}"),
          ("replay of the other lost steps (s)", "replay_s", "{:.2f}"),
          ("kill -> first new step (s)", "kill_to_first_new_step_s", "{:.2f}"),
          ("state bytes read from GCS", "bytes_read_gcs", "{:,}"),
          ("bytes read from host RAM (host 0)", "bytes_read_ram", "{:,}"),
          ("bytes moved between hosts (host 0)", "bytes_exchanged", "{:,}"),
          ("median step before the kill (ms)", "step_s", "{:.1f}")]
  for label, key, fmt in rows:
    vals = [r[key] * (1e3 if key == "step_s" else 1) for r in out["runs"].values()]
    table.add_row(label, *[fmt.format(v) for v in vals])
  console.print(table)
  console.print(f"per-step snapshot overhead: {out['snapshot_overhead']:+.1%} "
                f"(median step with snapshots vs the GCS-only run; steps padded to "
                f"{args.step_s} s; 4 processes share this machine's cores: expect noise)")
  console.print(f"final states bitwise equal: {out['final_states_equal']}")
  console.print(f"report: {out['report']}\ntimeline: {out['plot']}")
  return 0 if out["final_states_equal"] else 2


def _inspect(args: argparse.Namespace) -> int:
  from ._hoststore import HostStore  # noqa: PLC0415
  root = Path(args.store)
  rows = []
  for host_root in sorted(root.glob("host-*")) or [root]:
    host = int(host_root.name.split("-")[1]) if host_root.name.startswith("host-") else 0
    store = HostStore(host_root, run_id=args.run_id or root.name, host=host, keep=1,
                      budget_bytes=None)
    for m in store.manifests():
      rows.append({"host": host, "step": m.step, "incarnation": m.incarnation,
                   "slot": m.slot, "pieces": len(m.pieces), "bytes": m.data_bytes,
                   "leaves": len(m.leaves), "tree_digest": m.tree_digest})
  print(json.dumps(rows, indent=2))
  return 0


def _bench(args: argparse.Namespace) -> int:
  if Path("benchmarks", "__init__.py").exists() and "" not in sys.path:
    sys.path.insert(0, "")  # the console script does not see the current folder
  try:
    mod = importlib.import_module(f"benchmarks.{args.name}")
  except ModuleNotFoundError as e:
    print(f"no benchmark {args.name!r} ({e}); run from the repository root", file=sys.stderr)
    return 1
  return mod.main(args.rest)


def _parse_kill(text: str) -> Any:
  """``HOST@STEP[:PHASE][+lose][/INCARNATION]`` -> Kill."""
  from .launch import Kill  # noqa: PLC0415
  m = re.fullmatch(r"(\d+)@(-?\d+)(?::(\w+))?(\+lose)?(?:/(\d+))?", text)
  if not m:
    raise argparse.ArgumentTypeError(
        f"--kill {text!r}: expected HOST@STEP[:PHASE][+lose][/INCARNATION], e.g. 1@37+lose")
  try:
    return Kill(host=int(m[1]), step=int(m[2]), phase=m[3], lose_store=bool(m[4]),
                incarnation=int(m[5] or 0))
  except ValueError as e:
    raise argparse.ArgumentTypeError(str(e)) from e


def _launch(args: argparse.Namespace) -> int:
  from rich.console import Console  # noqa: PLC0415
  from rich.table import Table  # noqa: PLC0415

  from .launch import launch  # noqa: PLC0415
  console = Console()
  cmd = list(args.command)
  if cmd and cmd[0] == "--":
    cmd = cmd[1:]
  if not cmd:
    console.print("[red]snapstore launch: name a module to run, e.g. "
                  "snapstore launch -- snapstore._worker --steps 20 ...[/]")
    return 2
  try:
    incs = launch(cmd[0], cmd[1:], num_hosts=args.hosts, devices_per_host=args.devices_per_host,
                  store_dir=args.store_dir, run_id=args.run_id, kills=args.kill,
                  shrink_to=args.shrink_to, max_incarnations=args.max_incarnations,
                  timeout_s=args.timeout, log_dir=args.log_dir)
  except (RuntimeError, TimeoutError) as e:
    console.print(f"[red]{e}[/]")
    return 1
  table = Table(title=f"snapstore launch: {cmd[0]} on {args.hosts} hosts")
  for col in ("incarnation", "hosts", "seconds", "failure", "restored step", "source",
              "rewind"):
    table.add_column(col)
  for inc in incs:
    r = inc.restore or {}
    table.add_row(str(inc.number), str(inc.num_hosts), f"{inc.ended - inc.started:.1f}",
                  inc.failure or "-", str(r.get("step", "-")), r.get("source", "-"),
                  str(r.get("rewind_steps", "-")))
  console.print(table)
  if args.json:
    Path(args.json).write_text(json.dumps([i.as_dict() for i in incs], indent=2))
    console.print(f"report: {args.json}")
  return 0


def main(argv: Sequence[str] | None = None) -> int:
  p = argparse.ArgumentParser(
      prog="snapstore", description="Per-step in-RAM snapshots of JAX train state.")
  p.add_argument("-v", "--verbose", action="store_true", help="log at INFO")
  sub = p.add_subparsers(dest="cmd", required=True)
  d = sub.add_parser("demo", help="SIGKILL a host of a 4-process job; recover from RAM "
                     "snapshots vs GCS only")
  d.add_argument("--kill-step", type=int, default=37)
  d.add_argument("--checkpoint-every", type=int, default=20)
  d.add_argument("--total-steps", type=int, default=45)
  d.add_argument("--step-s", type=float, default=0.3,
                 help="pad each step to this long (a sleep standing for accelerator "
                      "compute; the toy model's own step is ~0.1 s)")
  d.add_argument("--persistent-dir", default=None,
                 help="Orbax directory (default: gs:// on a local GCS emulator)")
  d.add_argument("--report", default="demo-report.json")
  d.add_argument("--plot", default="demo-timeline.png")
  d.set_defaults(fn=_demo)
  i = sub.add_parser("inspect", help="list the snapshots in a store (<store_dir>/<run_id>)")
  i.add_argument("store")
  i.add_argument("--run-id", default=None)
  i.set_defaults(fn=_inspect)
  la = sub.add_parser("launch", help="run a training module on N local host processes, "
                      "restart it on failure, inject SIGKILLs")
  la.add_argument("--hosts", type=int, default=4)
  la.add_argument("--devices-per-host", type=int, default=2)
  la.add_argument("--store-dir", default="/dev/shm/snapstore")
  la.add_argument("--run-id", default="job")
  la.add_argument("--kill", type=_parse_kill, action="append", default=[],
                  help="HOST@STEP[:PHASE][+lose][/INCARNATION]; PHASE one of capture, "
                  "replica, manifest, restore; +lose wipes the host's store")
  la.add_argument("--shrink-to", type=int, default=None, help="restart on fewer hosts")
  la.add_argument("--max-incarnations", type=int, default=3)
  la.add_argument("--timeout", type=float, default=600.0)
  la.add_argument("--log-dir", default=None)
  la.add_argument("--json", default=None, help="write the incarnation report here")
  la.add_argument("command", nargs=argparse.REMAINDER, help="-- MODULE ARGS...")
  la.set_defaults(fn=_launch)
  b = sub.add_parser("bench", help="run benchmarks/NAME.py (from the repository root)")
  b.add_argument("name")
  b.add_argument("rest", nargs=argparse.REMAINDER)
  b.set_defaults(fn=_bench)
  args = p.parse_args(argv)
  logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                      format="%(levelname)s %(name)s: %(message)s")
  return args.fn(args)
