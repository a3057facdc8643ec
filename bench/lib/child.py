"""The one way a benchmark runs work in a separate process.

Why separate processes: peak RSS and the device allocator's peak are then one system's own, a
crash or an out-of-memory kill takes down one configuration instead of the benchmark, XLA's
in-process caches cannot make a later system look cheaper than an earlier one, and a child can
see another device count (``XLA_FLAGS``) or another ``PYTHONPATH`` than its parent.

Every child is ``python -m <module> ...`` started in the repository root (so ``bench`` imports),
with XLA's GPU preallocation off (the allocator's peak is only meaningful without it). A child's
failure is a :class:`ChildResult`, never an exception: an out-of-memory or crashing configuration
is a result row, not a crash of the benchmark.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository: bench/lib/child.py's grandparent
_OOM = re.compile(r"RESOURCE_EXHAUSTED|out of memory|OutOfMemory|MemoryError|"
                  r"Cannot allocate memory|CUDA_ERROR_OUT_OF_MEMORY", re.IGNORECASE)


@dataclass(frozen=True)
class ChildResult:
    """How a child ended: ``status`` is ``ok``, ``oom``, ``error`` or ``timeout``."""

    status: str
    returncode: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def tail(self, lines: int = 4) -> str:
        """The last lines of stderr (stdout when stderr is empty): why it failed."""
        return tail(self.stderr or self.stdout, lines)


def tail(text: str, lines: int = 4) -> str:
    return "\n".join((text or "").strip().splitlines()[-lines:])


def module(name: str, *args: str) -> list[str]:
    """``python -m name args`` with this interpreter."""
    return [sys.executable, "-m", name, *args]


def experiment(name: str, *args: str) -> list[str]:
    """``python -m bench name args``: another experiment (or this one's child mode)."""
    return module("bench", name, *args)


def classify_failure(returncode: int, stderr: str) -> str:
    """``oom`` when the child ran out of memory (message, or killed by a signal such as the
    kernel's OOM killer's SIGKILL), else ``error``."""
    if _OOM.search(stderr or "") or returncode in (-9, 137):
        return "oom"
    return "error"


def run(cmd: Sequence[str], *, timeout: float | None = None,
        env: Mapping[str, str] | None = None) -> ChildResult:
    """Run ``cmd`` in the repository root with ``env`` over this process's environment."""
    full_env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false", **(env or {})}
    # its own process group: a timeout ends the child's children too (an experiment's per-system
    # processes), which would otherwise hold the device while the next configuration runs
    with subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=full_env, cwd=ROOT, start_new_session=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            return ChildResult("timeout", -1, out or "", err or "")
    status = "ok" if proc.returncode == 0 else classify_failure(proc.returncode, err)
    return ChildResult(status, proc.returncode, out, err)
