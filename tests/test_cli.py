"""The command line: fault specs for ``snapstore launch`` and clear refusals."""

import argparse

import pytest

from snapstore import cli
from snapstore.testing import Kill


@pytest.mark.parametrize("text,kill", [
    ("1@37", Kill(1, 37)),
    ("2@5+lose", Kill(2, 5, lose_store=True)),
    ("0@6:manifest", Kill(0, 6, phase="manifest")),
    ("3@-1:restore/1", Kill(3, -1, incarnation=1, phase="restore")),
])
def test_kill_specs(text, kill):
  assert cli._parse_kill(text) == kill


@pytest.mark.parametrize("text", ["1", "a@3", "1@3:explode", "1@3+keep"])
def test_bad_kill_specs_are_refused(text):
  with pytest.raises(argparse.ArgumentTypeError):
    cli._parse_kill(text)


def test_machine_placements_parse_and_bad_ones_are_refused(capsys):
  assert cli._parse_machines("1,2,3,0") == [1, 2, 3, 0]
  with pytest.raises(argparse.ArgumentTypeError, match="machine numbers"):
    cli._parse_machines("1,a")
  # (refused before any process starts: two hosts on one machine)
  assert cli.main(["launch", "--hosts", "2", "--machines", "0,0", "--", "x"]) == 1
  assert "distinct machines" in capsys.readouterr().err
  assert cli.main(["launch", "--hosts", "2", "--in-place", "--machines", "0,1", "--",
                   "x"]) == 1
  assert "full restarts" in capsys.readouterr().err


def test_launch_without_a_module_fails_clearly(capsys):
  assert cli.main(["launch", "--hosts", "2"]) == 2
  assert "name a module" in capsys.readouterr().out


def test_bench_console_script_runs_a_benchmark_from_the_repository_root(tmp_path):
  """The installed ``snapstore`` script (its sys.path lacks the current
  folder) finds benchmarks/ when run from the repository root."""
  import shutil
  import subprocess
  import sys
  from pathlib import Path
  script = Path(sys.executable).parent / "snapstore"
  script = str(script) if script.exists() else shutil.which("snapstore")
  out = tmp_path / "g.json"
  proc = subprocess.run([script, "bench", "goodput", "--preset", "v5e-256", "--out", str(out)],
                        cwd=Path(__file__).resolve().parents[1], capture_output=True,
                        text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr
  assert out.exists() and '"benchmark": "goodput"' in proc.stdout


def test_bench_exits_0_for_a_benchmark_whose_main_returns_its_result(tmp_path, capsys,
                                                                    monkeypatch):
  """``benchmarks.scale.main`` returns its result (a dict, for the tests):
  ``snapstore bench scale`` still exits 0, not 1 with the dict on stderr."""
  from pathlib import Path

  from snapstore import cli
  monkeypatch.chdir(Path(__file__).resolve().parents[1])
  assert cli.main(["bench", "scale", "--sizes", "8", "--cases", "one", "--redundancy",
                   "replicas", "--out", str(tmp_path / "s.json")]) == 0
  assert (tmp_path / "s.json").exists() and '"rows"' in capsys.readouterr().out


def test_a_fault_spec_arms_several_points_and_a_bad_one_is_refused():
  from snapstore import _faults
  assert _faults.parse("capture@9,restore@-1") == (("capture", 9, False),
                                                   ("restore", -1, False))
  assert _faults.parse("orbax@4:stop") == (("orbax", 4, True),)
  assert _faults.parse("") == ()
  with pytest.raises(ValueError, match="SNAPSTORE_FAULT"):
    _faults.parse("capture@9,bogus@3")


def test_a_new_process_is_armed_with_its_phase_kills_and_a_restore_kill_only_next():
  """A host's process is armed with its pending phase kills, earliest step
  first; a kill in its restore only when that is the host's next fault (it
  models a second fault inside the recovery of the one before)."""
  from snapstore.testing.kills import _arming
  first = Kill(1, 6, incarnation=None)  # a supervisor kill: not armed in the process
  again = Kill(1, -1, incarnation=None, phase="restore")
  later = Kill(1, 12, incarnation=None, phase="manifest")
  other = Kill(2, 9, incarnation=None, phase="capture")
  pending = [first, again, other, later]
  assert _arming(pending, 1) == [later]
  assert _arming([again, other, later], 1) == [again, later]
  assert _arming(pending, 2) == [other]
  assert _arming(pending, 0) == []


def test_capacity_reports_each_redundancy_option_per_host(capsys):
  """``snapstore capacity``: 1.4e12 bytes over 1,024 one-host domains; a
  replica doubles a host's bytes per snapshot, parity k=3 adds a third."""
  import json
  assert cli.main(["capacity", "--params", "1e11", "--hosts", "1024", "--json"]) == 0
  out = json.loads(capsys.readouterr().out)
  by = {o["option"]: o for o in out["options"]}
  own = by["replicas=0"]["own"]
  assert own == -(-int(1e11 * 14) // 1024) and by["replicas=0"]["extra"] == 0
  assert by["replicas=1"]["extra"] == own and by["parity k=3"]["extra"] == -(-own // 3)
  assert by["parity k=7"]["snapshots"] == 3  # keep=2, and the one being written
  assert out["staging_hbm_bytes_per_chip"] == -(-own // 4)  # a chip's share, 4 a host


def test_capacity_says_the_hbm_a_save_stages(capsys):
  assert cli.main(["capacity", "--params", "1e9", "--hosts", "8", "--chips-per-host", "8"]) == 0
  assert "HBM a save stages on each of 8 chips a host: 0.22 GB" in capsys.readouterr().out
  assert cli.main(["capacity", "--params", "1e9", "--hosts", "8", "--chips-per-host", "0"]) == 2


def test_capacity_refuses_hosts_that_do_not_split_into_domains(capsys):
  assert cli.main(["capacity", "--params", "1e9", "--hosts", "6",
                   "--hosts-per-domain", "4"]) == 2
  assert "do not split" in capsys.readouterr().err


def test_capacity_from_a_state_is_what_a_store_holds_of_it(store_dir):
  """``capacity.from_state`` against a real snapshot of the same state: its
  own bytes are the slot's (each distinct piece once, in whole pages; a
  replicated leaf once, not once a device)."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec as P

  import snapstore
  from snapstore import capacity
  from snapstore._index import align
  from tests.helpers import only_store, opts
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("d",))
  state = {"sharded": jax.device_put(jnp.ones((8, 1000), jnp.float32),
                                     NamedSharding(mesh, P("d"))),
           "replicated": jax.device_put(jnp.ones((3, 5), jnp.bfloat16),
                                        NamedSharding(mesh, P())),
           "one": jnp.arange(7, dtype=jnp.int32)}
  (rows,) = [r for r in capacity.from_state(state, keep=1) if r.option == "replicas=0"]
  with snapstore.SnapshotManager(opts(store_dir, keep=1, redundancy=snapstore.Replicas(0))
                                 ) as mgr:
    mgr.save(1, state)
    mgr.wait_until_finished()
    (m,) = only_store(mgr).manifests()
  assert rows.own == sum(align(r.nbytes) for r in m.pieces) == 10 * 4096
  assert rows.snapshots == 2 and rows.total == 2 * rows.own
