"""Steady-state time of sym, padded and Tunix on one request, interleaved in one process.

Why besides ``bench/suite.py``: the suite runs each system in its own process, one after the
other, which is right for memory and compile counts but makes a steady-state time ratio hostage
to whatever else the machine is doing at that minute (on a shared 2-core CPU, runs of the same
configuration moved by 1.8×). Here every system is warmed up once, then called ``--reps`` times in
rotating order on the same request; each system's median ``run_seconds`` (padded: its execution
without the compile it repeats on every call; the others: the whole call) is reported, with the
ratios and a token check against padded.

    .venv/bin/python bench/tunix_paired.py --out bench/results/cpu/tunix_paired.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

SYSTEMS = ("sym-xla", "padded", "tunix", "tunix-defaults")


def request(scenario: str = "realistic") -> tuple[Any, list[np.ndarray], Any, dict[str, Any]]:
    """The suite's quick-preset request (same model, prompts and per-row limits)."""
    from suite import QUICK, plan

    from jaxrl_sym.cli import build_model
    from jaxrl_sym.generation import GenerationConfig

    job = next(j for j in plan(QUICK, systems=("padded",), scenarios=(scenario,)))
    spec = {**job.config, "system": "padded"}
    model, _ = build_model({**spec, "batch": 1, "prompt_len": [1, 1]})
    rng = np.random.default_rng(spec["seed"] + 1)  # as bench/suite_child.py draws them
    vocab = model.cfg.vocab_size
    prompts = [rng.integers(0, vocab, size=int(p), dtype=np.int32) for p in job.prompt_lens]
    cfg = GenerationConfig(max_new_tokens=tuple(int(x) for x in job.limits))
    return model, prompts, cfg, job.config


def rlft_request(preset: str = "cpu") -> tuple[Any, list[np.ndarray], Any, dict[str, Any]]:
    """``bench/rlft_step.py``'s generation request: its policy, each prompt repeated G times,
    each sample's sampled length as its limit. Greedy, so every system's tokens can be checked
    against padded's (Tunix samples with its own RNG); the step samples at temperature 1, which
    costs the same work per token."""
    from rlft_step import main_args, model_config, workload

    from jaxrl_sym.generation import GenerationConfig
    from jaxrl_sym.models.lm import init_model
    from jaxrl_sym.models.lm import preset as lm_preset

    args = main_args(["--preset", preset])
    prompts, limits = workload(args)
    model = init_model(lm_preset("small", **model_config(args)), args.seed)
    rows = [p for p in prompts for _ in range(args.group)]
    cfg = GenerationConfig(max_new_tokens=tuple(limits), temperature=0.0, eos_id=None)
    config = {"workload": "rlft", "preset": preset, "prompts": args.prompts,
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


def run(reps: int, systems: tuple[str, ...], workload: str = "suite") -> dict[str, Any]:
    from jaxrl_sym.systems import generator

    model, prompts, cfg, config = request() if workload == "suite" else rlft_request()
    gens = {s: generator(s, model) for s in systems}
    first, tokens, times = interleaved(gens, prompts, cfg, reps)
    med = {s: statistics.median(v) for s, v in times.items()}
    useful = int(sum(len(t) for t in tokens["padded"])) if "padded" in tokens else None
    return {
        "config": config, "reps": reps, "median_seconds": med, "seconds": times,
        "first_call": first, "useful_tokens": useful,
        "ratio_to_sym": {s: med[s] / med["sym-xla"] for s in systems} if "sym-xla" in med else {},
        "ratio_to_padded": {s: med[s] / med["padded"] for s in systems} if "padded" in med else {},
        "tokens_equal_padded": {s: all(np.array_equal(a, b) for a, b in
                                       zip(tokens[s], tokens["padded"], strict=True))
                                for s in systems if "padded" in tokens},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--out", default=None)
    p.add_argument("--workload", choices=("suite", "rlft"), default="suite",
                   help="suite: the suite's realistic request; rlft: bench/rlft_step.py's "
                        "GRPO rollout (16 prompts x 8, greedy)")
    args = p.parse_args(argv)
    from jaxrl_sym.report import write_peer_report

    report = run(args.reps, tuple(s.strip() for s in args.systems.split(",") if s.strip()),
                 args.workload)
    write_peer_report(report, "bench/tunix_paired.py", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
