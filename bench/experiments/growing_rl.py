"""An RL run whose responses grow: sym without a MAX_LEN beside padded at the cap it needs.

Issue 47 item 4. Reasoning RL's responses grow over training (DeepSeek-R1's mean by over an order
of magnitude), so a padded system sizes ``MAX_LEN`` for the worst case from step one. Here each
step draws :func:`jaxrl_sym.workloads.reasoning_growing` lengths — log-normal, the median rising
``--growth``-fold (10×) over ``--steps`` steps, a tail truncated at ``--cap`` — and one GRPO
trainer per system (each in its own process) takes every step in order. Random weights never emit
EOS, so each row gets its drawn length as its limit (as ``rlft_step``); both systems see the same
prompts and lengths; ``max_new_tokens`` is the cap for both (padded allocates it, sym's stores
grow to what the rows reach).

Per step it records what the trainer reports: ``compiles`` (cold programs this step: a program of
a length class already seen is not compiled again), generation's accounted bytes (stores, caches
and temporaries of the programs it ran: what follows the lengths), the step's ``peak_bytes``
(on a CPU the largest program seen so far, so non-decreasing), the update's layout, the step's
seconds and the longest response.

    python -m bench growing_rl --preset quick     # 6 steps, tiny
    python -m bench growing_rl --preset full      # 30 steps, cap 1024 (CPU, ~tens of minutes)
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from typing import Any

import numpy as np

from bench import presets
from bench.lib import child

PRESETS: dict[str, dict[str, Any]] = {
    # model: "cpu" (rlft_step's shrunk Qwen) or "gpu" (Qwen2.5-0.5B's shape)
    "quick": {"model": "cpu", "prompts": 2, "group": 2, "steps": 6, "cap": 256, "growth": 10.0,
              "seed": 0, "systems": "sym,padded",
              "out": os.path.join(presets.quick_dir("growing_rl"), "growing_rl.json")},
    "full": {"model": "cpu", "prompts": 4, "group": 2, "steps": 30, "cap": 512, "growth": 10.0,
             "seed": 0, "systems": "sym,padded",
             "out": os.path.join("bench", "results", "cpu", "growing_rl_cap512.json")},
    "gpu": {"model": "gpu", "prompts": 16, "group": 8, "steps": 30, "cap": 8192, "growth": 10.0,
            "seed": 0, "systems": "sym,padded",
            "out": os.path.join("bench", "results", "gpu", "growing_rl_cap8192.json")},
}


def steps_of(args: argparse.Namespace, vocab: int) -> list[tuple[list[np.ndarray], list[int]]]:
    """Each step's prompts (a group shares its first row's prompt length) and response limits.
    Prompts scale with the cap as the responses do (``REASONING_PROMPT`` is for a 16k cap), so a
    scaled-down run keeps the prompt/response proportions of the full one."""
    from jaxrl_sym.workloads import REASONING_PROMPT, reasoning_growing

    f = args.cap / 16384
    median, sigma, longest = REASONING_PROMPT
    prof = reasoning_growing(batch=args.prompts * args.group, steps=args.steps, cap=args.cap,
                             growth=args.growth, seed=args.seed,
                             prompt=(max(4.0, median * f), sigma, max(16, int(longest * f))))
    out = []
    for k, step in enumerate(prof.steps):
        rng = np.random.default_rng([args.seed, k, 1])
        prompts = [rng.integers(0, vocab, size=step.prompt_lens[g * args.group], dtype=np.int32)
                   for g in range(args.prompts)]
        out.append((prompts, [int(n) for n in step.response_lens]))
    return out


def run_system(args: argparse.Namespace) -> dict[str, Any]:
    """One trainer of ``args.system`` through every step; a row of numbers per step."""
    from bench.experiments import rlft_step
    from jaxrl_sym.models.lm import init_model, preset
    from jaxrl_sym.rl import RLConfig, RLTrainer

    shape = rlft_step.model_config(args)
    model = init_model(preset("small", **shape), args.seed)
    cfg = RLConfig.of(algo="grpo", group_size=args.group, beta=0.04, epochs=1,
                      max_new_tokens=args.cap, eos_id=None, lr=1e-4)
    trainer = RLTrainer(model, rlft_step.reward_fn, cfg, system=args.system)
    rows = []
    for k, (prompts, limits) in enumerate(steps_of(args, shape["vocab_size"])):
        m = trainer.step(prompts, seed=k, limits=limits)
        rows.append({"step": k, "median_limit": float(np.median(limits)),
                     "longest": int(max(limits)), "compiles": m["compiles"],
                     "compile_seconds": m["compile_seconds"],
                     "generation_bytes": m["generation_peak_bytes"],
                     "peak_bytes": m["peak_bytes"], "layout_shape": m["layout_shape"],
                     "padding_fraction": m["padding_fraction"],
                     "seconds": m["seconds"]["total"],
                     "generation_seconds": m["seconds"]["generation"], "kl": m["kl"]})
        print(json.dumps({"system": args.system, **rows[-1]}), flush=True)
    return {"system": args.system, "steps": rows,
            "cold_programs": sum(r["compiles"] for r in rows),
            "steps_with_compiles": [r["step"] for r in rows if r["compiles"]]}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = presets.parser("growing_rl", __doc__, PRESETS)
    count = presets.at_least(1)
    p.add_argument("--prompts", type=count, default=None)
    p.add_argument("--group", type=presets.at_least(2, " (GRPO compares a prompt's samples)"),
                   default=None)
    p.add_argument("--steps", type=presets.at_least(2), default=None)
    p.add_argument("--cap", type=presets.at_least(64), default=None,
                   help="the longest response: padded's MAX_LEN, the tail's truncation")
    p.add_argument("--growth", type=presets.finite_at_least(1.0), default=None,
                   help="the median's rise over the run (10: an order of magnitude)")
    p.add_argument("--seed", type=presets.at_least(0), default=None)
    p.add_argument("--systems", type=presets.systems(trains=True), default=None)
    p.add_argument("--out", default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return presets.parse(p, PRESETS, argv)


def _summary(report: dict[str, Any]) -> list[str]:
    lines = []
    for s, r in report["systems"].items():
        if "error" in r:
            lines.append(f"{s}: failed: {r['error'][-1] if r['error'] else ''}")
            continue
        st = r["steps"]
        gen = [x["generation_bytes"] for x in st]
        lines.append(f"{s}: {r['cold_programs']} cold programs (steps {r['steps_with_compiles']}"
                     f"), generation bytes {gen[0] / 2**20:.1f} -> {gen[-1] / 2**20:.1f} MiB "
                     f"(max {max(gen) / 2**20:.1f}), step s {st[0]['seconds']:.1f} -> "
                     f"{st[-1]['seconds']:.1f}, total {sum(x['seconds'] for x in st):.0f} s")
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        vars(args).update(json.loads(args.child))
        with open(args.child_out, "w") as f:
            json.dump(run_system(args), f)
        return 0
    config = {k: getattr(args, k) for k in ("model", "prompts", "group", "steps", "cap",
                                            "growth", "seed")}
    report: dict[str, Any] = {"config": config, "systems": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for s in presets.csv(args.systems):
            path = os.path.join(tmp, f"{s}.json")
            spec = json.dumps({**config, "system": s, "child_out": path})
            res = child.run(child.experiment("growing_rl", "--child", spec))
            if not res.ok:
                report["systems"][s] = {"error": (res.stderr or res.stdout).strip()
                                        .splitlines()[-20:]}
                continue
            with open(path) as f:
                report["systems"][s] = json.load(f)
    from jaxrl_sym.report import run_metadata

    report.update(run_metadata(presets.command("growing_rl", argv)))
    report["summary"] = _summary(report)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print("\n".join(report["summary"]) + f"\nwrote {args.out}")
    return 0 if all("error" not in r for r in report["systems"].values()) else 1
