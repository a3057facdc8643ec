"""Every ``python -m bench`` experiment refuses a bad flag value before JAX is imported.

Why: a bench run used to take ``--steps -1``, ``--rows 0,x`` or ``--systems fast`` and fail
with a traceback from numpy or the trainer, some after minutes of compiling (issue 50 item 4).
The sweep reads each experiment's own parser (so a flag added later is covered without editing
this file) and gives every value-taking flag three values no flag accepts: ``nan``, ``-5`` and
``zzz``. Flags whose value is free text (an output path, a commit, a trace file) are listed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).parent.parent

# value-taking flags whose text is the user's own (paths, names the run records): any is valid
FREE_TEXT = {"--out", "--child", "--tunix-path", "--commit", "--report", "--trace", "--ledger",
             "--recalibrate", "--model", "--config", "--partial"}
BAD = ("nan", "-5", "zzz")

# The children: the first lists every experiment's value-taking flags from the parser it builds
# (captured by wrapping presets.parse in that child only); the cases then run through
# ``bench.__main__.main``, each printing [experiment, flag, value, exit code, JAX imported,
# stderr's last line]. A case that imports JAX ends its child (JAX cannot be unloaded), and the
# next child takes the remaining cases, so every row's JAX flag is that case's own.
_LIST = r"""
import argparse, importlib, json
from bench import presets, registry

class Captured(Exception):
    pass

def capture(p, table, argv):
    raise Captured(p)

presets.parse = capture
flags = {}
for name in registry.names():
    try:
        importlib.import_module("bench.experiments." + name).parse_args([])
    except Captured as c:
        flags[name] = [a.option_strings[-1] for a in c.args[0]._actions
                       if a.option_strings and a.nargs is None and a.choices is None
                       and not isinstance(a, (argparse._StoreConstAction, argparse._HelpAction))]
print(json.dumps(flags))
"""
_RUN = r"""
import contextlib, io, json, signal, sys
from bench.__main__ import main

class Ran(Exception):  # the value was accepted: the experiment went on to its work
    pass

def ran(*_):
    raise Ran()

signal.signal(signal.SIGALRM, ran)
for name, flag, value in json.loads(sys.argv[1]):
    err = io.StringIO()
    signal.alarm(10)
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = main([name, flag, value])
    except SystemExit as e:
        code = e.code
    except BaseException as e:
        code = repr(e)
    signal.alarm(0)
    lines = err.getvalue().strip().splitlines()
    print("ROW " + json.dumps([name, flag, value, code, "jax" in sys.modules,
                               lines[-1] if lines else ""]), flush=True)
    if "jax" in sys.modules:
        break
"""


def _child(script: str, *args: str) -> str:
    proc = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.fixture(scope="module")
def sweep() -> tuple[dict[str, list[str]], list[list[Any]]]:
    listed = json.loads(_child(_LIST).strip().splitlines()[-1])
    cases = [[name, flag, value] for name, flags in listed.items() for flag in flags
             if flag not in FREE_TEXT for value in BAD]
    cases += [[name, "--preset", "zzz"] for name in listed]  # a choice: argparse's own check
    rows: list[list[Any]] = []
    while len(rows) < len(cases):
        out = _child(_RUN, json.dumps(cases[len(rows):]))
        rows += [json.loads(line[4:]) for line in out.splitlines() if line.startswith("ROW ")]
    return listed, rows


def test_every_experiment_lists_its_flags(sweep: tuple[dict[str, list[str]], list[Any]]
                                          ) -> None:
    from bench import registry
    listed, _ = sweep
    assert set(listed) == set(registry.names())
    assert sum(len(v) for v in listed.values()) >= 40  # the sweep saw the parsers


def test_every_bad_flag_value_is_refused_before_jax(
        sweep: tuple[dict[str, list[str]], list[list[Any]]]) -> None:
    _, rows = sweep
    failures = [row for row in rows if row[3] != 2 or row[4]
                or f"{row[1]}" not in row[5] or "Traceback" in row[5]]
    assert not failures, "\n".join(map(json.dumps, failures))
