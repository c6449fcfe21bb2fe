"""The README and docs/ as a new user meets them: the quickstart runs as
written and says what it prints; every link and image resolves; the layout
map names every module."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _section(text: str, heading: str) -> str:
  """The text under ``## heading``, up to the next ``## ``."""
  m = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
  assert m, f"README.md has no section '## {heading}'"
  return m.group(1)


def _blocks(text: str, lang: str) -> list[str]:
  return re.findall(rf"^```{lang}\n(.*?)^```", text, re.S | re.M)


def _slug(heading: str) -> str:
  """GitHub's anchor for a heading."""
  s = re.sub(r"[^\w\- ]", "", heading.strip().lower())
  return s.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
  return {_slug(h) for h in re.findall(r"^#+ (.+)$", path.read_text(), re.M)}


def test_the_quickstart_runs_as_written_and_prints_what_it_says(tmp_path):
  (code,) = _blocks(_section(README.read_text(), "Quickstart"), "python")
  assert len(code.splitlines()) <= 25
  store = tmp_path / "store"
  script = tmp_path / "quickstart.py"
  script.write_text(code.replace('"/dev/shm/snapstore"', repr(str(store))))
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(
      [str(ROOT), os.environ.get("PYTHONPATH", "")]))
  proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                        capture_output=True, text=True, timeout=240)
  assert proc.returncode == 0, proc.stderr[-3000:]
  # the printed line is the one its comment promises (the script itself
  # asserts the restored step and bitwise equality)
  claimed = re.search(r"^print\(.*#\s*(.+)$", code, re.M)
  assert claimed, "the quickstart's print says what it prints in a comment"
  assert proc.stdout.strip().splitlines()[-1] == claimed.group(1).strip()
  assert any(store.rglob("*.manifest")), "the snapshots went to the store_dir given"


def test_the_readme_is_short_and_has_two_set_up_commands():
  text = README.read_text()
  assert len(text.splitlines()) <= 160
  (setup,) = _blocks(text, "bash")[:1]
  assert len(setup.strip().splitlines()) == 2


@pytest.mark.parametrize("doc", [README, *DOCS], ids=lambda p: p.name)
def test_every_link_resolves(doc):
  for target in LINK.findall(doc.read_text()):
    if re.match(r"[a-z]+://", target):
      continue
    path, _, anchor = target.partition("#")
    dest = (doc.parent / path).resolve() if path else doc
    assert dest.exists(), f"{doc.name} links {target}: no such file"
    if anchor and dest.suffix == ".md":
      assert anchor in _anchors(dest), f"{doc.name} links {target}: no such heading"


def test_every_image_in_docs_img_is_shown_and_every_image_shown_exists():
  shown = set()
  for doc in [README, *DOCS]:
    for target in re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", doc.read_text()):
      path = (doc.parent / target).resolve()
      assert path.exists(), f"{doc.name} shows {target}: no such file"
      shown.add(path)
  files = {p.resolve() for p in (ROOT / "docs" / "img").iterdir() if p.is_file()}
  assert files - shown == set(), f"images no doc shows: {sorted(files - shown)}"


def test_the_layout_map_names_every_module():
  (layout,) = _blocks(_section(README.read_text(), "Layout"), "")
  for top in ("snapstore", "integrations", "benchmarks"):
    for path in sorted((ROOT / top).rglob("*")):
      if path.suffix not in (".py", ".c", ".pyi") or "__pycache__" in path.parts:
        continue
      rel = path.relative_to(ROOT)
      assert re.search(rf"(?<![\w.]){re.escape(path.name)}\b", layout), \
          f"README's layout map does not name {rel}"
      for folder in rel.parts[1:-1]:
        assert f"{folder}/" in layout, f"README's layout map does not name {folder}/ ({rel})"


def test_the_version_is_the_changelogs_newest():
  import tomllib

  import snapstore
  version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
  released = re.findall(r"^## \[(\d+\.\d+\.\d+)\]", (ROOT / "CHANGELOG.md").read_text(), re.M)
  assert released and released[0] == version == snapstore.__version__


def test_ci_runs_the_readme_set_up_commands_as_written():
  """Each part of the README's two set-up commands (demo, tests) is a line
  of ``.ci/run`` as written: CI installs and runs what a new user does."""
  (setup,) = _blocks(README.read_text(), "bash")[:1]
  ci = {line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()}
  ci = {line.replace("$REQ", "requirements/maxtext-0.2.5-cpu.txt") for line in ci}
  for command in setup.strip().splitlines():
    for part in command.split("#")[0].split("&&"):
      assert part.strip() in ci, f".ci/run does not run the README's {part.strip()!r}"
