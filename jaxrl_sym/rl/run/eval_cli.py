"""The ``eval`` sub-command's flags and runner (:mod:`jaxrl_sym.rl.run.evaluate`).

Its flags are checked before JAX is imported: the dataset is read and every row checked, the
reward functions imported, the numbers put in their domains (:class:`EvalConfig`); only then is
the model loaded.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from jaxrl_sym import jsonl, systems
from jaxrl_sym.errors import InputError, SymError
from jaxrl_sym.rl.run.evaluate import EvalConfig


def add_row_flags(p: argparse.ArgumentParser) -> None:
    """How a dataset's rows read (``train --dataset`` and ``eval``: one definition)."""
    p.add_argument("--prompt-field", default=None, metavar="NAME",
                   help="the rows' prompt field (default: prompt, else question)")
    p.add_argument("--answer-field", default=None, metavar="NAME",
                   help="the rows' answer field (default: answer)")
    p.add_argument("--system-prompt", default=None, metavar="TEXT",
                   help="a system message before every prompt, through the chat template")


def add_eval_parser(sub: Any, formatter: type) -> argparse.ArgumentParser:
    e = sub.add_parser("eval", formatter_class=formatter,
                       help="score a checkpoint or a trained run on a dataset: greedy accuracy "
                            "and pass@k with your rewards")
    src = e.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", metavar="DIR", help="a Hugging Face checkpoint directory or GGUF")
    src.add_argument("--checkpoint-dir", metavar="RUN",
                     help="a `train --model` run: its trained policy (newest step, or --step)")
    e.add_argument("--step", type=int, default=None, help="with --checkpoint-dir: this step")
    e.add_argument("--dataset", required=True, metavar="PATH",
                   help="JSONL, JSON, CSV or Parquet rows, as `train --dataset` reads them "
                        "(every row is evaluated; --limit N the first N)")
    add_row_flags(e)
    e.add_argument("--reward", action="append", default=None, metavar="NAME",
                   help="repeatable, as for train: exact_number, boxed, format or "
                        "module:function (default: the built-in answer reward)")
    e.add_argument("--reward-weights", default=None, metavar="W1,W2,...")
    d = EvalConfig()
    e.add_argument("--samples", type=int, default=d.samples, metavar="K",
                   help="sampled completions per prompt for pass@k (default 0: greedy only)")
    e.add_argument("--temperature", type=float, default=d.temperature,
                   help="the samples' temperature (default %(default)s)")
    e.add_argument("--seed", type=int, default=d.seed)
    e.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    e.add_argument("--limit", type=int, default=None, metavar="N",
                   help="evaluate the first N rows")
    gen = systems.names(peer=False)  # read here: plugins load before the parser is built
    e.add_argument("--system", choices=gen, default=d.system,
                   help="; ".join(f"{n}: {systems.get(n).summary}" for n in gen))
    e.add_argument("--rows", default=None, metavar="FILE",
                   help="write one JSON line per row (prompt, completion, correct, reward)")
    return e


def config_of(args: argparse.Namespace) -> EvalConfig:
    return EvalConfig(samples=args.samples, temperature=args.temperature, seed=args.seed,
                      max_new_tokens=args.max_new_tokens, limit=args.limit, system=args.system)


def _inputs(args: argparse.Namespace) -> tuple[EvalConfig, Any, list[Any]]:
    """The flags checked and the rows read, JAX-free."""
    from jaxrl_sym.output_paths import check_output_file
    from jaxrl_sym.rl.tasks.data import Fields, load_dataset
    from jaxrl_sym.rl.tasks.rewards import text_options

    cfg = config_of(args)
    if args.step is not None and args.checkpoint_dir is None:
        raise InputError("--step applies to --checkpoint-dir RUN, which is not given")
    source = args.model or args.checkpoint_dir
    if not os.path.exists(source):
        flag = "--model" if args.model else "--checkpoint-dir"
        raise InputError(f"{flag} {source}: no such file or directory")
    if args.rows:
        check_output_file(args.rows, "--rows")
    options = text_options(system_prompt=args.system_prompt, reward=args.reward,
                           reward_weights=args.reward_weights, model=source)
    problems = load_dataset(args.dataset, Fields(args.prompt_field or Fields.prompt,
                                                 args.answer_field or Fields.answer))
    if options is not None and options.rewards is not None:
        options.rewards.check_fields(set().union(*(p.fields or {"answer"} for p in problems)))
    return cfg, options, problems[:cfg.limit]


def _model(args: argparse.Namespace) -> tuple[Any, str]:
    """The model to evaluate and the directory its tokenizer comes from."""
    if args.model is not None:
        from jaxrl_sym.models.hf import load_pretrained

        return load_pretrained(args.model)[0], args.model
    from jaxrl_sym.rl.run.export import restore_policy, source_model

    return restore_policy(args.checkpoint_dir, args.step)[0], source_model(
        args.checkpoint_dir, args.step)


def run_eval(args: argparse.Namespace) -> int:
    """Check, load, evaluate; print the summary as one JSON line (exit 2 on a bad input)."""
    try:
        cfg, options, problems = _inputs(args)
        from jaxrl_sym.models.hf.text import HFText, find_eos_ids
        from jaxrl_sym.rl.run.evaluate import dataset_task, evaluate_rows

        model, tok_dir = _model(args)
        text = HFText(tok_dir)
        task = dataset_task(problems, args.dataset, text, cfg, options)
        eos = find_eos_ids(tok_dir, text.tokenizer)
        report = evaluate_rows(model, task, problems, cfg, tuple(eos))
    except SymError as e:
        print(f"jaxrl-sym eval: error: {e}", file=sys.stderr)
        return 2
    summary = {**report["summary"], "dataset": os.path.abspath(args.dataset),
               "model": os.path.abspath(args.model or args.checkpoint_dir)}
    if args.rows:
        with open(args.rows, "w") as f:
            f.writelines(jsonl.dumps(r) + "\n" for r in report["records"])
    print(jsonl.dumps(summary))
    return 0
