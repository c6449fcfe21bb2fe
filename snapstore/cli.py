"""The snapstore command line: ``demo``, ``launch``, ``inspect``, ``capacity``, ``bench``.

Plain-text output; ``demo`` (the ``[demo]`` extra) draws with rich. The
library itself never configures logging: this does.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import re
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from . import _faults


class _Stopped(BaseException):
  """A stop signal, raised on the main thread so that every ``finally``
  runs: the supervisor then kills the job's processes (``launch``)."""

  def __init__(self, signum: int) -> None:
    super().__init__(signum)
    self.signum = signum


def _raise_stopped(signum: int, frame: Any) -> None:
  raise _Stopped(signum)


def _demo(args: argparse.Namespace) -> int:
  try:
    from .demo.cli import run
  except ImportError as e:
    print(f"snapstore demo needs the demo extra ({e.name or e} is missing): "
          "pip install 'snapstore[demo]' (from a checkout: pip install -e '.[demo]')",
          file=sys.stderr)
    return 1
  return run(args)


def _inspect(args: argparse.Namespace) -> int:
  from ._inspect import inspect_store
  try:
    report = inspect_store(args.store, run_id=args.run_id, verify=args.verify)
  except OSError as e:
    print(f"snapstore inspect: cannot read {args.store}: {e}", file=sys.stderr)
    return 1
  print(json.dumps(report, indent=2))
  return 0


def _capacity(args: argparse.Namespace) -> int:
  from .capacity import from_size, staging_hbm
  state = int(args.params * args.bytes_per_param)
  try:
    needs = from_size(state, hosts=args.hosts, hosts_per_domain=args.hosts_per_domain,
                      data_parallel=args.data_parallel, keep=args.keep)
    hbm = staging_hbm(needs[0].own, args.chips_per_host)
  except ValueError as e:
    print(f"snapstore capacity: {e}", file=sys.stderr)
    return 2
  if args.json:
    print(json.dumps({"state_bytes": state, "hosts": args.hosts, "keep": args.keep,
                      "ram_bytes": int(args.ram_gb * 1e9), "chips_per_host": args.chips_per_host,
                      "staging_hbm_bytes_per_chip": hbm,
                      "options": [p.as_dict() for p in needs]}, indent=2))
    return 0
  gb = lambda n: f"{n / 1e9:,.2f}"  # noqa: E731
  ram = args.ram_gb * 1e9
  rows = [[p.option, gb(p.own), gb(p.extra) if p.possible else "n/a", p.snapshots,
           gb(p.total) if p.possible else "n/a",
           f"{p.total / ram:.0%}" if p.possible else "-"] for p in needs]
  print(_table(f"snapstore capacity: {args.params:.3g} params x {args.bytes_per_param:g} B "
               f"= {gb(state)} GB over {args.hosts} hosts (domains of {args.hosts_per_domain}, "
               f"{args.data_parallel} data-parallel cop{'y' if args.data_parallel == 1 else 'ies'}"
               f"), keep={args.keep}; GB per host",
               ["redundancy", "own/snapshot", "extra/snapshot", "snapshots held",
                "total", f"of {args.ram_gb:g} GB RAM"], rows))
  print(f"HBM a save stages on each of {args.chips_per_host} chips a host: {gb(hbm)} GB (with "
        "less free HBM, or a smaller staging_budget_bytes, the rest is copied to host before "
        "save returns, at the link's speed)")
  return 0


def _bench(args: argparse.Namespace) -> int:
  if Path("benchmarks", "__init__.py").exists() and "" not in sys.path:
    sys.path.insert(0, "")  # the console script does not see the current folder
  try:
    mod = importlib.import_module(f"benchmarks.{args.name}")
  except ModuleNotFoundError as e:
    print(f"no benchmark {args.name!r} ({e}); run from the repository root", file=sys.stderr)
    return 1
  rc = mod.main(args.rest)
  return rc if isinstance(rc, int) else 0  # (some return their result for the tests)


def _parse_kill(text: str) -> Any:
  """``HOST@STEP[:PHASE][+lose][/INCARNATION]`` -> Kill."""
  from .testing import Kill
  m = re.fullmatch(r"(\d+)@(-?\d+)(?::(\w+))?(\+lose)?(?:/(\d+))?", text)
  if not m:
    raise argparse.ArgumentTypeError(
        f"--kill {text!r}: expected HOST@STEP[:PHASE][+lose][/INCARNATION], e.g. 1@37+lose")
  try:
    return Kill(host=int(m[1]), step=int(m[2]), phase=m[3], lose_store=bool(m[4]),
                incarnation=int(m[5] or 0))
  except ValueError as e:
    raise argparse.ArgumentTypeError(str(e)) from e


