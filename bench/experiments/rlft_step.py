"""One RL fine-tuning step (GRPO + KL), symbolic runtime vs padded baseline.

Setting (FIELD_NOTES §5): 16 prompts × 8 generations, prompt lengths uniform in [64, 512], response
lengths log-normal with median 275 capped at 1024, on a Qwen2.5-0.5B-shaped policy with random
weights (``--preset gpu``: full size, for an H100/H200). ``--preset full`` shrinks the model (GQA
7:1, head dim 16, SwiGLU, tied embeddings, RoPE θ = 1e6) and divides the lengths by ``--scale`` (8);
``--preset quick`` is the same at 4 prompts × 2, lengths / 16, one step. Random weights never emit
EOS, so every row is given its sampled length as its generation limit (the row ends there, as if EOS
had been sampled); both systems get the same prompts and lengths.

"Largest batch that fits" is an *estimate*, labelled as such: the measured peak bytes minus the
batch-independent bytes (parameters, optimiser state, reference copy), divided by the number of
samples, extrapolated linearly to ``--memory-budget`` (default: the device's memory limit where
the backend reports one, else 16 GiB).

Each system runs in its own process (so peak RSS is its own): one warm-up step (compiles), then
``--steps`` measured steps on the same prompts and lengths with fresh sampling seeds (same shapes,
so nothing recompiles; the padded baseline's generation compiles on every call by design and its
compile time is reported separately, not in the stage times).

    python -m bench rlft_step --preset full     # table; JSON to bench/results/<device>/
    python -m bench rlft_step --preset gpu      # full size (GPU)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import tempfile
from typing import Any

import numpy as np

from bench import presets
from bench.lib import child
from jaxrl_sym.systems import BASELINE, REFERENCE
from jaxrl_sym.workloads import grpo_rollout, reasoning_rollout

# Qwen2.5-0.5B: 24 layers, d 896, 14 q / 2 kv heads of 64, FFN 4864, vocab 151,936, θ 1e6.
# Shrunk for a 2-core CPU, keeping the ratios that shape the cost (GQA 7:1, FFN ≈ 5.4·d).
QWEN_CPU: dict[str, Any] = dict(vocab_size=2048, d_model=112, n_layers=4, n_heads=7,
                                n_kv_heads=1, head_dim=16, ffn_dim=608, rope_theta=1e6)
STAGES = ("generation", "pack", "reference", "reward", "advantage", "update")
_SIZES = {"sigma": 0.6, "beta": 0.04, "seed": 0, "systems": "sym,padded", "memory_budget": None,
          "engine": None, "precision": "fp32", "lora_rank": None}
PRESETS: dict[str, dict[str, Any]] = {
    # model: "cpu" (QWEN_CPU) or "gpu" (Qwen2.5-0.5B's shape); lengths divided by scale
    "quick": {**_SIZES, "model": "cpu", "scale": 16, "prompts": 4, "group": 2, "steps": 1,
              "update_tokens": None, "out": os.path.join(presets.quick_dir("rlft_step"),
                                                         "rlft_step_cpu.json")},
    "full": {**_SIZES, "model": "cpu", "scale": 8, "prompts": 16, "group": 8, "steps": 2,
             "update_tokens": None, "out": None},
    # update_tokens: an update of 16384 slots of 151,936-word logits needed 77 GiB on an H100
    "gpu": {**_SIZES, "model": "gpu", "scale": 1, "prompts": 16, "group": 8, "steps": 2,
            "update_tokens": 4096, "out": None},
}


def model_config(args: argparse.Namespace) -> dict[str, Any]:
    """LMConfig fields of the policy for the preset's ``model`` (cpu: shrunk, gpu: Qwen2.5)."""
    if args.model == "gpu":
        from dataclasses import fields

        from jaxrl_sym.models.lm import preset

        full = preset("qwen2.5-0.5b")
        return {f.name: getattr(full, f.name) for f in fields(full) if f.name in QWEN_CPU}
    return dict(QWEN_CPU)


