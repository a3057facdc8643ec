"""Words that are true (issue 49 item 5): no docstring or comment of ``jaxrl_sym/`` reports a
run's measurement ("measured on the CPU: 91 MB → 7.5 MB").

Why: a docstring says why a design is as it is; the numbers behind it came from one run on one
machine on one day, and go stale as the code moves while the docstring still states them as
true. They belong in ``bench/results/`` beside their command and date (the design notes' page
is ``bench/results/cpu/design_notes.md``); the docstring keeps the reasoning in words and names
the page. The check is a heuristic: the word "measured" with a number and a unit (s, ms, µs,
MB, GB, GiB, %, ×, …) up to 80 characters before it or 200 after (a note names its setting
first, then its numbers). Definitions of what a function measures carry no number and pass.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "jaxrl_sym"
BEFORE, AFTER = 80, 200
MEASURED = re.compile(r"\bmeasured\b", re.IGNORECASE)
QUANTITY = re.compile(r"\d(?:[\d,.]*\d)?\s?(?:ms|µs|us|s|MB|GB|GiB|MiB|KB|%|×|x)(?![A-Za-z0-9])")


def _docstrings(tree: ast.AST) -> list[tuple[int, str]]:
    """(first line, text) of every string statement: docstrings and the strings that document
    a constant or a field."""
    return [(node.lineno, node.value.value) for node in ast.walk(tree)
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)]


def _comments(source: str) -> list[tuple[int, str]]:
    """(first line, text) of every run of comments on consecutive lines, so that a note split
    over lines is read whole."""
    runs: list[tuple[int, str]] = []
    last = -2
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type != tokenize.COMMENT:
            continue
        line = tok.start[0]
        if runs and line == last + 1:
            runs[-1] = (runs[-1][0], runs[-1][1] + "\n" + tok.string)
        else:
            runs.append((line, tok.string))
        last = line
    return runs


def offenders(text: str) -> list[int]:
    """Line offsets (within ``text``) of each "measured" that has a quantity up to ``BEFORE``
    characters before it or ``AFTER`` after it, read with indentation and comment marks
    removed."""
    lines = [line.strip().lstrip("#").strip() for line in text.splitlines()]
    flat = " ".join(lines)
    starts = [sum(len(line) + 1 for line in lines[:i]) for i in range(len(lines))]
    out = []
    for m in MEASURED.finditer(flat):
        if QUANTITY.search(flat[max(0, m.start() - BEFORE):m.end() + AFTER]):
            out.append(sum(1 for s in starts if s <= m.start()) - 1)
    return out


def _notes() -> list[str]:
    found = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG.parent).as_posix()
        source = path.read_text()
        for start, text in _docstrings(ast.parse(source)) + _comments(source):
            found += [f"{rel}:{start + off}" for off in offenders(text)]
    return found


def test_no_docstring_or_comment_reports_a_measurement() -> None:
    found = _notes()
    assert not found, ("measurement notes in docstrings/comments (move the numbers to "
                       "bench/results/, keep the reasoning):\n" + "\n".join(found))


def test_the_check_tells_a_note_from_a_definition() -> None:
    assert offenders("Measured on the CPU: the temporaries fall from ~91 MB to ~7.5 MB.")
    assert offenders("(measured: 13 dispatches and\n5.3-6.4 s per step)") == [0]
    assert offenders("x\n1.7× slower, as measured") == [1]
    assert not offenders("the bytes measured by the ledger, in MB")
    assert not offenders("choose k from measured acceptance and verify cost")
    assert not offenders("measured over 4 steps")
    assert not offenders("unmeasured k: 12 ms a verify")
