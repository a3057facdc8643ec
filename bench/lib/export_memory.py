"""Peak memory of ``jaxrl-sym export`` over the process's own baseline, in units of the weights.

``python -m bench.lib.export_memory --model DIR [--run RUN]`` exports ``DIR`` (``--model``) and,
with ``--run``, the RL checkpoint ``RUN`` (``--checkpoint-dir``), each in a fresh child process, and
prints peak RSS minus baseline RSS against the weights' size. The target (issue: a 0.54 GB
checkpoint exported at 5.9 GB) is at most the weights plus one extra copy.

Why a child that first exports a tiny checkpoint: the baseline must hold everything the export
path imports and initialises (JAX's backend, orbax, tokenizers), or import cost would be billed
as weight copies; exporting a template-sized checkpoint first (same command, same code path,
~0.3 MB of weights) loads exactly that. The resident set is then read before the real export and
its high-water mark after it, in the same process, so no other process's memory is counted (a
test runner's ``RUSAGE_CHILDREN``, or ``ru_maxrss`` inherited through fork and exec, would count
the parent's).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.lib.child import ROOT


def weights_bytes(model_dir: str | Path) -> int:
    """Total bytes of a Hugging Face directory's safetensors files (the weights a model holds
    when loaded in the checkpoint's dtype)."""
    return sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))


def _export(flag: str, source: str, out: str, extra: list[str]) -> None:
    from jaxrl_sym.cli import main

    rc = main(["export", flag, source, "--out", out, *extra])
    if rc != 0:
        raise SystemExit(f"export {flag} {source} failed with exit code {rc}")


def _status_kb(field: str) -> int | None:
    """A ``/proc/self/status`` field in kB (None off Linux)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak() -> bool:
    """Reset this process's peak RSS (VmHWM) to its current RSS (Linux ``clear_refs`` 5)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def child(flag: str, source: str, warmup: str, out: str, extra: list[str]) -> dict[str, Any]:
    """In this process: export ``warmup``, then ``source``; RSS before and peak during the
    second, in bytes.

    VmRSS/VmHWM of ``/proc/self/status``, not ``ru_maxrss``: Linux carries ``ru_maxrss``
    across ``fork`` + ``exec``, so a child forked from a 1 GB test process reports at least
    1 GB whatever it does (measured: a pytest parent's 979 MB hid a whole export).
    """
    with tempfile.TemporaryDirectory() as tmp:
        _export(flag, warmup, os.path.join(tmp, "warmup"), extra)
    reset = _reset_peak()
    base_kb = _status_kb("VmRSS")
    if base_kb is None:  # not Linux: the max so far (includes the warm-up's peak)
        base_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    _export(flag, source, out, extra)
    peak_kb = _status_kb("VmHWM") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"baseline_bytes": base_kb * 1024, "peak_bytes": peak_kb * 1024,
            "peak_reset": reset, "seconds": time.perf_counter() - t0}


def measure(flag: str, source: str | Path, warmup: str | Path, out: str | Path,
            extra: list[str] | None = None, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run :func:`child` in a fresh interpreter; its report (``peak_bytes - baseline_bytes`` is
    what the export itself added)."""
    cmd = [sys.executable, "-m", "bench.lib.export_memory", "--child", flag, str(source),
           str(warmup), str(out), *(extra or [])]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900,
                         env={**os.environ, **(env or {})})
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({res.returncode}):\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


BOUNDS = {"--model": 1.5, "--checkpoint-dir": 2.0}
"""What each export may add, in units of the weights W, plus :data:`SLACK`: ``--model`` the model
plus a tensor at a time (measured 1.07-1.15 W; a memory map kept resident or a dict of every
host tensor each add a whole W), ``--checkpoint-dir`` the policy plus one extra copy (1.2-1.85 W:
orbax's read buffers and ~30-40 MB of restore machinery weigh more on small weights; restoring
the whole training state into a trainer was 9.4 W). Once a test of ``make test``; an RSS band
is a benchmark's check, not a test's (issue 49)."""
SLACK = 32 * 2**20  # allocator arenas, thread stacks, the export's own Python objects


def _row(name: str, flag: str, rep: dict[str, Any], weights: int) -> tuple[str, bool]:
    """The table row and whether the export stayed within its bound."""
    added = rep["peak_bytes"] - rep["baseline_bytes"]
    ok = added <= BOUNDS[flag] * weights + SLACK
    return (f"| {name} | {weights / 1e6:.0f} | {rep['baseline_bytes'] / 1e6:.0f} | "
            f"{rep['peak_bytes'] / 1e6:.0f} | {added / 1e6:.0f} | {added / weights:.2f} | "
            f"{BOUNDS[flag]} W + {SLACK // 2**20} MiB: {'within' if ok else 'OVER'} | "
            f"{rep['seconds']:.1f} |"), ok


def main(argv: list[str] | None = None) -> int:
    """Benchmark entry: a markdown table of the exports of ``--model`` and ``--run``; exit 1
    when one added more than its bound (:data:`BOUNDS`)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="a Hugging Face checkpoint directory")
    p.add_argument("--run", help="an RL checkpoint directory of `train --model` (optional)")
    p.add_argument("--dtype", default=None, help="pass --dtype to the exports")
    a = p.parse_args(argv)
    from bench.lib.checkpoints import write_random_checkpoint, write_rl_checkpoint

    extra = ["--dtype", a.dtype] if a.dtype else []
    w = weights_bytes(a.model)
    print("| export | weights MB | baseline MB | peak MB | added MB | added / W | bound | s |")
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tiny = Path(tmp, "tiny")
        write_random_checkpoint(tiny)
        rows.append(_row(f"--model {a.model}", "--model",
                         measure("--model", a.model, tiny, Path(tmp, "m"), extra), w))
        print(rows[-1][0], flush=True)
        if a.run:
            write_rl_checkpoint(tiny, Path(tmp, "tiny_run"))
            rows.append(_row(f"--checkpoint-dir {a.run}", "--checkpoint-dir", measure(
                "--checkpoint-dir", a.run, Path(tmp, "tiny_run"), Path(tmp, "r"), extra), w))
            print(rows[-1][0])
    return 0 if all(ok for _, ok in rows) else 1

if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        flag, source, warmup, out, *rest = sys.argv[2:]
        print(json.dumps(child(flag, source, warmup, out, rest)))
        raise SystemExit(0)
    raise SystemExit(main())
