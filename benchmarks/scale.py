"""A restore's metadata cost per host against the job's host count N.

``python -m benchmarks.scale`` (JSON to stdout and ``--out``, a PNG with
``--plot``): one host's view of an N-host multi-controller job, N = 8 ...
16,384, through snapstore's own restore decision (:mod:`snapstore._multihost.agree`,
:mod:`snapstore._multihost.sparse`: records, needs, holders, rows, the transfer
rounds), with only the collective replaced by an in-process stand-in.

The stand-in (:mod:`snapstore.testing.lockstep`; the job's layout and
manifests: :mod:`snapstore.testing.job_layout`, shared with the sparse
restore's tests) runs the hosts that matter to a case in lockstep threads
(the host measured, the lost hosts, their ring neighbours, one bystander), each
with its own manifests built as a host-files drain builds them, and hands
every one what the real collective would: the gathered records of every
host, the needs and rows of every host, the element-wise minimum. Every
other host is a bystander whose contribution is known without running it:
the same records as any live host (one step pair, one digest), no needs, no
rows, and no holder that beats a neighbour (it holds only its own pieces,
which no lost host needs, and replicated leaves, which the needer's nearer
neighbours hold too). Bytes per host are the buffers the real collective
(:class:`snapstore._multihost.collective.JaxCollective`) would put in and get back.

Not simulated: reading the stores and the point-to-point moves themselves
(their cost is the state bytes a host receives, reported), and JAX's own
per-collective latency.

Each row also times what every *save* adds at that size: the retention
watermark's one reduction (:mod:`snapstore._watermark`), built from the
host's own manifests: ``save_agreement_cpu_s_max`` and its bytes,
``save_agreement_payload``.

State: a MaxText-like unscanned llama (500 leaves: 165 params, Adam mu/nu,
step, count, rng, two scalars), every array FSDP-sharded over all 4N devices
(4 a host), keep=2, one failure domain a host. Cases: ``none`` (nothing
lost), ``one`` (one host lost with its store: its replacement restores),
``two`` (two ring neighbours lost: no step is recoverable, the persistent
tier); for ``replicas=1`` and ``parity k=3``. ``--before N`` also times the
full manifest exchange (every host's manifests gathered, decoded and
planned, as before the sparse path) up to N hosts, in the same run.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import tracemalloc
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from snapstore.testing.job_layout import LOCAL, STEPS, FakeDevice, Layout, targets_of
from snapstore.testing.lockstep import SimCollective, lockstep


# --------------------------------------------------------------- one case
def restore_decision(coll: SimCollective, layout: Layout, manifests: list[Any]) -> dict:
  """What :meth:`snapstore._multihost.peers.Distributed.restore` runs before it reads
  a store: records, maxima, candidates, then the plan of each candidate."""
  from snapstore._multihost import agree, moves, sparse
  from snapstore._switch import collections_paused
  t = time.thread_time()
  with collections_paused(True):
    agree.max64(coll, (STEPS[-1], 0, 1))
    out: dict[str, Any] = {"verdict": "persistent"}
    targets = targets_of(layout, coll.host)
    for cand in agree.candidates(coll, manifests):
      got = sparse.plan(coll, sparse.manifests_at(manifests, cand), cand, layout.specs,
                         targets)
      if isinstance(got, sparse.Lost):
        continue
      if isinstance(got, sparse.Fallback):
        out = {"verdict": "fallback", "why": got.why}
        break
      sent, received = moves.bytes_moved(got, coll.host)
      out = {"verdict": "snapshot", "step": cand.step, "state_sent": sent,
             "state_received": received, "rounds": len(moves.rounds(got))}
      break
  out["cpu_s"] = time.thread_time() - t
  out["payload_sent"], out["payload_received"] = coll.traffic.sent, coll.traffic.received
  out["collectives"] = coll.traffic.calls
  return out


def save_agreement(coll: SimCollective, manifests: list[Any]) -> dict:
  """What every save runs before it evicts anything (:mod:`snapstore._watermark`):
  this host's record from its own manifests, one minimum, the watermark."""
  from snapstore import _watermark
  t = time.thread_time()
  now = STEPS[-1] + 1
  rec = _watermark.record(now, sorted({m.step for m in manifests}), STEPS[0])
  mark = _watermark.settle(now, coll.reduce_min(rec))
  return {"cpu_s": time.thread_time() - t, "payload": coll.traffic.received,
          "watermark": mark}


