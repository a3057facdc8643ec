"""Padding-vs-symbolic benchmark suite: one command, resumable, results as JSONL + Markdown + PNG.

    python -m bench suite                              # quick: tiny model, a minute or two
    python -m bench suite --preset full                # the CPU run (2 cores: about 10 minutes)
    python -m bench suite --preset gpu                 # GPT-2-small shape, for an H100/H200
    python -m bench suite --preset full --only decode --force   # re-run a part
    python -m bench suite --preset full --render                # tables and plots only

Scenarios, resuming, out-of-memory rows and the memory check: :mod:`bench.lib.suite.suite_jobs`.
Results go to ``bench/results/<device>/suite/`` (``results.jsonl``, ``results.md``, ``*.png``) and
``bench/results/<device>/SUITE.md`` (the quick preset: a temporary folder).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from bench import presets
from bench.lib.child import ROOT
from bench.lib.suite.suite_jobs import (
    device_dir,
    device_meta,
    load_rows,
    plan,
    run_jobs,
    write_outputs,
)
from jaxrl_sym import systems as registry
from jaxrl_sym.errors import InputError
from jaxrl_sym.workloads import REALISTIC_CPU, REALISTIC_GPU

SCENARIOS = ("decode", "realistic", "growing", "rlft", "trace")
_GRID: dict[str, dict[str, Any]] = {
    "quick": {
        # the tiny model, two kinds, one length: every scenario's path in a minute or two
        "model": "tiny", "batch": 2, "prompt_len": (3, 6), "window": 8, "block": 8,
        "kinds": ("full", "window"), "tokens": (12,), "default_systems": ("sym-xla", "padded"),
        "pershape_tokens": (6,), "pershape_kinds": ("full",),
        "realistic": {"batch": 3, "prompt": (2, 5), "median": 6, "cap": 10, "sigma": 0.6},
        "growing": {"batch": 3, "prompt": (2, 5), "medians": (2, 20), "runs": 2, "cap": 24,
                    "sigma": 0.6},
        "rlft": {"scale": 32, "prompts": 2, "group": 2, "steps": 1},
        "trace": {"batch": 3, "steps": 1, "growing_steps": 2, "scale": 64},
        "timeout": 600, "out": presets.quick_dir("suite")},
    "full": {
        # The CLI's decode-cpu model (6 layers, 4 heads, width 64): KV state dominates memory
        # at a few thousand tokens, as in real long-context decoding.
        "model": "decode-cpu", "batch": 4, "prompt_len": (8, 24), "window": 64, "block": 64,
        "kinds": ("full", "window", "block", "linear", "mixed"), "tokens": (256, 512, 1024),
        "default_systems": ("sym-xla", "padded", "tunix"),  # tunix where installed
        # Per-shape compiles once per length (seconds each on a loaded 2-core CPU): one small N.
        "pershape_tokens": (16,), "pershape_kinds": ("full",),
        "realistic": REALISTIC_CPU,
        "growing": {"batch": 16, "prompt": (16, 128), "medians": (16, 160), "runs": 3,
                    "cap": 512, "sigma": 0.6},
        "rlft": {"scale": 8, "prompts": 8, "group": 4, "steps": 1},
        # lengths / 16: math median 75 (cap 512), code 50, chat 12.5, growing 6.25 -> 62.5
        "trace": {"batch": 16, "steps": 2, "growing_steps": 3, "scale": 16},
        "timeout": 900, "out": None},
    "gpu": {
        # GPT-2 small's shape (12 layers, 12 heads, width 768), batch 64, window 512 (Fig. 3).
        "model": "gpt2-small", "batch": 64, "prompt_len": (8, 24), "window": 512, "block": 512,
        "kinds": ("full", "window", "block", "linear", "mixed"),
        "tokens": (512, 1024, 2048, 4096, 8192, 16384),
        "default_systems": ("sym-xla", "sym-triton", "padded", "tunix"),
        "pershape_tokens": (512,), "pershape_kinds": ("full", "window"),
        "realistic": REALISTIC_GPU,
        "growing": {"batch": 64, "prompt": (64, 512), "medians": (100, 1000), "runs": 6,
                    "cap": 4096, "sigma": 0.6},
        # Qwen2.5-0.5B's shape at the paper's lengths (python -m bench rlft_step --preset gpu)
        "rlft": {"preset": "gpu", "scale": 1, "prompts": 16, "group": 8, "steps": 2},
        "trace": {"batch": 64, "steps": 4, "growing_steps": 6, "scale": 1},
        "timeout": 3600, "out": None},
}
PRESETS = _GRID


def grid(name: str) -> dict[str, Any]:
    """Preset ``name`` as :func:`bench.lib.suite.suite_jobs.plan` takes it (``preset``: the
    model)."""
    g = {k: v for k, v in _GRID[name].items() if k not in ("model", "out")}
    return {**g, "name": name, "preset": _GRID[name]["model"]}


def narrow(preset: dict[str, Any], kinds: str | None, tokens: str | None) -> dict[str, Any]:
    """The preset restricted to the decode ``kinds`` / lengths ``tokens`` asked for (a GPU
    session's time allows a slice of the full grid per command; the JSONL accumulates slices)."""
    out = dict(preset)
    if kinds:
        want = presets.csv(kinds)
        unknown = sorted(set(want) - set(preset["kinds"]))
        if unknown:
            raise InputError(f"--kinds: unknown {unknown}; the preset has {preset['kinds']}")
        out["kinds"] = tuple(want)
        out["pershape_kinds"] = tuple(k for k in preset["pershape_kinds"] if k in want)
    if tokens:
        lengths = tuple(presets.csv(tokens, int))
        out["tokens"] = lengths
        out["pershape_tokens"] = tuple(n for n in preset["pershape_tokens"] if n in lengths)
    return out


def _parser() -> Any:
    p = presets.parser("suite", __doc__, PRESETS)
    p.add_argument("--only", default=",".join(SCENARIOS), type=presets.names(SCENARIOS, "scenario"),
                   help="comma-separated scenarios: " + ", ".join(SCENARIOS))
    p.add_argument("--trace", dest="trace_file", default=None, metavar="FILE.jsonl",
                   help='trace scenario: also replay this JSONL of {"prompt_len": P, '
                        '"response_len": R} rows (optional "step": k), lengths divided by the '
                        "preset's scale")
    p.add_argument("--systems", default=None, type=presets.systems(),
                   help="comma-separated: sym-xla, sym-triton, padded, pershape, tunix, "
                        "tunix-defaults (default: the preset's, sym-triton only where compiled "
                        "Triton runs, tunix only where it is installed)")
    p.add_argument("--kinds", dest="only_kinds", default=None, metavar="KINDS",
                   help="comma-separated decode kinds to run (default: the preset's)")
    p.add_argument("--tokens", dest="only_tokens", default=None, metavar="N,N",
                   type=presets.ints(1),
                   help="comma-separated decode lengths N to run (default: the preset's)")
    p.add_argument("--force", action="store_true", help="re-run finished configurations")
    p.add_argument("--render", action="store_true", help="only rewrite tables and plots")
    p.add_argument("--out", default=None, help="results folder (default: the preset's; full "
                                               "and gpu: bench/results/<device>)")
    p.add_argument("--dry-run", action="store_true", help="list the jobs and exit")
    p.add_argument("--no-memory-check", action="store_true",
                   help="run configurations whose memory estimate exceeds the device's limit")
    return p


def _available(system: str, meta: dict[str, Any]) -> bool:
    """Its package is installed, and a Triton variant runs only where compiled Triton does."""
    spec = registry.get(system)
    triton = dict(spec.fixed).get("backend") == "triton"
    return spec.unavailable() is None and (not triton or meta["triton_gpu"])


def _systems(args: Any, preset: dict[str, Any], meta: dict[str, Any]) -> list[str]:
    if args.systems:
        return presets.csv(args.systems)
    systems = [s for s in preset["default_systems"] if _available(s, meta)]
    return [*systems, "pershape"] if preset["pershape_tokens"] else systems


def parse_args(argv: list[str] | None = None) -> Any:
    """The command line, every setting of the chosen preset filled in."""
    return presets.parse(_parser(), PRESETS, argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    preset = narrow(grid(args.preset), args.only_kinds, args.only_tokens)
    meta = device_meta(presets.command("suite", argv))
    out_dir = Path(args.out) if args.out else ROOT / "bench" / "results" / device_dir(
        meta["device"])
    out_dir = out_dir / "suite"
    jobs = plan(preset, systems=_systems(args, preset, meta), scenarios=presets.csv(args.only),
                trace=args.trace_file)
    if args.dry_run:
        for j in jobs:
            print(j.label())
        return 0
    if not args.render:
        print(f"{len(jobs)} jobs on {meta['device']} → {out_dir}")
        run_jobs(jobs, out_dir, meta, force=args.force, timeout=preset["timeout"],
                 progress=sys.stdout.isatty(), memory_check=not args.no_memory_check)
    write_outputs(load_rows(out_dir / "results.jsonl"), out_dir)
    print(f"wrote {out_dir}/results.md, {out_dir.parent}/SUITE.md and plots")
    return 0
