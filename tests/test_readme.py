"""The README is the public face: its example runs as written, it stays short, its links resolve,
and every name the package exports resolves.

Why a test: the example and the layout drift the moment a module moves; run on every change, the
README cannot promise an import path or a file that no longer exists.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

import jaxrl_sym

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_LINES = 300
# [text](target) and ![alt](target); the target ends at whitespace or ')'.
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _section(text: str, heading: str) -> str:
    """The body of the ``## heading`` section (up to the next ``## ``)."""
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, f"README has no '## {heading}' section"
    return match.group(1)


def python_block(heading: str) -> str:
    """The first ```python block of the README's ``## heading`` section."""
    blocks = re.findall(r"^```python\n(.*?)^```", _section(README.read_text(), heading),
                        re.M | re.S)
    assert blocks, f"the README's {heading} section has no ```python block"
    return blocks[0]


def example_code() -> str:
    return python_block("Example")


def test_readme_is_short() -> None:
    n = len(README.read_text().splitlines())
    assert n <= MAX_LINES, (f"README.md has {n} lines (at most {MAX_LINES}): move design notes "
                            "to docs/ and measurements to bench/results/")


def _broken_links(page: Path) -> list[str]:
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL or an anchor in the page itself
        if not (page.parent / target.split("#", 1)[0]).exists():
            broken.append(target)
    return broken


def test_readme_relative_links_resolve() -> None:
    broken = _broken_links(README)
    assert not broken, f"README links to files that do not exist: {broken}"


@pytest.mark.parametrize("page", [*sorted((ROOT / "docs").glob("*.md")),
                                  *sorted((ROOT / "bench" / "results").glob("*.md"))],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_moved_pages_links_resolve(page: Path) -> None:
    """Where the README's notes went (docs/, bench/results/): their links resolve as well."""
    broken = _broken_links(page)
    assert not broken, f"{page.relative_to(ROOT)} links to files that do not exist: {broken}"


def test_example_imports_only_the_public_face() -> None:
    code = example_code()
    assert "from jaxrl_sym import" in code
    assert not re.search(r"(from|import) jaxrl_sym\.", code), (
        "the README example imports from a jaxrl_sym submodule: export the name from "
        "jaxrl_sym/__init__.py instead")


def test_example_runs_as_written(capsys: pytest.CaptureFixture[str]) -> None:
    exec(compile(example_code(), f"{README}:Example", "exec"), {"__name__": "__readme__"})
    assert "ring" in capsys.readouterr().out  # the storage plan it prints names a ring store


@pytest.mark.slow
def test_rl_example_runs_as_written(capsys: pytest.CaptureFixture[str]) -> None:
    """The RL section's one step (tiny model, 16 prompts x 8): the trainer's API as printed."""
    code = python_block("RL fine-tuning (GRPO, RLOO, PPO)")
    exec(compile(code, f"{README}:RL", "exec"), {"__name__": "__readme__"})
    assert capsys.readouterr().out.strip()


def test_public_face_imports_no_jax() -> None:
    """Importing the package, listing it and the JAX-free registry load no JAX (the CLI checks
    flags before JAX's multi-second import)."""
    code = ("import sys, jaxrl_sym; dir(jaxrl_sym); from jaxrl_sym import GenerationConfig, "
            "InputError, systems; systems.names(); sys.exit('jax' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


# Upward imports the README's layout names as exceptions (importer, imported), and folders the
# import graph does not cover (tests import everything).
LAYOUT_EXCEPTIONS = {("jaxrl_sym/runtime/memory/estimate.py", "jaxrl_sym/models/traced.py")}
NOT_IN_GRAPH = ("tests/", "scripts/")


def layout_rows() -> list[list[str]]:
    """The layout table's first column: per row, the paths it names (a bare file name lives in
    the folder of the row's first path)."""
    rows = []
    for line in _section(README.read_text(), "Layout (data flows one way)").splitlines():
        if not line.startswith("| `"):
            continue
        names = re.findall(r"`([^`]+)`", line.split("|")[1])
        first = names[0].rstrip("/")
        base = first.rsplit("/", 1)[0] + "/" if "/" in first else ""
        rows.append([n if "/" in n else base + n for n in names])
    return rows


def _row_of(path: str, rows: list[list[str]]) -> int | None:
    for i, row in enumerate(rows):
        if any(path == n or (n.endswith("/") and path.startswith(n)) for n in row):
            return i
    return None


def _imported_files(source: Path) -> set[str]:
    """Repository files ``source`` imports anywhere (functions included: a hidden import is
    still an arrow)."""
    found = set()
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.Import):
            mods = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            mods = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        else:
            continue
        for m in mods:
            stem = m.replace(".", "/")
            for cand in (f"{stem}.py", f"{stem}/__init__.py"):
                if (ROOT / cand).exists() and cand != "jaxrl_sym/__init__.py":
                    found.add(cand)
    return found


def test_layout_matches_the_import_graph() -> None:
    """Every module has a row, and imports only from its row and the rows above (the package's
    face, ``jaxrl_sym/__init__.py``, hands names down and is no row)."""
    rows = [r for r in layout_rows() if not any(n.startswith(NOT_IN_GRAPH) for n in r)]
    sources = [p for folder in ("jaxrl_sym", "kernels", "bench", "notebooks")
               for p in sorted((ROOT / folder).rglob("*.py"))]
    unplaced, upward = [], []
    for src in sources:
        rel = str(src.relative_to(ROOT))
        if rel == "jaxrl_sym/__init__.py":
            continue
        row = _row_of(rel, rows)
        if row is None:
            unplaced.append(rel)
            continue
        for dep in _imported_files(src):
            dep_row = _row_of(dep, rows)
            if dep_row is not None and dep_row > row and (rel, dep) not in LAYOUT_EXCEPTIONS:
                upward.append(f"{rel} -> {dep}")
    assert not unplaced, f"modules the README's layout does not place: {unplaced}"
    assert not upward, f"imports from a lower row of the README's layout: {upward}"


@pytest.mark.parametrize("name", jaxrl_sym.__all__)
def test_public_name_resolves(name: str) -> None:
    assert getattr(jaxrl_sym, name) is not None
