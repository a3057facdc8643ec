"""The persistent compilation cache: where it lives, how users turn it off, and that a second
process compiles nothing (the programs come from disk and generate the same tokens)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from jaxrl_sym.compile_cache import ENV, chosen_dir, configure_environment, default_dir


def test_default_location_follows_xdg() -> None:
    assert default_dir({"XDG_CACHE_HOME": "/x"}) == Path("/x/jaxrl_sym/xla")
    assert default_dir({}).parts[-3:] == (".cache", "jaxrl_sym", "xla")


def test_configure_sets_jax_variables_once_and_respects_the_user() -> None:
    env: dict[str, str] = {"XDG_CACHE_HOME": "/c"}
    assert configure_environment(env) == Path("/c/jaxrl_sym/xla")
    assert env["JAX_COMPILATION_CACHE_DIR"] == "/c/jaxrl_sym/xla"
    assert env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] == "0"
    # a user's own JAX setting wins; our variable picks a directory; "off" disables
    env = {"JAX_COMPILATION_CACHE_DIR": "/mine", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "2"}
    assert configure_environment(env) == Path("/mine")
    assert env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] == "2"
    env = {ENV: "~/here"}
    assert configure_environment(env) == Path("~/here").expanduser()
    for off in ("off", "OFF", "0", "false"):
        env = {ENV: off}
        assert configure_environment(env) is None and chosen_dir(env) is None
        assert "JAX_COMPILATION_CACHE_DIR" not in env


_RUN = textwrap.dedent("""
    import json, sys
    import numpy as np
    from jaxrl_sym.compile_cache import configure_environment
    configure_environment()  # what the CLI does first, before JAX is imported
    from jaxrl_sym.generation import GenerationConfig
    from jaxrl_sym.models import init_model, preset
    from jaxrl_sym.runtime.engine import SymbolicLM
    from jaxrl_sym.runtime.options import EngineOptions
    lm = SymbolicLM(init_model(preset("tiny"), seed=0), EngineOptions(min_capacity=4))
    r = lm.generate([np.array([1, 2, 3], np.int32), np.array([4, 5], np.int32)],
                    GenerationConfig(max_new_tokens=(9, 5)))
    print(json.dumps({"compiles": r.stats["xla_compiles"], "hits": r.stats["compile_cache_hits"],
                      "tokens": [t.tolist() for t in r.tokens]}))
""")


@pytest.mark.slow
def test_a_second_process_compiles_nothing(tmp_path: Path) -> None:
    env = {**os.environ, ENV: str(tmp_path / "cache")}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    runs = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", _RUN], env=env, capture_output=True,
                             text=True, timeout=600, check=True)
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    cold, warm = runs
    assert cold["compiles"] > 0 and cold["hits"] == 0
    assert warm["compiles"] == 0 and warm["hits"] >= cold["compiles"]
    assert warm["tokens"] == cold["tokens"]
    assert any((tmp_path / "cache").iterdir())