def workload(args: argparse.Namespace, vocab: int | None = None
             ) -> tuple[list[np.ndarray], list[int]]:
    """Prompts and per-sample response lengths (:func:`jaxrl_sym.workloads.grpo_rollout`, or
    with ``args.cap`` — ``project``/``dispatch --cap``, ``bench reasoning`` —
    :func:`jaxrl_sym.workloads.reasoning_rollout` at that cap); token ids below ``vocab``
    (default: the preset model's vocabulary)."""
    vocab = vocab or model_config(args)["vocab_size"]
    if getattr(args, "cap", None):
        return reasoning_rollout(prompts=args.prompts, group=args.group, cap=args.cap,
                                 vocab=vocab, seed=args.seed)
    return grpo_rollout(prompts=args.prompts, group=args.group, scale=args.scale,
                        sigma=args.sigma, vocab=vocab, seed=args.seed)


def reward_fn(prompt: np.ndarray, response: np.ndarray) -> float:
    """A cheap stand-in reward: share of response tokens that are even."""
    return float(np.mean(response % 2 == 0))


def rl_config(args: argparse.Namespace, limits: list[int]) -> Any:
    """The step's RLConfig (GRPO, one epoch, the workload's longest response; the flags given
    override the config's defaults, the others keep them): the projection's too."""
    from jaxrl_sym.rl import RLConfig

    chunk = {"logprob_chunk": args.logprob_chunk} if args.logprob_chunk else {}
    return RLConfig.of(algo="grpo", group_size=args.group, beta=args.beta, epochs=1,
                       max_new_tokens=max(limits), eos_id=None, lr=1e-4,
                       update_tokens=args.update_tokens or None, remat=not args.no_remat,
                       overlap_reference=False if getattr(args, "no_overlap_reference", False)
                       else None, **chunk)


