"""The command line: fault specs for ``snapstore launch`` and clear refusals."""

import argparse

import pytest

from snapstore import cli
from snapstore.launch import Kill


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
