"""Window / mixed decode, steady state: sym (xla) vs padded vs Tunix's ring-cached Gemma 4.

Why: on a sliding window the fair Tunix opponent is not its Qwen2 (full attention only) but its
Gemma 4, which keeps a ring of ``window`` KV slots per local layer, as sym's window store does.
Tunix's Gemma 4 cannot hold our weights (its block differs: see
:mod:`jaxrl_sym.baselines.tunix_gemma4`), so it runs with its own random initialisation at our
model's shape: a *speed at equal shape* comparison; its tokens are not compared (sym's are
checked against padded's). Same request for every system (the decode CLI's model and prompts:
the preset's model, batch rows, prompts 16–64, every row decoding ``--tokens``), each system
warmed up once, then called ``reps`` times in rotating order (``tunix_paired.interleaved``); the
median ``run_seconds`` / tokens is the steady-state time per decode step.

    python -m bench tunix_window --preset full --out bench/results/cpu/tunix_window
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import numpy as np

from bench import presets
from bench.experiments.tunix_paired import interleaved
from bench.lib.roles import BASELINE, reference

SYSTEMS = ("sym-xla", "padded", "tunix-gemma4")
_CPU = {"window": 128, "batch": 8, "prompt_min": 16, "prompt_max": 64, "model": "decode-cpu",
        "seed": 0, "systems": ",".join(SYSTEMS), "out": None}
PRESETS: dict[str, dict[str, Any]] = {
    "quick": {**_CPU, "attention": "window", "tokens": "32", "window": 16, "batch": 2,
              "prompt_min": 4, "prompt_max": 12, "model": "tiny", "reps": 1},
    "full": {**_CPU, "attention": "window,mixed", "tokens": "512,1024", "reps": 5},
    "gpu": {**_CPU, "attention": "window,mixed", "tokens": "512,1024", "reps": 5},
}


def _generators(model: Any, systems: tuple[str, ...]) -> dict[str, Any]:
    from jaxrl_sym import systems as registry

    return {s: registry.get(s).bind(model) for s in systems}


def one(attention: str, tokens: int, args: argparse.Namespace) -> dict[str, Any]:
    """One configuration: every system's first call, steady s/token (median of ``reps``), peak
    bytes and compiles; sym's tokens checked against padded's."""
    from jaxrl_sym import systems as registry
    from jaxrl_sym.decode_run import build_model
    from jaxrl_sym.generation import GenerationConfig

    spec = {"preset": args.model, "attention": attention, "window": args.window,
            "block": 64, "seed": args.seed, "batch": args.batch,
            "prompt_len": [args.prompt_min, args.prompt_max]}
    model, prompts = build_model(spec)
    cfg = GenerationConfig(max_new_tokens=tokens, temperature=0.0, eos_id=None)
    systems = tuple(presets.csv(args.systems))
    first, toks, times = interleaved(_generators(model, systems), prompts, cfg, args.reps)
    med = {s: statistics.median(v) for s, v in times.items()}
    rows = {s: {"s_per_token": med[s] / tokens, "median_seconds": med[s], "seconds": times[s],
                "first_call_seconds": first[s]["seconds"],
                "xla_compiles_first_call": first[s]["xla_compiles"],
                "peak_bytes": first[s]["peak_bytes"], "stats": first[s]["stats"],
                "rows_with_all_tokens": sum(len(t) == tokens for t in toks[s])}
            for s in systems}
    out: dict[str, Any] = {"attention": attention, "window": args.window, "tokens": tokens,
                           "prompt_lens": [int(p.size) for p in prompts], "systems": rows}
    ref = reference(systems)
    if ref:
        out["ratio_to_sym"] = {s: med[s] / med[ref] for s in systems}
    if BASELINE in toks:  # a peer on its own weights (Tunix's Gemma 4) is not comparable
        out["tokens_equal_padded"] = {
            s: all(np.array_equal(a, b) for a, b in zip(toks[s], toks[BASELINE], strict=True))
            for s in systems if registry.get(s).same_function}
    return out


def markdown(report: dict[str, Any]) -> str:
    """The results table (one row per configuration and system)."""
    lines = [f"# Window/mixed decode vs Tunix's ring-cached Gemma 4 ({report['device']}, "
             f"{report['date']})", "", f"`{report['command']}`", "",
             "Tunix Gemma 4: its own random init at the same shape (tokens not comparable; "
             "speed at equal shape). Steady state: median of "
             f"{report['reps']} interleaved calls after one warm-up call.", "",
             "| attention | tokens | system | ms/token median (min) | × sym | peak MB "
             "| first call s | compiles (first call) | tokens = padded |", "|---" * 9 + "|"]
    for c in report["configs"]:
        for s, m in c["systems"].items():
            eq = c.get("tokens_equal_padded", {}).get(s, "n/a (other weights)")
            peak = m["peak_bytes"] / 1e6 if m["peak_bytes"] is not None else float("nan")
            fastest = 1e3 * min(m["seconds"]) / c["tokens"]
            lines.append(f"| {c['attention']} {c['window']} | {c['tokens']} | {s} | "
                         f"{1e3 * m['s_per_token']:.2f} ({fastest:.2f}) | "
                         f"{c['ratio_to_sym'].get(s, 0):.2f} | "
                         f"{peak:.1f} | {m['first_call_seconds']:.1f} | "
                         f"{m['xla_compiles_first_call']} | {eq} |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, every setting of the chosen preset filled in."""
    p = presets.parser("tunix_window", __doc__, PRESETS)
    p.add_argument("--attention", default=None, type=presets.names(("window", "mixed"),
                                                                     "attention"),
                   help="comma-separated: window, mixed")
    p.add_argument("--tokens", default=None, type=presets.ints(1),
                   help="comma-separated tokens per row")
    p.add_argument("--systems", default=None, type=presets.systems(),
                   help="comma-separated: " + ", ".join(SYSTEMS))
    p.add_argument("--out", default=None, help="write OUT.json and OUT.md")
    return presets.parse(p, PRESETS, argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from jaxrl_sym.report import run_metadata

    configs = [one(a, n, args) for a in presets.csv(args.attention)
               for n in presets.csv(args.tokens, int)]
    report = {"reps": args.reps, "batch": args.batch, "preset": args.model,
              "configs": configs, **run_metadata(presets.command("tunix_window", argv))}
    import importlib.metadata as md

    report["versions"]["google-tunix"] = md.version("google-tunix")
    text = json.dumps(report, indent=1)
    if args.out:
        Path(args.out + ".json").write_text(text)
        Path(args.out + ".md").write_text(markdown(report))
    print(markdown(report))
    return 0