def _table(title: str, header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
  """A plain-text table (the core CLI has no dependency beyond the engine's)."""
  widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
  line = lambda r: "  ".join(str(c).rjust(w) for c, w in zip(r, widths, strict=True))  # noqa: E731
  return "\n".join([title, line(header), line(["-" * w for w in widths]),
                    *[line(r) for r in rows]])


def _parse_machines(text: str) -> list[int]:
  try:
    return [int(x) for x in text.split(",")]
  except ValueError:
    raise argparse.ArgumentTypeError(
        f"--machines {text!r}: expected machine numbers, one a host, e.g. 1,2,3,0") from None


def _launch(args: argparse.Namespace) -> int:
  from .testing import StallPolicy, launch
  cmd = list(args.command)
  if cmd and cmd[0] == "--":
    cmd = cmd[1:]
  if not cmd:
    print("snapstore launch: name a module to run, e.g. "
          "snapstore launch -- snapstore.demo.worker --steps 20 ...")
    return 2
  try:
    incs = launch(cmd[0], cmd[1:], num_hosts=args.hosts, devices_per_host=args.devices_per_host,
                  store_dir=args.store_dir, run_id=args.run_id, kills=args.kill,
                  shrink_to=args.shrink_to, max_incarnations=args.max_incarnations,
                  timeout_s=args.timeout, log_dir=args.log_dir,
                  bind_address=args.bind_address, in_place=args.in_place,
                  min_hosts=args.min_hosts, replacement_delay_s=args.replacement_delay,
                  stall=StallPolicy(period_s=args.stall_s), machines=args.machines)
  except (RuntimeError, TimeoutError, ValueError) as e:
    print(f"snapstore launch: {e}", file=sys.stderr)
    return 1
  rows = []
  for inc in incs:
    r = inc.restore or {}
    rows.append([inc.number, inc.num_hosts, f"{inc.ended - inc.started:.1f}",
                 inc.failure or "-", r.get("step", "-"), r.get("source", "-"),
                 r.get("rewind_steps", "-"),
                 ",".join(str(x["host"]) for x in inc.replaced) or "-"])
    if inc.fallback:
      print(f"incarnation {inc.number}: full restart: {inc.fallback}")
  print(_table(f"snapstore launch: {cmd[0]} on {args.hosts} hosts",
               ["incarnation", "hosts", "seconds", "failure", "restored step", "source",
                "rewind", "replaced in place"], rows))
  if args.json:
    Path(args.json).write_text(json.dumps([i.as_dict() for i in incs], indent=2))
    print(f"report: {args.json}")
  return 0


def _add_launch(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
  """The ``launch`` command's arguments."""
  la = sub.add_parser("launch", help="run a training module on N local host processes, "
                      "restart it on failure, inject SIGKILLs")
  la.add_argument("--hosts", type=int, default=4)
  la.add_argument("--devices-per-host", type=int, default=2)
  la.add_argument("--store-dir", default="/dev/shm/snapstore")
  la.add_argument("--run-id", default="job")
  la.add_argument("--kill", type=_parse_kill, action="append", default=[],
                  help="HOST@STEP[:PHASE][+lose][/INCARNATION]; PHASE one of "
                  f"{', '.join(_faults.PHASES)}; +lose wipes the host's store")
  la.add_argument("--shrink-to", type=int, default=None, help="restart on fewer hosts")
  la.add_argument("--max-incarnations", type=int, default=3)
  la.add_argument("--timeout", type=float, default=600.0)
  la.add_argument("--log-dir", default=None)
  la.add_argument("--bind-address", default="127.0.0.1",
                  help="where the JAX coordination service listens (loopback by default; "
                       "a cluster-facing address for real clusters)")
  la.add_argument("--in-place", action="store_true",
                  help="survivors keep running; only a dead host is restarted "
                  "(snapstore.recovery; the worker must use recovery.InPlace)")
  la.add_argument("--min-hosts", type=int, default=None,
                  help="with --in-place: go on while at least N hosts are live, without "
                  "waiting for a replacement, and grow back when it joins")
  la.add_argument("--replacement-delay", type=float, default=0.0, metavar="S",
                  help="start a dead host's replacement S seconds later (no spare host at "
                  "once); without --in-place, the restarted job waits that long")
  la.add_argument("--stall-s", type=float, default=None, metavar="S",
                  help="stop the job when every process is alive and no host advanced a "
                  "step for S seconds, after writing each process's Python stacks into its "
                  "log (default: max(60 s, 20 x the median step); 120 s after a process "
                  "started or exited)")
  la.add_argument("--machines", type=_parse_machines, nargs="+", default=None,
                  metavar="M0,M1,...",
                  help="give each host a machine directory STORE_DIR/machine-<M> ({machine} "
                  "in the module's args); one placement per incarnation (the last repeats), "
                  "e.g. 0,1,2,3 1,2,3,0: the restart gives every process another index's "
                  "machine; a +lose kill then loses the host's machine")
  la.add_argument("--json", default=None, help="write the incarnation report here")
  la.add_argument("command", nargs=argparse.REMAINDER, help="-- MODULE ARGS...")
  la.set_defaults(fn=_launch)


def _add_capacity(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
  """The ``capacity`` command's arguments."""
  pl = sub.add_parser("capacity", help="host RAM per redundancy option (replicas, parity) "
                      "for a state of a given size, before a run")
  pl.add_argument("--params", type=float, required=True, help="parameters, e.g. 175e9")
  pl.add_argument("--bytes-per-param", type=float, default=14.0,
                  help="train-state bytes per parameter (bf16 params + fp32 master and "
                  "two Adam moments: 14)")
  pl.add_argument("--hosts", type=int, required=True)
  pl.add_argument("--hosts-per-domain", type=int, default=1)
  pl.add_argument("--data-parallel", type=int, default=1,
                  help="full copies of the state across failure domains (their pieces "
                  "need no extra bytes)")
  pl.add_argument("--keep", type=int, default=2)
  pl.add_argument("--ram-gb", type=float, default=448.0, help="host RAM (TPU v5p: 448)")
  pl.add_argument("--chips-per-host", type=int, default=4,
                  help="accelerators a host (TPU v5p: 4; v5e: 1, 4 or 8): the HBM a save stages")
  pl.add_argument("--json", action="store_true")
  pl.set_defaults(fn=_capacity)


def main(argv: Sequence[str] | None = None) -> int:
  p = argparse.ArgumentParser(
      prog="snapstore", description="Per-step in-RAM snapshots of JAX train state.")
  p.add_argument("-v", "--verbose", action="store_true", help="log at INFO")
  sub = p.add_subparsers(dest="cmd", required=True)
  d = sub.add_parser("demo", help="SIGKILL a host of a 4-process job; recover from RAM "
                     "snapshots vs GCS only")
  d.add_argument("--kill-step", type=int, default=58)
  d.add_argument("--checkpoint-every", type=int, default=30)
  d.add_argument("--total-steps", type=int, default=62)
  d.add_argument("--step-s", type=float, default=0.3,
                 help="pad each step to this long (a sleep standing for accelerator "
                      "compute; the toy model's own step is shorter)")
  d.add_argument("--replica-interval", type=int, default=2,
                 help="cross-domain replicas travel with every this-many-th snapshot "
                      "(1: every one; the killed host's store is wiped, so its rewind "
                      "is up to this many steps)")
  d.add_argument("--persistent-dir", default=None,
                 help="Orbax directory (default: gs:// on a local GCS emulator)")
  d.add_argument("--runs", type=int, default=1, metavar="N",
                 help="run the three-way comparison N times; the table and ratios give "
                      "medians (and min-max) over the rounds")
  d.add_argument("--report", default="demo-report.json")
  d.add_argument("--plot", default="demo-timeline.png")
  d.set_defaults(fn=_demo)
  i = sub.add_parser("inspect", help="what a store (<store_dir>/<run_id>) holds: each "
                     "manifest's verdict, the lineage, what restore would pick")
  i.add_argument("store")
  i.add_argument("--run-id", default=None, help="default: the store folder's name")
  i.add_argument("--verify", action="store_true", help="re-check every piece's crc32c")
  i.set_defaults(fn=_inspect)
  _add_launch(sub)
  _add_capacity(sub)
  b = sub.add_parser("bench", help="run benchmarks/NAME.py (from the repository root)")
  b.add_argument("name")
  b.add_argument("rest", nargs=argparse.REMAINDER)
  b.set_defaults(fn=_bench)
  args = p.parse_args(argv)
  logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                      format="%(levelname)s %(name)s: %(message)s")
  for stop in (signal.SIGTERM, signal.SIGHUP):
    if signal.getsignal(stop) is not signal.SIG_IGN:  # (nohup and the like: left alone)
      signal.signal(stop, _raise_stopped)
  try:
    return args.fn(args)
  except (KeyboardInterrupt, _Stopped) as e:
    signum = e.signum if isinstance(e, _Stopped) else int(signal.SIGINT)
    print(f"snapstore {args.cmd}: stopped by {signal.Signals(signum).name}; every process it "
          "started was stopped", file=sys.stderr)
    return 128 + signum
