"""The dispatch ledger of the RL step's generation: per system, kernels and host launches per
decode step, host round-trips per token, the share of a tile's kernels inside CUDA graphs, and
generation seconds projected from bytes, launches and round-trips — every program compiled for
the GPU on this machine, nothing run (:mod:`bench.lib.projection.dispatch_ledger`).

Why: generation on the H100 ran at ~8x its bytes floor; a decode tile's loop test was a host
round-trip per token. This shows where a change to the tile program moves those counts before
a GPU measures it. ``--calibrate`` prices every committed H100 generation row with its
programs as they ran then (one loop test per step), fits ``t_launch`` and ``t_sync`` on them
and writes the constants the projection then uses (``bench/results/projection/dispatch/``).

    bash scripts/gpu_compile_deps.sh                              # once: ~590 MB
    python -m bench dispatch --preset gpu --device h100 --json    # ~15 min of compiles
    python -m bench dispatch --preset gpu --device h100 --calibrate
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from bench import presets
from bench.lib.child import ROOT
from jaxrl_sym.errors import InputError

CALIBRATION = ROOT / "bench" / "results" / "projection" / "dispatch" / "calibration_h100.json"
OVERLAPPED_REFERENCE_S = {"bf16-mixed": 0.47, "fp32": 0.50}
"""Projected seconds of sym's reference scoring, which an H100 RL step runs during generation
and counts in its generation seconds (``bench/results/projection.md``, 2026-11-27: reference
0.47 s bf16-mixed + LoRA 16, 0.50 s fp32); subtracted from sym's measured rows before the fit."""

_COMMON = {"sigma": 0.6, "seed": 0, "device": "h100", "precision": "bf16-mixed",
           "systems": "sym,padded", "engine": None, "command_buffers": "default", "check": None}
