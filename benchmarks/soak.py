"""Soak: one job, N seeded SIGKILLs, and how many recoveries were correct.

``python -m benchmarks.soak --kills 20`` (``--kills 50`` for the full run):
the demo's model on ``--hosts`` local processes (``snapstore launch``,
``jax.distributed`` on CPU, one failure domain per host, replicas=1, keep=2,
Orbax every 10 steps on a local dir as the fallback). Each incarnation is
killed once: a host drawn at random, at a phase drawn at random (by the
supervisor mid-step, or by the process itself inside a snapshot's capture,
replica transfer or manifest commit, or inside the next incarnation's
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
"""

from __future__ import annotations

import argparse
import random
import statistics
from collections.abc import Sequence
from pathlib import Path

from benchmarks._common import cleanup, demo_job, emit, ram_dir

PHASES = (None, None, "capture", "replica", "manifest", "restore")
GAP = 3  # steps between kills


def _job(work: Path, name: str, hosts: int, steps: int, kills: list, env: dict) -> list:
  incs, _ = demo_job(work, name, steps,
                     ["--persistent", str(work / f"ckpt-{name}"), "--checkpoint-every", "10",
                      "--hosts-per-domain", "1", "--digest-every-step", "--min-step-s", "0.05"],
                     num_hosts=hosts, kills=kills, timeout_s=300 + 60 * len(kills), env=env)
  return incs


def draw_kills(n: int, hosts: int, rng: random.Random) -> list:
  from snapstore.launch import Kill
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
      "kill_plan": [{"host": k.host, "step": k.step, "phase": k.phase or "supervisor",
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


def main(argv: Sequence[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog="benchmarks.soak", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--kills", type=int, default=20)
  p.add_argument("--hosts", type=int, default=2)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", default="bench-results/soak.json")
  args = p.parse_args(argv)
  emit("soak", run(args.kills, args.hosts, args.seed), args.out)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
