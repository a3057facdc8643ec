"""The package's shape, checked from its source (no import is executed).

Why a test: the layout is the architecture (symbols → tracer → PDG → passes → runtime, with
systems, RL and the CLI on top). An import circle, even one hidden inside a function, ties two
rooms together so neither can be read or changed alone; a module over ~500 lines or a function
over ~60 is a room nobody finds their way around. The graph below counts imports inside
functions too, and ``TYPE_CHECKING`` blocks are skipped (they never run). The benchmarks
(``bench/``) are held to the same rules, and their module names are unique: a bare name such as
``suite_jobs`` or ``xla_gpu`` names one file.
"""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "jaxrl_sym"
BENCH = PKG.parent / "bench"
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 60
MAX_FOLDER_MODULES = 15  # a room a newcomer reads at a glance (``__init__.py`` not counted)


def _module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def _imports(source: str, me: str, is_init: bool, modules: set[str]) -> set[str]:
    """The package modules a module's source imports, at top level or inside any function."""
    tree = ast.parse(source)
    skip = _type_checking_lines(tree)
    package = me if is_init else me.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        out.update(n for n in names if n in modules and n != me)
    return out


def _graph(pkg: Path = PKG) -> dict[str, set[str]]:
    """Module → the package modules it imports. A package's face (its ``__init__``) re-exporting
    its own submodules, and a submodule importing a sibling through the face, are not circles of
    rooms: edges between a package and its own submodules are left out."""
    files = sorted(pkg.rglob("*.py"))
    modules = {_module_name(f) for f in files}
    graph: dict[str, set[str]] = {}
    for f in files:
        me = _module_name(f)
        deps = _imports(f.read_text(), me, f.name == "__init__.py", modules)
        graph[me] = {d for d in deps
                     if not d.startswith(me + ".") and not me.startswith(d + ".")}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


@pytest.mark.parametrize("pkg", [PKG, BENCH], ids=lambda p: p.name)
def test_no_import_circle_among_the_package_modules(pkg: Path) -> None:
    circles = _circles(_graph(pkg))
    assert not circles, f"import circles (counting imports inside functions): {circles}"


def test_the_check_sees_a_circle_closed_inside_a_function() -> None:
    """The checker itself, on made-up modules: a function-level import closes a circle, a
    ``TYPE_CHECKING`` import does not."""
    mods = {"p.a", "p.b", "p.c"}
    a = _imports("import p.b\n", "p.a", False, mods)
    b = _imports("def f():\n    from p.a import x\n", "p.b", False, mods)
    c = _imports("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from p import a\n",
                 "p.c", False, mods)
    assert (a, b, c) == ({"p.b"}, {"p.a"}, set())
    assert _circles({"p.a": a, "p.b": b, "p.c": c}) == [["p.a", "p.b"]]


def _long_functions(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    return [f"{path.relative_to(PKG.parent)}:{n.name} ({n.end_lineno - n.lineno + 1} lines)"
            for n in ast.walk(tree)
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
            and n.end_lineno - n.lineno + 1 > MAX_FUNCTION_LINES]


@pytest.mark.parametrize("pkg", [PKG, BENCH], ids=lambda p: p.name)
def test_no_module_over_the_limit(pkg: Path) -> None:
    limit = MAX_MODULE_LINES
    long = [f"{f.relative_to(PKG.parent)} ({n} lines)" for f in sorted(pkg.rglob("*.py"))
            if (n := len(f.read_text().splitlines())) > limit]
    assert not long, f"modules over {limit} lines: {long}"


@pytest.mark.parametrize("pkg", [PKG, BENCH], ids=lambda p: p.name)
def test_no_function_over_the_limit(pkg: Path) -> None:
    long = [x for f in sorted(pkg.rglob("*.py")) for x in _long_functions(f)]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_no_folder_of_the_package_over_the_limit() -> None:
    """A folder with more modules than this is several rooms: give them sub-folders."""
    counts = Counter(f.parent.relative_to(PKG.parent) for f in PKG.rglob("*.py")
                     if f.name != "__init__.py")
    crowded = {str(d): n for d, n in counts.items() if n > MAX_FOLDER_MODULES}
    assert not crowded, f"folders over {MAX_FOLDER_MODULES} modules: {crowded}"


def test_bench_module_names_are_unique() -> None:
    names = Counter(f.stem for f in BENCH.rglob("*.py") if f.name != "__init__.py")
    assert not [n for n, k in names.items() if k > 1], sorted(
        str(f.relative_to(PKG.parent)) for f in BENCH.rglob("*.py") if names[f.stem] > 1)


def _class_homes(pkg: Path = PKG) -> dict[str, list[str]]:
    """Every top-level class name of the package → the modules that define one by that name."""
    homes: dict[str, list[str]] = {}
    for f in sorted(pkg.rglob("*.py")):
        for node in ast.parse(f.read_text()).body:
            if isinstance(node, ast.ClassDef):
                homes.setdefault(node.name, []).append(_module_name(f))
    return homes


def test_no_class_name_is_defined_in_two_modules() -> None:
    """One home per noun: a name such as ``SymBound`` means one class. Two classes of one name
    (the symbolic runtime once had a generation ``SymBound`` and an RL ``SymBound``) make a
    reader guess which one a traceback or a docstring means."""
    twice = {n: m for n, m in _class_homes().items() if len(m) > 1}
    assert not twice, f"class names defined in more than one module: {twice}"


def test_each_trainable_system_keeps_both_halves_in_its_module() -> None:
    """A system is one module: the RL half a spec names (``trainer="module:Class"``) lives in
    the module its binder does, so a system's generation and training read as one file."""
    import jaxrl_sym.systems as systems

    for name in systems.names(trains=True):
        spec = systems.get(name)
        assert spec.trainer is not None
        assert spec.trainer.partition(":")[0] == spec.binder.partition(":")[0], spec



def test_no_folder_holds_more_than_fifteen_modules() -> None:
    """A room a newcomer can read the names of at a glance (issue 49: ~15 modules a folder)."""
    big = {str(d.relative_to(PKG.parent)): n for d in [PKG, *PKG.rglob("*/")]
           if d.is_dir() and "__pycache__" not in d.parts
           and (n := len([f for f in d.glob("*.py") if f.name != "__init__.py"])) > 15}
    assert not big, f"folders over 15 modules: {big}"
