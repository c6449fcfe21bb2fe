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
