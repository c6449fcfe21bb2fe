"""Soak: one job, N seeded faults, and how many recoveries were correct.

``python -m benchmarks.soak --kills 20`` (``--kills 50`` for the full run):
the demo's model on ``--hosts`` local processes (``snapstore launch``,
``jax.distributed`` on CPU, one failure domain per host, replicas=1, keep=2,
Orbax every 10 steps on a local dir as the fallback). Each incarnation is
killed once: a host drawn at random, at a phase drawn at random (by the
supervisor mid-step, or by the process itself inside a snapshot's capture,
replica transfer, drain or manifest commit, or inside the next incarnation's
restore), half the time with its RAM store wiped (a replaced machine).

Every incarnation reports the global state's digest at its restored step
and at every step after (``snapstore launch`` collects them). A recovery is
*correct* when every digest of the incarnation that followed it equals an
uninterrupted run's at the same step; *partial* when the restored step's
digest differs (a mixed or wrong state was restored); *interrupted* when the
incarnation was killed before it reported any digest (a kill inside its own
restore): the next incarnation's recovery is the one that counts. The result: the
fraction correct (goal 1.0; the anchor's soak recovered ~73%), the rewinds,
the sources, the partial restores.

``--in-place`` (4 hosts by default): the job recovers in place
(:mod:`snapstore.recovery`, the supervisor hosting the coordination
service), and ``--faults`` draws each fault's kind: ``kill`` (a SIGKILL by
the supervisor a random fraction of a step after the host reports its
step, or by the process itself inside capture, replica transfer, drain or
manifest commit), ``stop`` (SIGSTOP, never resumed: the survivors must see it gone
and the supervisor fence it) or ``wipe`` (a kill with the host's RAM store
lost). With probability ``--second-fault``, the replacement is SIGKILLed
again inside the restore that heals the first fault. One fault every
``GAP`` steps. Per fault: whether every digest host 0 reported around it
equals the uninterrupted run's (bitwise), whether it healed in place or
needed a full restart (on CPU, gloo's communicators cap the heals of one
incarnation: see ``snapstore/_group.py``), and the time it cost: the wall
clock from the step before it to ``GAP - 1`` steps after it, less those
steps at the uninterrupted run's median step time. The result: the fraction
recovered bitwise, in place vs full restarts, and the time lost (p50, p95,
max) by kind.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks._common import cleanup, demo_job, emit, ram_dir, step_intervals

PHASES = (None, None, "capture", "replica", "drain", "manifest", "restore")
GAP = 3  # steps between kills
KINDS = ("kill", "stop", "wipe")
# in place: where a kill lands
KILL_PHASES = (None, None, "capture", "replica", "drain", "manifest")
FIRST = 6  # the first in-place fault's step: the job compiled, snapshots in every store
ARGS = ["--checkpoint-every", "10", "--hosts-per-domain", "1", "--digest-every-step",
        "--min-step-s", "0.05"]


def _job(work: Path, name: str, hosts: int, steps: int, kills: list, env: dict) -> list:
  incs, _ = demo_job(work, name, steps, ["--persistent", str(work / f"ckpt-{name}"), *ARGS],
                     num_hosts=hosts, kills=kills, timeout_s=300 + 60 * len(kills), env=env)
  return incs


def draw_kills(n: int, hosts: int, rng: random.Random) -> list:
  from snapstore.testing import Kill
  out = []
  for i in range(n):
    phase = rng.choice(PHASES) if i else rng.choice(PHASES[:-1])  # nothing to restore yet
    step = -1 if phase == "restore" else 3 + GAP * (i + 1)
    out.append(Kill(host=rng.randrange(hosts), step=step, incarnation=i, phase=phase,
                    lose_store=rng.random() < 0.5))
  return out


def run(kills: int, hosts: int, seed: int) -> dict:
  work = ram_dir("snapstore-soak-")
  env = {"JAX_COMPILATION_CACHE_DIR": str(work / "jax-cache"),
         "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
  plan = draw_kills(kills, hosts, random.Random(seed))
  steps = 3 + GAP * (kills + 1) + 2
  try:
    (ref,) = _job(work, "reference", hosts, steps, [], env)
    want = ref.digests
    incs = _job(work, "soak", hosts, steps, plan, env)
  finally:
    cleanup(work)
  recoveries = []
  for inc in incs[1:]:
    r = inc.restore or {}
    restored = r.get("step")
    if inc.killed and not inc.digests:  # killed inside its restore: the next one counts
      recoveries.append({"incarnation": inc.number, "interrupted": True,
                         "restored_step_on_host_0": restored, "killed_here": inc.failure})
      continue
    got = inc.digests
    partial = restored is not None and got.get(str(restored)) not in (None, want.get(
        str(restored)))
    checked = {s: d for s, d in got.items() if s in want}
    recoveries.append({
        "incarnation": inc.number, "restored_step": restored, "source": r.get("source"),
        "rewind_steps": r.get("rewind_steps"), "steps_checked": len(checked),
        "correct": bool(checked) and all(want[s] == d for s, d in checked.items()),
        "partial_restore": partial, "killed_here": inc.failure})
  done = [x for x in recoveries if not x.get("interrupted")]
  correct = sum(x["correct"] for x in done)
  rewinds = [x["rewind_steps"] for x in done if x["rewind_steps"] is not None]
  return {
      "kills": kills, "hosts": hosts, "seed": seed, "steps": steps,
      "kill_schedule": [{"host": k.host, "step": k.step, "phase": k.phase or "supervisor",
                     "lose_store": k.lose_store} for k in plan],
      "recoveries": recoveries, "restores_completed": len(done), "correct": correct,
      "fraction_correct": correct / max(len(done), 1),
      "interrupted_restores": len(recoveries) - len(done),
      "partial_restores": sum(x["partial_restore"] for x in done),
      "rewind_mean": statistics.mean(rewinds) if rewinds else None,
      "rewind_max": max(rewinds) if rewinds else None,
      "sources": {str(s): sum(x["source"] == s for x in done)
                  for s in {x["source"] for x in done}},
      "final_state_equal": incs[-1].digests.get(str(steps)) == want.get(str(steps)),
  }


def draw_faults(n: int, hosts: int, kinds: Sequence[str], second: float,
                rng: random.Random) -> tuple[list[dict[str, Any]], list[Any]]:
  """``n`` faults, one every :data:`GAP` steps from :data:`FIRST`, each in
  whichever incarnation reaches its step. Returns (faults, their kills)."""
  from snapstore.testing import Kill
  faults, kills = [], []
  for i in range(n):
    kind, host, step = rng.choice(kinds), rng.randrange(hosts), FIRST + GAP * i
    phase = None if kind == "stop" else rng.choice(KILL_PHASES)
    delay = round(rng.uniform(0.0, 0.1), 3) if phase is None else 0.0
    kills.append(Kill(host=host, step=step, incarnation=None, phase=phase, delay_s=delay,
                      freeze=kind == "stop", lose_store=kind == "wipe"))
    again = rng.random() < second
    if again:  # its replacement dies in the restore that heals it
      kills.append(Kill(host=host, step=-1, incarnation=None, phase="restore"))
    faults.append({"kind": kind, "host": host, "step": step, "phase": phase or "supervisor",
                   "delay_s": delay, "second_fault": again})
  return faults, kills


def _host0_reports(out: Path) -> list[dict[str, Any]]:
  """Every host-0 process's worker report (the first and each replacement,
  in every incarnation)."""
  return [json.loads(p.read_text()) for p in sorted(out.glob("inc*-host0*.json"))]


def _spread(xs: Sequence[float]) -> dict[str, float | None]:
  if not xs:
    return {"n": 0, "p50": None, "p95": None, "max": None}
  q = sorted(xs)
  return {"n": len(q), "p50": round(statistics.median(q), 2),
          "p95": round(q[min(len(q) - 1, round(0.95 * (len(q) - 1)))], 2),
          "max": round(q[-1], 2)}


def judge(faults: list[dict[str, Any]], reports: list[dict[str, Any]],
          ref: dict[str, Any]) -> list[dict[str, Any]]:
  """Per fault: bitwise (every digest host 0 reported from the step before
  it to ``GAP - 1`` steps after it equals the reference's), in place (the
  same incarnation before and after it) and the seconds lost."""
  first: dict[int, tuple[float, int]] = {}  # step -> (time, incarnation): first done
  last: dict[int, tuple[float, int]] = {}  # ... and last done (the run that went on)
  digests: dict[int, set[str]] = {}
  for r in reports:
    for s, t in r["times"].items():
      step, mark = int(s), (t, r["incarnation"])
      first[step] = min(first.get(step, mark), mark)
      last[step] = max(last.get(step, mark), mark)
    for s, d in r["digests"].items():
      digests.setdefault(int(s), set()).add(d)
  dt = statistics.median(step_intervals(ref))
  out = []
  for f in faults:
    a, b = f["step"] - 1, f["step"] + GAP - 1
    seen = {s: digests.get(s, set()) for s in range(a, b + 1)}
    row = dict(f, bitwise=all(d == {ref["digests"][str(s)]} for s, d in seen.items()))
    if a in first and b in last:
      row["in_place"] = first[a][1] == last[b][1]
      row["lost_s"] = round(last[b][0] - first[a][0] - (b - a) * dt, 2)
    out.append(row)
  return out


def run_in_place(kills: int, hosts: int, seed: int, kinds: Sequence[str],
                 second: float) -> dict[str, Any]:
  work = ram_dir("snapstore-soak-")
  env = {"JAX_COMPILATION_CACHE_DIR": str(work / "jax-cache"),
         "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
  faults, plan = draw_faults(kills, hosts, kinds, second, random.Random(seed))
  steps = FIRST + GAP * kills + 2
  try:
    def args(name: str) -> list[str]:
      return ["--persistent", str(work / f"ckpt-{name}"), *ARGS]
    _, ref_out = demo_job(work, "reference", steps, args("reference"), num_hosts=hosts,
                          env=env, in_place=True)
    (ref,) = _host0_reports(ref_out)
    incs, out = demo_job(work, "soak", steps, args("soak"), num_hosts=hosts, kills=plan, env=env,
                         in_place=True, timeout_s=300 + 60 * len(plan),
                         max_replacements=2 * len(plan) + 8)
    rows = judge(faults, _host0_reports(out), ref)
  finally:
    cleanup(work)
  timed = [r for r in rows if "lost_s" in r]
  label = {r["kind"] + ("+second" if r["second_fault"] else "") for r in rows}
  return {
      "mode": "in_place", "faults": kills, "hosts": hosts, "seed": seed, "steps": steps,
      "kinds": list(kinds), "second_fault": second, "per_fault": rows,
      "fraction_bitwise": sum(r["bitwise"] for r in rows) / max(len(rows), 1),
      "final_state_equal": incs[-1].digests.get(str(steps)) == ref["digests"][str(steps)],
      "in_place": sum(bool(r.get("in_place")) for r in rows),
      "full_restarts": len(incs) - 1,
      "replacements": sum(len(i.replaced) for i in incs),
      "fenced": sum(len(i.fenced) for i in incs),
      "fenced_hosts": sorted(f["host"] for i in incs for f in i.fenced),
      "fallbacks": [i.fallback for i in incs if i.fallback],
      "step_s_reference": round(statistics.median(step_intervals(ref)), 4),
      "lost_s": {k: _spread([r["lost_s"] for r in timed
                             if r["kind"] + ("+second" if r["second_fault"] else "") == k])
                 for k in sorted(label)},
      "lost_s_all": _spread([r["lost_s"] for r in timed]),
  }


def main(argv: Sequence[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog="benchmarks.soak", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--kills", type=int, default=20, help="faults injected")
  p.add_argument("--hosts", type=int, default=None, help="2; 4 with --in-place")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--in-place", action="store_true", help="recover in place")
  p.add_argument("--faults", default=",".join(KINDS),
                 help=f"with --in-place: the kinds drawn, of {','.join(KINDS)}")
  p.add_argument("--second-fault", type=float, default=0.2, metavar="P",
                 help="with --in-place: the chance a fault's replacement dies in its restore")
  p.add_argument("--out", default="bench-results/soak.json")
  args = p.parse_args(argv)
  kinds = [k for k in args.faults.split(",") if k]
  if not kinds or set(kinds) - set(KINDS):
    p.error(f"--faults: a comma-separated list of {','.join(KINDS)}, got {args.faults!r}")
  if not 0.0 <= args.second_fault <= 1.0:
    p.error(f"--second-fault: a probability, got {args.second_fault}")
  if args.in_place:
    result = run_in_place(args.kills, args.hosts or 4, args.seed, kinds, args.second_fault)
  else:
    result = run(args.kills, args.hosts or 2, args.seed)
  emit("soak", result, args.out)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