def run_case(n: int, case: str, redundancy: str) -> dict:
  layout = Layout(n)
  parity = redundancy == "parity"
  lost = {"none": [], "one": [n // 2], "two": [n // 2, n // 2 + 1]}[case]
  hosts = sorted({0, *lost, *[(h + k) % n for h in lost or [0] for k in (1, 2, 3)]})
  stores = {h: [] if h in lost else [layout.manifest(h, s, i, parity=parity)
                                     for i, s in enumerate(STEPS)] for h in hosts}
  tracemalloc.start()
  try:
    results = dict(zip(hosts, lockstep(n, hosts, lambda coll: restore_decision(
        coll, layout, stores[coll.host])), strict=True))
    peak = tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
  worst = max(results.values(), key=lambda r: r["cpu_s"])
  saves = lockstep(n, hosts, lambda coll: save_agreement(coll, stores[coll.host]))
  return {"n": n, "case": case, "redundancy": redundancy, "hosts_run": hosts,
          # every save: the retention watermark's one reduction (before the loss)
          "save_agreement_cpu_s_max": round(max(r["cpu_s"] for r in saves), 6),
          "save_agreement_payload": max(r["payload"] for r in saves),
          "verdict": results[hosts[0]]["verdict"],
          "why": results[hosts[0]].get("why"),
          "cpu_s_max": round(worst["cpu_s"], 4),
          "payload_received_max": max(r["payload_received"] for r in results.values()),
          "payload_sent_max": max(r["payload_sent"] for r in results.values()),
          "collectives": worst["collectives"],
          "peak_mb_all_hosts_run": round(peak / 2**20, 1),
          "state_received": {h: r.get("state_received", 0) for h, r in results.items()},
          "state_share_bytes": sum(
              math.prod(b - a for a, b in layout.index(leaf, LOCAL * (n // 2) + j)) * 4
              for leaf in layout.arrays() for j in range(LOCAL))}


# ------------------------------------------------------------- the before
def before(n: int) -> dict:
  """The full exchange, timed as one host runs it: every host's manifests
  gathered (the all-reduce faked by what it returns), decoded, planned for
  one host lost, and the lost pieces found (:func:`exchange.missing_pieces`)."""
  import msgpack

  from snapstore import _planner
  from snapstore._manifest import encode
  from snapstore._multihost import exchange
  from snapstore._switch import collections_paused
  layout = Layout(n)
  lost = n // 2
  blobs = [msgpack.packb([[encode(layout.manifest(h, s, i, parity=False))
                           for i, s in enumerate(STEPS)], [STEPS[-1], 0, 1]])
           if h != lost else msgpack.packb([[], [STEPS[-1], 0, 1]]) for h in range(n)]
  calls = []

  def fake_sum(contribution: np.ndarray) -> np.ndarray:
    if not calls:
      calls.append(1)
      return np.array([len(b) for b in blobs], np.int64).view(np.uint8)
    size = contribution.size // n
    out = np.zeros(contribution.size, np.uint8)
    for i, b in enumerate(blobs):
      out[i * size:i * size + len(b)] = np.frombuffer(b, np.uint8)
    return out
  import jax
  saved = (exchange._sum, jax.process_count, jax.process_index)
  exchange._sum, jax.process_count, jax.process_index = fake_sum, (lambda: n), (lambda: 0)
  tracemalloc.start()
  t = time.process_time()
  try:
    local = [m for m in (layout.manifest(0, s, i, parity=False) for i, s in enumerate(STEPS))]
    manifests, _ = exchange.gather_manifests(local, (STEPS[-1], 0, 1))
    with collections_paused(True):
      plan = _planner.choose(manifests)
      devices = [FakeDevice(i) for i in range(LOCAL * n)]
      for leaf in layout.arrays():
        exchange.missing_pieces(plan, leaf, _FullSharding(layout, devices, layout.axes[leaf]),
                                 tuple(layout.specs[leaf].shape))
    cpu = time.process_time() - t
  finally:
    exchange._sum, jax.process_count, jax.process_index = saved
  peak = tracemalloc.get_traced_memory()[1]
  tracemalloc.stop()
  return {"n": n, "cpu_s": round(cpu, 3), "peak_mb": round(peak / 2**20, 1),
          "payload_received": exchange.bucket(n * max(len(b) for b in blobs))}


class _FullSharding:
  def __init__(self, layout: Layout, devices: list[FakeDevice], axis: int | None):
    self.layout, self.devices, self.axis = layout, devices, axis

  def devices_indices_map(self, shape: tuple[int, ...]) -> dict[Any, Any]:
    k = shape[self.axis] // len(self.devices) if self.axis is not None else 0
    return {d: tuple(slice(i * k, (i + 1) * k) if a == self.axis else slice(None)
                     for a in range(len(shape))) for i, d in enumerate(self.devices)}


# ------------------------------------------------------------------ driver
def fit(points: dict[int, float], lo: int, hi: int) -> float | None:
  pts = [(math.log(n), math.log(v)) for n, v in points.items() if lo <= n <= hi and v > 0]
  if len(pts) < 2:
    return None
  mx = sum(p[0] for p in pts) / len(pts)
  my = sum(p[1] for p in pts) / len(pts)
  return round(sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts), 3)


def main(argv: Sequence[str] | None = None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--sizes", type=int, nargs="*", default=[8, 64, 256, 1024, 4096, 16384])
  ap.add_argument("--cases", nargs="*", default=["none", "one", "two"])
  ap.add_argument("--redundancy", nargs="*", default=["replicas", "parity"])
  ap.add_argument("--before", type=int, default=0,
                  help="also time the full exchange up to this many hosts")
  ap.add_argument("--out", type=Path, default=Path("bench-results/scale.json"))
  ap.add_argument("--plot", type=Path)
  args = ap.parse_args(argv)
  rows = []
  for red in args.redundancy:
    for case in args.cases:
      for n in args.sizes:
        rows.append(run_case(n, case, red))
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "state_received"}),
              file=sys.stderr, flush=True)
  befores = [before(n) for n in args.sizes if n <= args.before]
  growth = {}
  for red in args.redundancy:
    for case in args.cases:
      mine = [r for r in rows if r["redundancy"] == red and r["case"] == case]
      growth[f"{red}/{case}"] = {
          "cpu": fit({r["n"]: r["cpu_s_max"] for r in mine}, 1024, 16384),
          "memory": fit({r["n"]: r["peak_mb_all_hosts_run"] for r in mine}, 1024, 16384),
          "payload": fit({r["n"]: r["payload_received_max"] for r in mine}, 1024, 16384)}
  ratios = {}
  for b in befores:
    now = next((r for r in rows if r["n"] == b["n"] and r["case"] == "one"
                and r["redundancy"] == "replicas"), None)
    if now is not None:
      ratios[b["n"]] = {"cpu_before_over_after": round(b["cpu_s"] / max(now["cpu_s_max"], 1e-9), 1),
                        "payload_before_over_after": round(
                            b["payload_received"] / max(now["payload_received_max"], 1), 1)}
  result = {"rows": rows, "before": befores, "before_over_after": ratios,
            "growth_exponent_1024_16384": growth}
  text = json.dumps(result, indent=1)
  print(text)
  if args.out:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
  if args.plot:
    _plot(result, args.plot)
  return result


def _plot(result: dict, path: Path) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
  for key in sorted({(r["redundancy"], r["case"]) for r in result["rows"]}):
    mine = [r for r in result["rows"] if (r["redundancy"], r["case"]) == key]
    ns = [r["n"] for r in mine]
    a.loglog(ns, [r["cpu_s_max"] for r in mine], "o-", label="/".join(key))
    b.loglog(ns, [r["payload_received_max"] for r in mine], "o-", label="/".join(key))
  if result["before"]:
    ns = [x["n"] for x in result["before"]]
    a.loglog(ns, [x["cpu_s"] for x in result["before"]], "k--", label="full exchange")
    b.loglog(ns, [x["payload_received"] for x in result["before"]], "k--",
             label="full exchange")
  a.set(xlabel="hosts", ylabel="CPU s a host (decision + plan)")
  b.set(xlabel="hosts", ylabel="collective bytes a host receives")
  a.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


if __name__ == "__main__":
  main()