def run_system(args: argparse.Namespace) -> dict[str, Any]:
    from jaxrl_sym.models.lm import init_model, preset
    from jaxrl_sym.rl import RLTrainer
    from jaxrl_sym.runtime.metrics import device_memory_limit, peak_rss_bytes, tree_bytes
    from jaxrl_sym.runtime.options import EngineOptions
    from jaxrl_sym.weights.lora_config import LoraConfig

    prompts, limits = workload(args)
    cfg = rl_config(args, limits)
    engine = EngineOptions(**json.loads(args.engine)) if args.engine else None
    trainer = RLTrainer(init_model(preset("small", **model_config(args)), args.seed), reward_fn,
                        cfg, system=args.system, engine=engine, precision=args.precision,
                        lora=LoraConfig(rank=args.lora_rank) if args.lora_rank else None)
    warm = trainer.step(prompts, seed=1, limits=limits)
    steps = [trainer.step(prompts, seed=2 + k, limits=limits) for k in range(args.steps)]

    def med(f):
        return statistics.median(f(m) for m in steps)

    stage = {s: med(lambda m, s=s: m["seconds"][s]) for s in STAGES}
    # generation without compile: the padded baseline re-compiles its program on every call
    stage["generation"] = med(lambda m: m["generation_run_seconds"])
    total = sum(stage.values())
    m0 = steps[0]
    peak = max(m["peak_bytes"] for m in [warm, *steps])
    fixed = trainer.state.resident_bytes() + tree_bytes(trainer.params)
    per_sample = max(1.0, (peak - fixed) / len(limits))
    budget = args.memory_budget or device_memory_limit() or 16 * 2**30
    return {
        "system": args.system,
        "seconds": {**stage, "total": total},
        "generation_compile_seconds_per_step": med(lambda m: m["generation_compile_seconds"]),
        "warmup_seconds": warm["seconds"]["total"],
        "warmup_compiles": warm["compiles"],
        "measured_step_compiles": [m["compiles"] for m in steps],
        "useful_tokens": m0["useful_tokens"],
        "generated_tokens": m0["generated_tokens"],
        "useful_tokens_per_s": m0["useful_tokens"] / total,
        "generation_tokens_per_s": m0["generated_tokens"] / stage["generation"],
        "train_tokens_per_s": m0["useful_tokens"] / stage["update"],
        "padding_fraction": m0["padding_fraction"],
        "layout_shape": m0["layout_shape"],
        "peak_bytes": peak,
        # the allocator's peak at the end of each stage of the warm-up step, the process's
        # first: the peak only grows, so the stage where it first jumps is where it was reached
        # (in a later step every stage shows the warm-up's peak; H100 run of 2026-11-26)
        "peak_bytes_after_stage": warm.get("peak_bytes_after_stage", {}),
        "peak_source": warm.get("peak_source"),
        "batch_independent_bytes": fixed,
        "memory_budget_bytes": budget,
        "largest_batch_estimate": int(max(0, budget - fixed) // per_sample),
        "reference_chunks_during_generation": m0["reference_chunks_during_generation"],
        "peak_rss_bytes": peak_rss_bytes(),
        "kl": m0["kl"],
        "reward": m0["reward"],
    }


def ratios(report: dict[str, Any]) -> dict[str, float]:
    """sym vs padded, side by side from the same run (> 1 means sym is better)."""
    s, p = (report["systems"].get(REFERENCE, {}), report["systems"].get(BASELINE, {}))
    if "error" in s or "error" in p or not s or not p:
        return {}
    return {
        "useful_tokens_per_s": s["useful_tokens_per_s"] / p["useful_tokens_per_s"],
        "step_seconds": p["seconds"]["total"] / s["seconds"]["total"],
        "generation_seconds": p["seconds"]["generation"] / s["seconds"]["generation"],
        "reference_seconds": p["seconds"]["reference"] / max(s["seconds"]["reference"], 1e-9),
        "update_seconds": p["seconds"]["update"] / s["seconds"]["update"],
        "peak_bytes": p["peak_bytes"] / s["peak_bytes"],
        "largest_batch_estimate": (s["largest_batch_estimate"]
                                   / max(p["largest_batch_estimate"], 1)),
    }


def _table(report: dict[str, Any]) -> str:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="RL step (GRPO, beta={beta}), {prompts}x{group}, preset {preset}, "
                    "scale 1/{scale}".format(**report["config"]))
    t.add_column("metric")
    systems = list(report["systems"])
    for s in systems:
        t.add_column(s, justify="right")
    rows: list[tuple[str, Any]] = [(f"{s} s", lambda r, s=s: r["seconds"][s])
                                   for s in (*STAGES, "total")]
    rows += [
        ("useful tokens/s", lambda r: r["useful_tokens_per_s"]),
        ("generated tokens/s", lambda r: r["generation_tokens_per_s"]),
        ("train tokens/s", lambda r: r["train_tokens_per_s"]),
        ("train padding fraction", lambda r: r["padding_fraction"]),
        ("train layout", lambda r: "x".join(map(str, r["layout_shape"]))),
        ("peak MB", lambda r: r["peak_bytes"] / 2**20),
        ("largest batch (estimate)", lambda r: r["largest_batch_estimate"]),
        ("ref chunks during generation", lambda r: r["reference_chunks_during_generation"]),
        ("peak RSS MB", lambda r: r["peak_rss_bytes"] / 2**20),
        ("gen compile s/step", lambda r: r["generation_compile_seconds_per_step"]),
        ("warm-up s (compiles)", lambda r: f"{r['warmup_seconds']:.1f} "
                                           f"({r['warmup_compiles']})"),
    ]
    for name, f in rows:
        vals = []
        for s in systems:
            r = report["systems"][s]
            v = "error" if "error" in r else f(r)
            vals.append(f"{v:.4g}" if isinstance(v, float) else str(v))
        t.add_row(name, *vals)
    console = Console(record=True, width=120)
    with console.capture() as cap:
        console.print(t)
        for s, r in report["systems"].items():
            if "error" in r:
                console.print(f"[red]{s} failed:[/red] {r['error']}")
        if report.get("ratios"):
            console.print("sym vs padded (> 1: sym better): " + ", ".join(
                f"{k} {v:.2f}x" for k, v in report["ratios"].items()))
    return cap.get()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The parsed command line, every preset setting filled in (other benchmarks reuse the
    workload and the policy through it)."""
    p = presets.parser("rlft_step", __doc__, PRESETS)
    count = presets.at_least(1)
    p.add_argument("--systems", default=None, type=presets.systems(trains=True),
                   help="comma-separated: sym, padded")
    p.add_argument("--prompts", type=count, default=None)
    p.add_argument("--group", type=presets.at_least(2, " (GRPO compares a prompt's samples "
                                                       "with each other)"), default=None)
    p.add_argument("--scale", type=count, default=None,
                   help="divide the paper's lengths by this (the preset's: 16, 8 or 1)")
    p.add_argument("--steps", type=count, default=None, help="measured steps after the warm-up")
    p.add_argument("--sigma", type=presets.finite_at_least(0.0), default=None,
                   help="log-normal sigma of lengths")
    p.add_argument("--seed", type=presets.at_least(0), default=None)
    p.add_argument("--precision", default=None, choices=("fp32", "bf16-mixed", "bf16"),
                   help="the trainer's precision policy (preset: fp32, as the first H100 run)")
    p.add_argument("--lora-rank", default=None,
                   type=presets.at_least(1, "; omit --lora-rank to measure full fine-tuning"),
                   help="train LoRA adapters of this rank (alpha 2x, all linear layers) instead "
                        "of every weight")
    p.add_argument("--update-tokens", type=count, default=None,
                   help="update_tokens: token slots per training micro-batch")
    p.add_argument("--logprob-chunk", type=count, default=None,
                   help="logprob_chunk: token slots whose logits exist at once")
    p.add_argument("--engine", default=None, metavar="JSON",
                   type=presets.json_object(presets.engine_options),
                   help="EngineOptions fields for the trainer's generation, e.g. "
                        "'{\"min_capacity\": 16}' (default: the RL trainer's own)")
    p.add_argument("--no-remat", action="store_true",
                   help="remat=False: keep the layers' activations for the backward")
    p.add_argument("--no-overlap-reference", action="store_true",
                   help="overlap_reference=False: score the reference after generation, "
                        "not during it (on an accelerator it overlaps by default)")
    p.add_argument("--out", default=None,
                   help="write the report here (default bench/results/<device>/rlft_step_"
                        "<model>.json)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return presets.parse(p, PRESETS, argv)


def _measure(args: argparse.Namespace, config: dict[str, Any], tmp: str) -> dict[str, Any]:
    """Each system's step in its own process (``--child``: this module with one system)."""
    out: dict[str, Any] = {}
    for s in presets.csv(args.systems):
        path = os.path.join(tmp, f"{s}.json")
        spec = {**config, "model": args.model, "system": s, "out": path}
        res = child.run(child.experiment("rlft_step", "--child", json.dumps(spec)))
        if not res.ok:  # the traceback's end, and whether it ran out of memory
            out[s] = {"error": (res.stderr or res.stdout).strip().splitlines()[-40:],
                      "status": "oom" if res.status == "oom" else "error"}
            continue
        with open(path) as f:
            out[s] = json.load(f)
    return out