PRESETS: dict[str, dict[str, Any]] = {
    "quick": {**_COMMON, "model": "cpu", "scale": 16, "prompts": 2, "group": 2},
    "full": {**_COMMON, "model": "cpu", "scale": 8, "prompts": 16, "group": 8},
    "gpu": {**_COMMON, "model": "gpu", "scale": 1, "prompts": 16, "group": 8},
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from bench.lib.projection import dispatch_ledger

    p = presets.parser("dispatch", __doc__, PRESETS)
    p.add_argument("--device", default=None, choices=("h100",),
                   help="the GPU the programs compile for (its thunk sequence is read)")
    p.add_argument("--precision", default=None, choices=("bf16-mixed", "fp32"),
                   help="the weights generation reads: bf16 (bf16-mixed's copy) or fp32")
    p.add_argument("--systems", default=None,
                   type=presets.names(tuple(dispatch_ledger.WALKS), "system"),
                   help="comma-separated: " + ", ".join(dispatch_ledger.WALKS))
    p.add_argument("--engine", default=None, type=presets.json_object(presets.engine_options),
                   help="sym's EngineOptions as JSON")
    p.add_argument("--command-buffers", default=None,
                   choices=tuple(dispatch_ledger.COMMAND_BUFFERS),
                   help="XLA's command-buffer types: default, or while (+WHILE,+CONDITIONAL)")
    p.add_argument("--check", type=presets.at_least(1), default=None,
                   help="compile sym's decode tiles testing their rows every CHECK steps "
                        "instead of the plan's (1: the tile as the committed runs measured it)")
    p.add_argument("--prompts", type=presets.at_least(1), default=None,
                   help="prompts per step (the preset's otherwise)")
    p.add_argument("--group", type=presets.at_least(2), default=None, help="samples per prompt")
    p.add_argument("--cap", type=presets.at_least(16), default=None,
                   help="the reasoning-length workload at this response cap instead of "
                        "rlft_step's (python -m bench reasoning)")
    p.add_argument("--calibrate", action="store_true",
                   help="fit t_launch / t_sync on the committed H100 generation rows")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--out", default=None, help="write OUT.json")
    args = presets.parse(p, PRESETS, argv)
    return args


def _model(args: argparse.Namespace) -> tuple[Any, Any, list[Any], list[int]]:
    """The RL step's policy at the preset's shape (abstract), its state in the weights' dtype,
    the expanded prompts and each sample's response limit (``gpu_compile``'s, one home)."""
    from bench.experiments.gpu_compile import abstract_model

    sub = argparse.Namespace(**{**vars(args), "precision": "bf16" if args.precision
                                == "bf16-mixed" else "fp32"})
    model, state, expanded, gcfg = abstract_model(sub)
    return model, state, expanded, [int(n) for n in gcfg.max_new_tokens]


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Every system's dispatch ledger, floor and projected seconds at ``args``."""
    from bench.lib.projection import decode_bytes, devices, dispatch_ledger
    from jaxrl_sym.runtime.memory.ledger import tree_nbytes

    dev = devices()[args.device]
    model, state, prompts, limits = _model(args)
    engine = json.loads(args.engine) if args.engine else {}
    rows = dispatch_ledger.generation_rows(
        model, state, prompts, limits, presets.csv(args.systems), engine, args.device,
        dispatch_ledger.COMMAND_BUFFERS[args.command_buffers], args.check,
        progress=lambda s: print(s, file=sys.stderr))
    floor = decode_bytes(model, [len(p) for p in prompts], limits, tree_nbytes(state))
    fitted = _fitted()
    for row in rows.values():
        row["generation_floor_s"] = (floor["weights_bytes"] + floor["kv_bytes"]) \
            / dev["bandwidth"]
        row["generation_read_s"] = row["read"] / dev["bandwidth"]
        if fitted is not None:
            row["generation_projected_s"] = dispatch_ledger.price(row, dev["bandwidth"],
                                                           fitted["per"])
            row["first_call_s"] = _first_call(row, dev["bandwidth"], fitted["per"], engine)
    return {"systems": rows, "fitted": fitted, "device": args.device,
            "precision": args.precision, "engine": engine,
            "command_buffers": args.command_buffers, "check": args.check}


AHEAD_THREADS = 4
"""sym's default ``compile_threads`` on a GPU host with four cores or more (the H100 hosts
have 16): the first call is projected with it (this CPU would resolve fewer)."""


def _first_call(row: dict[str, Any], bandwidth: float, per: dict[str, float],
                engine: dict[str, Any]) -> dict[str, float]:
    """The first generation call's wall seconds, compiles included (each at this CPU's
    seconds for the target), with every program compiled on first use and — for a system that
    compiles ahead — with its decode programs on ``compile_threads`` background threads."""
    from bench.lib.projection import dispatch_ledger, thunks

    progs = [dispatch_ledger.ProgramCount(**{**p, "counts": thunks.Counts(**p["counts"])})
             for p in row["programs"]]
    run_s = [dispatch_ledger.run_seconds(p, bandwidth, per) for p in progs]
    each = row["compile_s_each"]
    out = {"on_first_use": dispatch_ledger.first_call(progs, each, run_s, 0)}
    if row["compiles_ahead"]:
        threads = engine.get("compile_threads")
        threads = AHEAD_THREADS if threads is None else threads
        out[f"ahead_{threads}"] = dispatch_ledger.first_call(progs, each, run_s, threads)
    out["run_only"] = sum(run_s)
    return out


def _fitted() -> dict[str, Any] | None:
    if not CALIBRATION.exists():
        return None
    cal = json.loads(CALIBRATION.read_text())
    return {k: cal[k] for k in ("per", "source")}


def calibrate(args: argparse.Namespace) -> dict[str, Any]:
    """Fit (t_launch, t_sync) on every committed H100 generation row of the gpu preset, each
    priced with its configuration's programs as measured (sym's tiles: one test per step)."""
    from bench.lib.projection import devices, dispatch_ledger, measured_runs

    dev = devices()[args.device]
    cache: dict[tuple, dict[str, Any]] = {}
    points: list[dict[str, Any]] = []
    for run in measured_runs(dev):
        cfg = run["config"]
        if cfg.get("preset") != "gpu":
            continue
        precision = cfg.get("precision") or "fp32"
        for name, got in run["systems"].items():
            walk = dispatch_ledger.WALKS[name]
            key = (name, precision, cfg.get("engine") if walk.engine else None)
            if key not in cache:
                sub = argparse.Namespace(**{**vars(args), "precision": precision,
                                            "systems": name, "check": 1,
                                            "command_buffers": "default",
                                            "engine": key[2]})
                cache[key] = measure(sub)["systems"][name]
            seconds = got["seconds"]["generation"]
            if walk.overlapped_reference:
                seconds -= OVERLAPPED_REFERENCE_S[precision]
            points.append({"system": name, "precision": precision, "engine": key[2],
                           "source": run["source"], "measured_s": seconds,
                           "counts": {k: cache[key][k] for k in
                                      ("read", "bytes", *dispatch_ledger.TERMS, "decode_steps")}})
    per = dispatch_ledger.fit([(p["counts"], p["measured_s"]) for p in points], dev["bandwidth"])
    for p in points:
        p["projected_s"] = dispatch_ledger.price(p["counts"], dev["bandwidth"], per)
        p["miss"] = p["projected_s"] / p["measured_s"] - 1
    return {"per": per, "rows": points,
            "source": f"{len(points)} committed H100 generation rows, fitted by "
                      f"`{presets.command('dispatch', ['--preset', 'gpu', '--calibrate'])}`"}


def render(report: dict[str, Any]) -> str:
    lines = [f"# Dispatch ledger: generation compiled for {report['device']} "
             f"({report['precision']}, command buffers {report['command_buffers']})", "",
             "| system | launches/step | kernels/step | host syncs/token | captured | "
             "cold programs | read s | floor s | projected s | first call s |",
             "|---|" + "---:|" * 9]
    for name, r in report["systems"].items():
        proj = r.get("generation_projected_s")
        lines.append(f"| {name} | {r['launches_per_step']:.2f} | {r['kernels_per_step']:.1f} | "
                     f"{r['host_syncs_per_token']:.3f} | {r['captured']:.0%} | "
                     f"{r['cold_programs']} | {r['generation_read_s']:.2f} | "
                     f"{r['generation_floor_s']:.2f} | "
                     f"{'—' if proj is None else f'{proj:.2f}'} | {_first(r)} |")
    return "\n".join(lines) + "\n"


def _first(row: dict[str, Any]) -> str:
    """The first call's seconds, compiles included: on first use, and ahead where it is."""
    f = row.get("first_call_s")
    if f is None:
        return "—"
    return " / ".join(f"{v:.1f} ({k.replace('_', ' ')})" for k, v in f.items()
                      if k != "run_only")


def main(argv: list[str] | None = None) -> int:
    from bench.lib.projection import xla_gpu

    argv = list(argv if argv is not None else sys.argv[1:])
    args = parse_args(argv)
    why = xla_gpu.unavailable()
    if why is not None:
        raise InputError(f"dispatch: {why}")
    if args.calibrate:
        report = calibrate(args)
        CALIBRATION.parent.mkdir(parents=True, exist_ok=True)
        CALIBRATION.write_text(json.dumps(report, indent=1) + "\n")
        print(json.dumps(report["per"]))
        for p in report["rows"]:
            print(f"{p['system']:7s} {p['precision']:10s} measured {p['measured_s']:.2f} s, "
                  f"projected {p['projected_s']:.2f} s ({p['miss']:+.0%})  {p['source']}")
        return 0
    report = measure(args)
    report["command"] = presets.command("dispatch", argv)
    text = json.dumps(report, indent=1) if args.json else render(report)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(f"{args.out}.json").write_text(json.dumps(report, indent=1) + "\n")
    return 0
