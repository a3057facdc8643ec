"""``jaxrl-sym train``: RL fine-tuning on an offline task from the command line.

Hooked into :mod:`jaxrl_sym.cli` by ``add_train_parser(subparsers)``; ``run_train(args)`` runs it
and prints a JSON summary (the per-step metrics go to ``--metrics-file``).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from jaxrl_sym.rl.algorithms import ALGOS, LOSS_AGGS
from jaxrl_sym.rl.layout import SYSTEMS
from jaxrl_sym.rl.tasks import TASK_NAMES


def add_train_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``train`` sub-command to an ``argparse`` sub-parser group."""
    t = subparsers.add_parser("train", help="RL fine-tuning (GRPO/RLOO/PPO) on an offline task")
    t.add_argument("--algo", choices=ALGOS, default="grpo")
    t.add_argument("--task", choices=TASK_NAMES, default="reverse")
    t.add_argument("--steps", type=int, default=400)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--checkpoint-dir", default=None,
                   help="save here; a run finding a checkpoint here resumes from it")
    t.add_argument("--checkpoint-every", type=int, default=0)
    t.add_argument("--metrics-file", default=None, help="JSON lines, one per step")
    t.add_argument("--prompts", type=int, default=32, help="prompts per step")
    t.add_argument("--group", type=int, default=8, help="generations per prompt")
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--beta", type=float, default=0.0, help="KL weight (0: no reference pass)")
    t.add_argument("--epochs", type=int, default=1)
    t.add_argument("--loss-agg", choices=LOSS_AGGS, default=None,
                   help="default: the task recipe's (seq_mean)")
    t.add_argument("--entropy-coef", type=float, default=None,
                   help="default: the task recipe's (0.01)")
    t.add_argument("--system", choices=SYSTEMS, default="sym")
    t.add_argument("--max-digits", type=int, default=3)
    t.add_argument("--no-progress", action="store_true")
    return t


def run_train(args: argparse.Namespace) -> int:
    """Run ``train`` with the parsed arguments; print a JSON summary; return an exit code."""
    from jaxrl_sym.rl.train import train

    config = {k: v for k, v in (("loss_agg", args.loss_agg),
                                ("entropy_coef", args.entropy_coef)) if v is not None}
    summary = train(
        args.algo, args.task, args.steps, args.seed, args.checkpoint_dir, args.checkpoint_every,
        args.metrics_file, prompts_per_step=args.prompts, group_size=args.group, lr=args.lr,
        beta=args.beta, epochs=args.epochs, system=args.system, max_digits=args.max_digits,
        config=config or None, progress=not args.no_progress)
    hist = summary.pop("history")
    tail = hist[-20:]
    if tail:
        summary["last20"] = {k: sum(m[k] for m in tail) / len(tail)
                             for k in ("reward", "exact_match", "kl")
                             if tail[0].get(k) is not None}
    print(json.dumps(summary))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry (``python -m jaxrl_sym.rl.cli train ...``) until the main CLI hooks it."""
    p = argparse.ArgumentParser(prog="jaxrl-sym")
    sub = p.add_subparsers(dest="cmd", required=True)
    add_train_parser(sub)
    return run_train(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
