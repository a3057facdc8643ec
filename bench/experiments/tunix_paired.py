"""Steady-state time of sym, padded and Tunix on one request, interleaved in one process.

Why besides ``python -m bench suite``: the suite runs each system in its own process, one after the
other, which is right for memory and compile counts but makes a steady-state time ratio hostage
to whatever else the machine is doing at that minute (on a shared 2-core CPU, runs of the same
configuration moved by 1.8×). Here every system is warmed up once, then called ``--reps`` times in
rotating order on the same request; each system's median ``run_seconds`` (padded: its execution
without the compile it repeats on every call; the others: the whole call) is reported, with the
ratios and a token check against padded.

    python -m bench tunix_paired --preset full --out bench/results/cpu/tunix_paired.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import numpy as np

from bench import presets
from bench.experiments import rlft_step
from bench.experiments.suite import grid
from bench.lib.record import peer_report
from bench.lib.roles import BASELINE, reference
from bench.lib.suite.suite_jobs import suite_request

SYSTEMS = ("sym-xla", "padded", "tunix", "tunix-defaults")
PRESETS: dict[str, dict[str, Any]] = {
    "quick": {"reps": 1, "systems": "sym-xla,padded,tunix", "workload": "suite",
              "out": None},
    "full": {"reps": 7, "systems": ",".join(SYSTEMS), "workload": "suite", "out": None},
    "gpu": {"reps": 7, "systems": ",".join(SYSTEMS), "workload": "suite", "out": None},
}


def request(preset: str) -> tuple[Any, list[np.ndarray], Any, dict[str, Any]]:
    """The suite preset's realistic request (same model, prompts and per-row limits)."""
    return suite_request(grid(preset), "realistic")


def rlft_request(preset: str) -> tuple[Any, list[np.ndarray], Any, dict[str, Any]]:
    """``rlft_step``'s generation request at ``preset``: its policy, each prompt repeated G times,
    each sample's sampled length as its limit. Greedy, so every system's tokens can be checked
    against padded's (Tunix samples with its own RNG); the step samples at temperature 1, which
    costs the same work per token."""
    from jaxrl_sym.generation import GenerationConfig
    from jaxrl_sym.models.lm import init_model
    from jaxrl_sym.models.lm import preset as lm_preset

    args = rlft_step.parse_args(["--preset", preset])
    prompts, limits = rlft_step.workload(args)
    model = init_model(lm_preset("small", **rlft_step.model_config(args)), args.seed)
    rows = [p for p in prompts for _ in range(args.group)]
    cfg = GenerationConfig(max_new_tokens=tuple(limits), temperature=0.0, eos_id=None)
    config = {"workload": "rlft", "preset": args.model, "prompts": args.prompts,
              "group": args.group, "sigma": args.sigma, "scale": args.scale}
    return model, rows, cfg, config


def interleaved(gens: dict[str, Any], prompts: list[np.ndarray], cfg: Any, reps: int
                ) -> tuple[dict[str, Any], dict[str, list[np.ndarray]], dict[str, list[float]]]:
    """Each system's first call (seconds, compiles), its tokens, and ``reps`` steady-state
    ``run_seconds`` taken in rotating order (so load drifts hit every system alike)."""
    systems = tuple(gens)
    first: dict[str, Any] = {}
    tokens: dict[str, list[np.ndarray]] = {}
    for s, gen in gens.items():
        t0 = time.perf_counter()
        out = gen(prompts, cfg)
        first[s] = {"seconds": time.perf_counter() - t0, "xla_compiles": out.stats["xla_compiles"],
                    "peak_bytes": out.stats.get("peak_bytes"),
                    "stats": {k: v for k, v in out.stats.items() if isinstance(v, int | float)}}
        tokens[s] = out.tokens
    times: dict[str, list[float]] = {s: [] for s in systems}
    for r in range(reps):
        order = systems[r % len(systems):] + systems[:r % len(systems)]
        for s in order:
            times[s].append(float(gens[s](prompts, cfg).stats["run_seconds"]))
    return first, tokens, times


def run(reps: int, systems: tuple[str, ...], workload: str = "suite",
        preset: str = "full") -> dict[str, Any]:
    from jaxrl_sym import systems as registry

    model, prompts, cfg, config = (request if workload == "suite" else rlft_request)(preset)
    gens = {s: registry.get(s).bind(model) for s in systems}
    first, tokens, times = interleaved(gens, prompts, cfg, reps)
    med = {s: statistics.median(v) for s, v in times.items()}
    ref, base = reference(systems), BASELINE if BASELINE in tokens else None
    return {
        "config": config, "reps": reps, "median_seconds": med, "seconds": times,
        "first_call": first,
        "useful_tokens": int(sum(len(t) for t in tokens[base])) if base else None,
        "ratio_to_sym": {s: med[s] / med[ref] for s in systems} if ref else {},
        "ratio_to_padded": {s: med[s] / med[base] for s in systems} if base else {},
        "tokens_equal_padded": {s: all(np.array_equal(a, b) for a, b in
                                       zip(tokens[s], tokens[base], strict=True))
                                for s in systems} if base else {},
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, every setting of the chosen preset filled in."""
    p = presets.parser("tunix_paired", __doc__, PRESETS)
    p.add_argument("--reps", type=presets.at_least(1), default=None,
                   help="steady-state calls per system")
    p.add_argument("--systems", default=None, type=presets.systems(),
                   help="comma-separated: " + ", ".join(SYSTEMS))
    p.add_argument("--workload", choices=("suite", "rlft"), default=None,
                   help="suite: the suite preset's realistic request; rlft: rlft_step's GRPO "
                        "rollout at the preset (greedy)")
    p.add_argument("--out", default=None, help="write the JSON report here")
    return presets.parse(p, PRESETS, argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = run(args.reps, tuple(presets.csv(args.systems)), args.workload, args.preset)
    peer_report(report, presets.command("tunix_paired", argv), args.out)
    return 0
