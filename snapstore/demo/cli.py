"""The ``snapstore demo`` front end: progress bars and the recovery table (rich)."""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from rich.console import Console
from rich.progress import Progress, TaskID
from rich.table import Table

from .run import HOSTS, KILLED_HOST, run_demo


def run(args: argparse.Namespace) -> int:
  """``snapstore demo``: runs :func:`.run.run_demo` with rich progress and tables."""
  console = Console()
  console.print(f"[bold]snapstore demo[/]: a small transformer on {HOSTS} local host "
                f"processes (jax.distributed, 2 CPU devices each), snapshot every step, "
                f"replicas every {args.replica_interval}, Orbax every {args.checkpoint_every} "
                f"steps on "
                f"{args.persistent_dir or 'a local GCS emulator'}; SIGKILL host "
                f"{KILLED_HOST} at step {args.kill_step} and replace it. Three runs: "
                "GCS only (full restart), snapstore (full restart), snapstore in place "
                "(survivors keep running)")
  with Progress(console=console) as bar:
    tasks: dict[tuple[str, int], TaskID] = {}

    def progress(run: str, step: int, i: int) -> None:
      if (run, i) not in tasks:
        label = f"{run} ({i + 1}/{args.runs})" if args.runs > 1 else run
        tasks[run, i] = bar.add_task(label, total=args.total_steps)
      bar.update(tasks[run, i], completed=step)

    try:
      out = run_demo(kill_step=args.kill_step, checkpoint_every=args.checkpoint_every,
                     total_steps=args.total_steps, step_s=args.step_s,
                     replica_interval=args.replica_interval,
                     persistent_dir=args.persistent_dir, rounds=args.runs,
                     report=args.report, plot=args.plot, progress=progress)
    except (RuntimeError, OSError, ValueError, TimeoutError) as e:
      console.print(f"[red]demo failed:[/] {e}")
      return 1
  console.print(_table(args, out))
  summary = out["summary"]

  def figure(key: str, name: str, fmt: str) -> str:
    v = summary[key][name]
    if args.runs == 1:
      return fmt.format(v["median"])
    return f"{fmt.format(v['median'])} ({fmt.format(v['min'])}-{fmt.format(v['max'])})"

  over = "median (min-max) of " + f"{args.runs} rounds" if args.runs > 1 else "one round"
  ratios = ", ".join(f"{n} {figure('kill_to_first_new_step_vs_gcs_only', n, '{:.2f}')}x"
                     for n in out["runs"])
  console.print(f"kill -> first new step vs GCS only ({over}): {ratios}")
  by_run = ", ".join(f"{n} {figure('step_overhead_vs_gcs_only', n, '{:+.1%}')}"
                     for n in out["snapshot_overhead_by_run"])
  console.print(f"per-step overhead (median step vs the GCS-only run): {by_run}; steps "
                f"padded to {args.step_s} s; 4 processes share this machine's cores: "
                "expect noise; in place adds a barrier per step")
  console.print(f"final states bitwise equal: {out['final_states_equal']}")
  console.print(f"report: {out['report']}\ntimeline: {out['plot']}")
  return 0 if out["final_states_equal"] else 2


ROWS = [("kill -> first new step (s)", "kill_to_first_new_step_s", "{:.2f}"),
        ("wall time to the final step (s)", "wall_to_final_step_s", "{:.2f}"),
        ("rewind (steps recomputed)", "rewind_steps", "{}"),
        ("state bytes read from GCS", "bytes_read_gcs", "{:,}"),
        ("median step before the kill (ms)", "step_s", "{:.1f}"),
        ("processes restarted", "processes_restarted", "{}"),
        ("restored step", "restored_step", "{}"), ("source", "source", "{}"),
        ("detection (s)", "detection_s", "{:.2f}"),
        ("restart, or wait for the replacement (s)", "restart_s", "{:.2f}"),
        ("restore (s)", "restore_s", "{:.2f}"),
        ("first step after restore, warm-up (s)", "first_step_s", "{:.2f}"),
        ("replay of the other lost steps (s)", "replay_s", "{:.2f}"),
        ("bytes read from host RAM (host 0)", "bytes_read_ram", "{:,}"),
        ("bytes moved between hosts", "bytes_exchanged", "{:,}")]


def _table(args: argparse.Namespace, out: dict[str, Any]) -> Table:
  """The recovery table: one round's figures, or with ``--runs N`` each
  figure's median over the rounds (the range in the summary line)."""
  rounds = out["rounds"]
  title = f"SIGKILL host {KILLED_HOST} at step {args.kill_step}: recovery"
  if len(rounds) > 1:
    title += f" (medians of {len(rounds)} rounds)"
  table = Table(title=title)
  table.add_column("")
  for run in out["runs"]:
    table.add_column(run, justify="right")
  for label, key, fmt in ROWS:
    cells = []
    for run in out["runs"]:
      vals = [r["runs"][run][key] * (1e3 if key == "step_s" else 1) for r in rounds]
      if isinstance(vals[0], str) or len(vals) == 1:
        cells.append(fmt.format(vals[0]) if len(set(map(str, vals))) == 1 else "mixed")
      else:
        cells.append(fmt.format(type(vals[0])(statistics.median(vals))))
    table.add_row(label, *cells)
  return table
