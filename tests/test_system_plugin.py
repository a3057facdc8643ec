"""A system from another package, found through the ``jaxrl_sym.systems`` entry-point group, runs in
``jaxrl-sym decode`` (whose systems run in child processes) without editing this package.

The plugin is a real installed distribution as far as ``importlib.metadata`` is concerned: a
module and a ``.dist-info`` directory with ``entry_points.txt`` on ``PYTHONPATH``, written by the
test. Its system decodes greedily by re-running the plain model on every prefix (no cache, no
mask, no padding: nothing of the library's decode path), so the decode command's own token
comparison against sym is an independent check.
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

BIND = textwrap.dedent('''
    import time

    import jax.numpy as jnp
    import numpy as np

    from jaxrl_sym.generation import GenerationResult, row_limits
    from jaxrl_sym.systems.bound import BoundSystem


    class NaiveBound(BoundSystem):
        def generate(self, prompts, cfg):
            t0, toks, lps, lgs = time.perf_counter(), [], [], []
            for prompt, limit in zip(prompts, row_limits(cfg, len(prompts)), strict=True):
                seq, row_lg = [int(t) for t in prompt], []
                for _ in range(int(limit)):
                    x = jnp.asarray([seq], jnp.int32)
                    lg = self.model(x, jnp.arange(len(seq))[None], jnp.zeros_like(x))[0, -1]
                    row_lg.append(np.asarray(lg, np.float32))
                    seq.append(int(np.argmax(row_lg[-1])))
                row = np.asarray(seq[len(prompt):], np.int32)
                lg = np.stack(row_lg)
                top = lg.max(-1, keepdims=True)
                logp = lg - top - np.log(np.exp(lg - top).sum(-1, keepdims=True))
                toks.append(row)
                lps.append(logp[np.arange(row.size), row])
                lgs.append(lg)
            stats = {"xla_compiles": 0, "peak_bytes": 0,
                     "run_seconds": time.perf_counter() - t0}
            return GenerationResult(toks, lps, lgs if cfg.return_logits else None, stats)


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
    path = os.pathsep.join(p for p in (str(where), os.environ.get("PYTHONPATH")) if p)
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