def variant(args: argparse.Namespace) -> str:
    """The file-name suffix of a non-default precision or LoRA run (fp32 full FT: none)."""
    return ("" if args.precision == "fp32" else "_" + args.precision.replace("-", "")) + (
        f"_lora{args.lora_rank}" if args.lora_rank else "")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:  # child process: one system
        spec = json.loads(args.child)
        vars(args).update(spec)
        res = run_system(args)
        with open(spec["out"], "w") as f:
            json.dump(res, f)
        return 0
    # "preset" in the report: the model (cpu/gpu), as the committed reports have it
    config = {"preset": args.model, **{k: getattr(args, k) for k in (
        "scale", "prompts", "group", "sigma", "beta", "steps", "seed", "precision")},
              "remat": not args.no_remat}
    if args.no_overlap_reference:
        config["overlap_reference"] = False
    for k in ("memory_budget", "update_tokens", "engine", "lora_rank", "logprob_chunk"):
        if getattr(args, k):
            config[k] = getattr(args, k)
    _, limits = workload(args)
    report: dict[str, Any] = {"config": config, "model": model_config(args),
                              "response_lengths": {"median": float(np.median(limits)),
                                                   "max": max(limits), "min": min(limits)}}
    with tempfile.TemporaryDirectory() as tmp:
        report["systems"] = _measure(args, config, tmp)
    from jaxrl_sym.report import run_metadata

    report.update(run_metadata(presets.command("rlft_step", argv)))
    report["ratios"] = ratios(report)
    print(_table(report))
    path = args.out or os.path.join(
        child.ROOT, "bench", "results",
        re.sub(r"[^a-z0-9]+", "-", report["device"].lower()).strip("-"),  # as the suite's
        f"rlft_step_{args.model}{variant(args)}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {path}")
    return 0 if all("error" not in r for r in report["systems"].values()) else 1
