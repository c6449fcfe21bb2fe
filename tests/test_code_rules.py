"""Rules the code keeps (CONTRIBUTING.md): small functions, and an engine
that never imports the harness that drives it."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 80
# the harness: the local supervisor and its worker side, the CLI, the demo's job
HARNESS = {"testing", "cli.py", "__main__.py", "demo"}
# folders whose __init__.py is their interface
COMPONENTS = {"_backends", "_multihost", "recovery", "testing"}


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


def _imports(path: Path) -> list[tuple[int, str]]:
  """(line, absolute module) for each import in ``path``; ``from X import y``
  gives ``X.y`` where that is a module, else ``X``."""
  parts = path.relative_to(ROOT).with_suffix("").parts
  package = parts[:-1]
  out = []
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      out += [(node.lineno, a.name) for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = list(package[:len(package) - node.level + 1]) if node.level else []
      mod = ".".join(base + ([node.module] if node.module else []))
      for a in node.names:
        sub = f"{mod}.{a.name}"
        is_module = (ROOT / sub.replace(".", "/")).with_suffix(".py").exists() or (
            ROOT / sub.replace(".", "/") / "__init__.py").exists()
        out.append((node.lineno, sub if is_module else mod))
  return out


def test_the_engine_never_imports_the_harness():
  """Only the CLI and the demo import ``snapstore.testing``; the engine
  speaks to a supervisor through ``snapstore._reports``."""
  found = [f"{path.relative_to(ROOT)}:{line} {mod}"
           for path in _modules("snapstore")
           if path.relative_to(ROOT / "snapstore").parts[0] not in HARNESS
           for line, mod in _imports(path)
           if mod.split(".")[:2] == ["snapstore", "testing"]]
  assert found == [], found


@pytest.mark.parametrize("top", ["snapstore", "integrations"])
def test_a_component_folder_is_entered_through_its_package(top):
  """Outside ``snapstore/F/``, code imports ``snapstore.F`` itself, never
  one of its modules: each folder's ``__init__.py`` is its whole interface."""
  found = []
  for path in _modules(top):
    here = path.relative_to(ROOT).parts
    for line, mod in _imports(path):
      m = mod.split(".")
      if (len(m) > 2 and m[0] == "snapstore" and m[1] in COMPONENTS
          and tuple(here[:2]) != ("snapstore", m[1])):
        found.append(f"{path.relative_to(ROOT)}:{line} {mod}")
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


def test_every_package_is_shipped():
  """Each folder with an ``__init__.py`` is in pyproject's package list (an
  editable install finds one that is not; a wheel would leave it out)."""
  import tomllib
  listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())
               ["tool"]["setuptools"]["packages"])
  prefix = {"snapstore": ("snapstore",), "integrations": ("snapstore", "integrations")}
  found = {".".join((*prefix[top], *p.parent.relative_to(ROOT / top).parts))
           for top in prefix for p in (ROOT / top).rglob("__init__.py")}
  assert found - listed == set(), found - listed


def test_importing_snapstore_does_not_load_in_place_recovery():
  """``import snapstore`` loads the engine only: ``snapstore.recovery``
  (in-place recovery, private JAX) is loaded by a job that uses it (its
  Orbax barrier is imported where a recoverable job makes one)."""
  code = ("import sys, snapstore; "
          "print(sorted(m for m in sys.modules if m.startswith('snapstore.recovery')))")
  out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True,
                       capture_output=True, text=True).stdout
  assert out.strip() == "[]", out
