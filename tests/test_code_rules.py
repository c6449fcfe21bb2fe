"""Rules the code keeps (CONTRIBUTING.md): small functions, and an engine
that never imports the harness that drives it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 80
# the harness: the local supervisor, the CLI that runs it, the demo's job
HARNESS = {"launch.py", "cli.py", "__main__.py"}


def _modules(top: str) -> list[Path]:
  return sorted(p for p in (ROOT / top).rglob("*.py") if "__pycache__" not in p.parts)


@pytest.mark.parametrize("top", ["snapstore", "integrations"])
def test_no_function_is_longer_than_80_lines(top):
  long = [f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({n} lines)"
          for path in _modules(top)
          for node in ast.walk(ast.parse(path.read_text()))
          if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
          and (n := node.end_lineno - node.lineno + 1) > MAX_LINES]
  assert long == [], "split these into named steps:\n" + "\n".join(long)


def test_the_engine_never_imports_the_harness():
  """Only the supervisor, the CLI and the demo import ``snapstore.launch``;
  the engine speaks to a supervisor through ``snapstore._reports``."""
  found = []
  for path in _modules("snapstore"):
    rel = path.relative_to(ROOT / "snapstore")
    if rel.name in HARNESS or rel.parts[0] == "demo":
      continue
    for node in ast.walk(ast.parse(path.read_text())):
      names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
               [f"{node.module or ''}.{a.name}" for a in node.names]
               if isinstance(node, ast.ImportFrom) else [])
      found += [f"{rel}:{node.lineno} {n}" for n in names if "launch" in n.split(".")]
  assert found == [], found


def test_private_jax_is_reached_only_through_one_module():
  """``jax._src``, ``jax.Array._arrays`` and JAX's batched put appear only
  in ``snapstore/_jax_private.py``, behind its version check."""
  pattern = re.compile(r"jax\._src|\._arrays\b|\"_arrays\"|batched_device_put")
  found = [f"{path.relative_to(ROOT)}:{n}" for path in _modules("snapstore")
           if path.name != "_jax_private.py"
           for n, line in enumerate(path.read_text().splitlines(), 1)
           if pattern.search(line)]
  assert found == [], found
