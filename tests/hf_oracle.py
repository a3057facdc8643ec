"""The transformers + peft oracle: a second interpreter the tests run our files through.

Why a second interpreter: the oracle must share no code with ``jaxrl_sym``, and torch's CPU
build on this machine kind is for Python 3.11 (PyPI's for the project's 3.12 is a CUDA build of
several GB). ``scripts/oracle_venv.sh`` (``make oracle-venv``) builds ``.venv-oracle`` with
pinned torch, transformers and peft; a test writes its files, :func:`run_oracle` runs a script
there that reads them with transformers and prints one JSON line, and the test compares.

``make test`` (CI's command) builds the oracle and sets ``JAXRL_SYM_REQUIRE_HF_ORACLE=1``:
there a missing oracle fails the tests that need it instead of skipping them, so CI cannot go
green without them. ``JAXRL_SYM_HF_ORACLE`` names another interpreter.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).parent.parent
DEFAULT = ROOT / ".venv-oracle" / "bin" / "python"


def _has(python: Path, modules: tuple[str, ...]) -> bool:
    probe = f"import {', '.join(modules)}"
    return subprocess.run([str(python), "-c", probe], capture_output=True,
                          timeout=300).returncode == 0


def oracle_python(*modules: str) -> Path:
    """The oracle interpreter that imports ``modules`` (torch, transformers and theirs); where
    there is none, the test skips, or fails when ``make test`` requires the oracle."""
    need = ("torch", "transformers", *modules)
    python = Path(os.environ.get("JAXRL_SYM_HF_ORACLE") or DEFAULT)
    if python.exists() and _has(python, need):
        return python
    why = f"no oracle interpreter with {', '.join(need)} at {python}: make oracle-venv builds one"
    if os.environ.get("JAXRL_SYM_REQUIRE_HF_ORACLE") == "1":
        pytest.fail(why)
    pytest.skip(why)


def run_oracle(python: Path, script: str, args: list[str], tmp_path: Path,
               timeout: int = 600) -> Any:
    """Run ``script`` under the oracle with ``args``; its last stdout line, parsed as JSON."""
    path = tmp_path / "oracle_script.py"
    path.write_text(script)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run([str(python), str(path), *args], capture_output=True, text=True,
                          env=env, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
