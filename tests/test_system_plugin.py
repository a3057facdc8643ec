"""A system from another package, found through the ``jaxrl_sym.systems`` entry-point group, runs in
``jaxrl-sym decode`` (whose systems run in child processes) without editing this package.

The plugin is a real installed distribution as far as ``importlib.metadata`` is concerned: a
module and a ``.dist-info`` directory with ``entry_points.txt`` on ``PYTHONPATH``, written by the
test. Its system is ``tests/test_systems_registry.py``'s toy: greedy decoding that re-runs the
plain model on every prefix (no cache, no mask, no padding: nothing of the library's decode
path), so the decode command's own token comparison against sym is an independent check.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

PLUGIN = textwrap.dedent('''
    """A toy system registered from outside jaxrl_sym (JAX-free at import: binder by name)."""
    from jaxrl_sym import systems

    systems.register(systems.SystemSpec(
        "naive-ext", "greedy decoding re-running the model on every prefix",
        systems.Capabilities(), "toy_plugin_bind:bind"))
''')

# The binder: the registry test's toy system (one copy of it), importable from the tests folder.
BIND = textwrap.dedent('''
    from test_systems_registry import NaiveBound


    def bind(spec, model, options):
        return NaiveBound(spec, model, options)
''')


def _install(where: Path, entry: str, module: str = PLUGIN) -> dict[str, str]:
    """The plugin as an installed distribution under ``where``; the environment that sees it."""
    (where / "toy_plugin.py").write_text(module)
    (where / "toy_plugin_bind.py").write_text(BIND)
    info = where / "toy_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[jaxrl_sym.systems]\n{entry}\n")
    tests = str(Path(__file__).parent)
    path = os.pathsep.join(p for p in (str(where), tests, os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path}


def test_an_installed_plugin_system_runs_in_decode(tmp_path: Path) -> None:
    env = _install(tmp_path, "naive = toy_plugin")
    out = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "jaxrl_sym.cli", "decode", "--systems", "sym,naive-ext",
         "--tokens", "4", "--batch", "2", "--prompt-len", "3:5", "--no-memory-check",
         "--json", "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads(out.read_text())
    naive = report["systems"]["naive-ext"]
    assert naive["generated_tokens"] == 8, naive
    assert report["checks"]["naive-ext"]["tokens_equal"], report["checks"]


def test_a_plugin_that_fails_to_load_is_named(tmp_path: Path) -> None:
    env = _install(tmp_path, "broken = toy_plugin", module="raise RuntimeError('no GPU here')\n")
    proc = subprocess.run(
        [sys.executable, "-m", "jaxrl_sym.cli", "decode", "--systems", "sym"],
        env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    err = proc.stderr
    assert "plugin 'broken'" in err and "toy-plugin" in err and "no GPU here" in err, err
    assert "Traceback" not in err, err
