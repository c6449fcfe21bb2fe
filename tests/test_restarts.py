"""Every restart trains again, and a job that stops advancing says where.

Real processes (jax.distributed on CPU, gloo), real SIGKILLs, with the
persistent compilation cache on as the demo has it (the supervisor leaves it
out where this jaxlib's cached programs hang: jaxlib 0.12.1). On such a
jaxlib, before that, the first step after every restart hung.
"""

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from snapstore._backends.hostfiles.store import host_dir, read_progress
from snapstore.errors import JobStalledError
from snapstore.testing import Kill, StallPolicy, launch

pytestmark = pytest.mark.slow  # real multi-process jobs: the full suite only

RESTARTS = 30
HOSTS = 2
ROOT = Path(__file__).resolve().parents[1]
ENV = {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


@pytest.fixture
def cpu_hog():
  """A busy loop beside the job: one of the machine's cores taken."""
  hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
  yield hog
  hog.kill()
  hog.wait()


@pytest.fixture
def shm_store():
  store = Path("/dev/shm") / f"snapstore-rs-{uuid.uuid4().hex[:8]}"
  yield store
  import shutil
  shutil.rmtree(store, ignore_errors=True)


def _env(cache: Path) -> dict[str, str]:
  return {"JAX_COMPILATION_CACHE_DIR": str(cache),
          "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}


def _worker_args(out: Path, store: Path, steps: int, *extra: str) -> list[str]:
  return ["--steps", str(steps), "--out", str(out), "--store", str(store), "--run-id", "job",
          "--hosts-per-domain", "1", "--digest-every-step", *extra]


def _last_digest(out: Path, number: int, step: int) -> str:
  return json.loads((out / f"inc{number}-host0.json").read_text())["digests"][str(step)]


@pytest.mark.soak  # ~7 minutes each here: CI runs it on the newest releases (-m soak)
@pytest.mark.timeout(RESTARTS * 60)
@pytest.mark.parametrize("source", ["persistent", "snapshot"])
def test_thirty_restarts_in_a_row_each_train_again_beside_a_busy_loop(
    source, tmp_path, shm_store, cpu_hog):
  """Host 1 (or 0) is SIGKILLed once in every incarnation, a step later
  each time; the whole job restarts 30 times, each time restoring from
  Orbax (``persistent``: no snapshots) or from the RAM snapshots, and must
  train past its restored step before the next kill. The last incarnation
  ends bitwise equal to an uninterrupted run."""
  steps = RESTARTS + 3
  cache = tmp_path / "jax-cache"
  ref_out, out = tmp_path / "reference", tmp_path / source
  ref_out.mkdir()
  out.mkdir()
  extra = (["--snapshots", "0", "--persistent", str(tmp_path / "ckpt"),
            "--checkpoint-every", "1"] if source == "persistent" else [])
  ref = launch("snapstore.demo.worker", _worker_args(ref_out, shm_store / "ref", steps),
               num_hosts=HOSTS, devices_per_host=2, store_dir=shm_store / "ref",
               run_id="job", env=_env(cache), log_dir=ref_out, timeout_s=300)
  kills = [Kill(host=i % HOSTS, step=i + 2, incarnation=i) for i in range(RESTARTS)]
  incs = launch("snapstore.demo.worker", _worker_args(out, shm_store / source, steps, *extra),
                num_hosts=HOSTS, devices_per_host=2, store_dir=shm_store / source,
                run_id="job", kills=kills, max_incarnations=RESTARTS + 1, env=_env(cache),
                log_dir=out, timeout_s=RESTARTS * 50)
  assert len(incs) == RESTARTS + 1 and incs[-1].ok, [i.failure for i in incs]
  assert [i.killed for i in incs[:-1]] == [[i % HOSTS] for i in range(RESTARTS)]
  for inc in incs[1:]:  # each restart restored, from where it was asked to
    assert inc.restore is not None and inc.restore["source"] == source, inc.as_dict()
  # ... and trained past it: incarnation i is killed once a host reports step
  # i + 2 (its save of that step), which only a step it trained can write
  for inc in incs[1:-1]:
    assert inc.restore["step"] < inc.number + 2, (inc.number, inc.restore)
  assert _last_digest(out, incs[-1].number, steps) == _last_digest(ref_out, 0, steps)
  assert ref[-1].ok


def test_a_job_stuck_in_a_collective_fails_within_its_watch_with_every_stack(
    tmp_path, shm_store):
  """Host 1 stops in Python before step 4 (alive, heartbeating, never
  joining the step's collectives: ``tests/_hang_worker.py``); hosts 0, 2
  and 3 block inside that step's collectives, and JAX sees nothing wrong.
  The stall watch (no step for max(10 s, 20 x the median step)) stops the
  job: a JobStalledError naming the training phase and step 3, each
  process's Python stacks at the end of its log (the three inside the train
  step, host 1 in its sleep), no process of the job left. The job's timeout
  (10 minutes) is never reached."""
  out = tmp_path / "out"
  out.mkdir()
  began = time.monotonic()
  with pytest.raises(JobStalledError) as err:
    launch("tests._hang_worker", _worker_args(out, shm_store, 50, "--hosts-per-domain", "2"),
           num_hosts=4, devices_per_host=2, store_dir=shm_store, run_id="job", log_dir=out,
           timeout_s=600, stall=StallPolicy(min_s=10.0),
           env={**ENV, "HANG_HOST": "1", "HANG_STEP": "4"})
  e = err.value
  assert e.phase.startswith("training: no host went past step 3"), e.phase
  assert e.incarnation == 0 and time.monotonic() - began < 600
  stacks = {h: Path(log).read_text(errors="replace") for h, log in enumerate(e.logs)}
  assert len(stacks) == 4 and all("most recent call first" in t for t in stacks.values())
  assert "_train_or_hang" in stacks[1]
  assert all(" in train\n" in stacks[h] for h in (0, 2, 3)), stacks[0][-3000:]
  assert not _job_processes(shm_store), "a process of the stalled job survived"


def _job_processes(store: Path) -> list[int]:
  """Pids of live processes whose command line names ``store``."""
  pids = []
  for proc in Path("/proc").iterdir():
    if not proc.name.isdigit():
      continue
    try:
      cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
      state = (proc / "stat").read_text().rsplit(")", 1)[-1].split()[0]
    except OSError:
      continue
    if str(store) in cmd and "snapstore.testing._boot" in cmd and state != "Z":
      pids.append(int(proc.name))
  return pids


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stopped_launch_takes_its_processes_with_it(signum, tmp_path, shm_store):
  """``snapstore launch`` of a long job, stopped by SIGTERM or SIGINT once
  it trains: it exits 128 + the signal, says so, and no worker remains."""
  out = tmp_path / "out"
  out.mkdir()
  cmd = [sys.executable, "-m", "snapstore", "launch", "--hosts", "2", "--devices-per-host",
         "1", "--store-dir", str(shm_store), "--run-id", "job", "--log-dir", str(out), "--",
         "snapstore.demo.worker", *_worker_args(out, shm_store, 10_000)]
  # (a shell's background job starts with SIGINT ignored, and Python then
  # never raises KeyboardInterrupt: the CLI gets the default disposition)
  cli = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
  deadline = time.monotonic() + 180
  while read_progress(host_dir(shm_store, "job", 1))[0] < 2:
    assert cli.poll() is None and time.monotonic() < deadline, cli.communicate()
    time.sleep(0.2)
  assert len(_job_processes(shm_store)) == 2
  cli.send_signal(signum)
  stdout, stderr = cli.communicate(timeout=60)
  assert cli.returncode == 128 + signum, (stdout, stderr)
  assert f"stopped by {signal.Signals(signum).name}" in stderr
  assert "killed the job's processes" in stderr
  assert not _job_processes(shm_store)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL])
