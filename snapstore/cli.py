"""The snapstore command line: ``demo``, ``inspect``, ``bench``.

Output goes through rich; the library itself never configures logging.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
from collections.abc import Sequence


def _demo(args: argparse.Namespace) -> int:
  import jax  # noqa: PLC0415
  jax.config.update("jax_platforms", "cpu")
  jax.config.update("jax_num_cpu_devices", 8)
  from rich.console import Console  # noqa: PLC0415
  from rich.progress import Progress  # noqa: PLC0415
  from rich.table import Table  # noqa: PLC0415

  from ._demo import run_demo  # noqa: PLC0415
  console = Console()
  console.print(f"[bold]snapstore demo[/]: tiny transformer on {jax.device_count()} CPU "
                f"devices, snapshot every step, Orbax every {args.checkpoint_every} "
                f"steps, live state lost at step {args.kill_step}")
  with Progress(console=console, transient=True) as bar:
    tasks = {}

    def progress(run: str, step: int) -> None:
      if run not in tasks:
        tasks[run] = bar.add_task(run, total=args.total_steps)
      bar.update(tasks[run], completed=step)

    try:
      out = run_demo(kill_step=args.kill_step, checkpoint_every=args.checkpoint_every,
                     total_steps=args.total_steps, persistent_dir=args.persistent_dir,
                     report=args.report, plot=args.plot, progress=progress)
    except (RuntimeError, OSError, ValueError) as e:
      console.print(f"[red]demo failed:[/] {e}")
      return 1
  table = Table(title=f"recovery from a failure at step {args.kill_step}")
  table.add_column("")
  for run in out["runs"]:
    table.add_column(run, justify="right")
  rows = [("restored step", "restored_step", "{}"), ("source", "source", "{}"),
          ("rewind (steps recomputed)", "rewind_steps", "{}"),
          ("restore (s)", "restore_s", "{:.3f}"), ("recompute (s)", "recompute_s", "{:.3f}"),
          ("recovery total (s)", "recovery_s", "{:.3f}"),
          ("bytes read from GCS", "bytes_read_gcs", "{:,}"),
          ("bytes read from RAM", "bytes_read_ram", "{:,}")]
  for label, key, fmt in rows:
    table.add_row(label, *[fmt.format(r[key]) for r in out["runs"].values()])
  console.print(table)
  console.print(f"per-step time with snapshots {out['step_s_with_snapshots'] * 1e3:.2f} ms, "
                f"without {out['step_s_without'] * 1e3:.2f} ms "
                f"(overhead {out['snapshot_overhead']:+.1%}; state {out['state_bytes']:,} bytes)")
  console.print(f"final states bitwise equal: {out['final_states_equal']}")
  console.print(f"report: {out['report']}\ntimeline: {out['plot']}")
  return 0 if out["final_states_equal"] else 2


def _inspect(args: argparse.Namespace) -> int:
  from ._hoststore import HostStore  # noqa: PLC0415
  from pathlib import Path  # noqa: PLC0415
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
  try:
    mod = importlib.import_module(f"benchmarks.{args.name}")
  except ModuleNotFoundError as e:
    print(f"no benchmark {args.name!r} ({e}); run from the repository root", file=sys.stderr)
    return 1
  return mod.main(args.rest)


def main(argv: Sequence[str] | None = None) -> int:
  p = argparse.ArgumentParser(
      prog="snapstore", description="Per-step in-RAM snapshots of JAX train state.")
  p.add_argument("-v", "--verbose", action="store_true", help="log at INFO")
  sub = p.add_subparsers(dest="cmd", required=True)
  d = sub.add_parser("demo", help="lose the live state, recover from RAM vs GCS only")
  d.add_argument("--kill-step", type=int, default=37)
  d.add_argument("--checkpoint-every", type=int, default=20)
  d.add_argument("--total-steps", type=int, default=50)
  d.add_argument("--persistent-dir", default=None,
                 help="Orbax directory (default: gs:// on a local GCS emulator)")
  d.add_argument("--report", default="demo-report.json")
  d.add_argument("--plot", default="demo-timeline.png")
  d.set_defaults(fn=_demo)
  i = sub.add_parser("inspect", help="list the snapshots in a store (<store_dir>/<run_id>)")
  i.add_argument("store")
  i.add_argument("--run-id", default=None)
  i.set_defaults(fn=_inspect)
  b = sub.add_parser("bench", help="run benchmarks/NAME.py (from the repository root)")
  b.add_argument("name")
  b.add_argument("rest", nargs=argparse.REMAINDER)
  b.set_defaults(fn=_bench)
  args = p.parse_args(argv)
  logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                      format="%(levelname)s %(name)s: %(message)s")
  return args.fn(args)