def test_a_stopped_demo_takes_its_processes_with_it(tmp_path, signum):
  """``snapstore demo`` stopped by SIGTERM (or killed outright) while its
  first run trains: no worker and no GCS emulator remain."""
  env = dict(os.environ, TMPDIR=str(tmp_path))
  cli = subprocess.Popen([sys.executable, "-m", "snapstore", "demo", "--report",
                          str(tmp_path / "r.json"), "--plot", str(tmp_path / "p.png")],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         cwd=tmp_path)
  deadline = time.monotonic() + 240
  while not _demo_processes(cli.pid, workers_only=True):
    assert cli.poll() is None and time.monotonic() < deadline, cli.communicate()
    time.sleep(0.2)
  time.sleep(5)  # (into its steps)
  children = _demo_processes(cli.pid)
  cli.send_signal(signum)
  stdout, stderr = cli.communicate(timeout=60)
  if signum == signal.SIGTERM:
    assert cli.returncode == 128 + signal.SIGTERM, (stdout, stderr)
    assert "stopped by SIGTERM" in stderr
  else:  # (no handler runs: the children die with their parent, PR_SET_PDEATHSIG)
    assert cli.returncode == -signal.SIGKILL
  time.sleep(0.5)
  alive = [p for p in children if Path(f"/proc/{p}").exists()
           and Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[-1].split()[0] != "Z"]
  assert not alive, alive


def _demo_processes(parent: int, *, workers_only: bool = False) -> list[int]:
  """The live children of ``parent`` (the demo's workers and its emulator)."""
  pids = []
  for proc in Path("/proc").iterdir():
    if not proc.name.isdigit():
      continue
    try:
      stat = (proc / "stat").read_text().rsplit(")", 1)[-1].split()
      cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
      continue
    if int(stat[1]) == parent and (not workers_only or "snapstore.demo.worker" in cmd):
      pids.append(int(proc.name))
  return pids
