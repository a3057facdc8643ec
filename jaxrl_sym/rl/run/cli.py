"""``jaxrl-sym train``: RL fine-tuning on an offline task from the command line.

Hooked into :mod:`jaxrl_sym.cli` by ``add_train_parser(subparsers)``; ``run_train(args)`` runs it.
stdout carries the result (a human summary, or with ``--json`` one JSON object as the last line);
the progress bar goes to stderr; per-step metrics go to ``--metrics`` as JSON lines, and a plot of
the run next to them (or to ``--plot``).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from typing import Any

from jaxrl_sym import jsonl
from jaxrl_sym.errors import InputError
from jaxrl_sym.rl.config import (
    CheckpointConfig,
    PartialConfig,
    RunConfig,
    speculation_of,
    task_rl_config,
)
from jaxrl_sym.rl.run.config_flags import add_knob_flags, add_run_flags, knobs_of, run_fields_of
from jaxrl_sym.rl.run.eval_cli import add_row_flags
from jaxrl_sym.rl.run.pretrained import setup as setup_pretrained
from jaxrl_sym.rl.run.trackers import ReportConfig  # JAX-free
from jaxrl_sym.rl.tasks.rewards import text_options
from jaxrl_sym.rl.tasks.text_tasks import DATASET_TASK
from jaxrl_sym.sharding import Distributed  # JAX-free at import
from jaxrl_sym.weights.lora_config import LoraConfig


def add_train_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``train`` sub-command to an ``argparse`` sub-parser group."""
    t = subparsers.add_parser("train", help="RL fine-tuning (GRPO/RLOO/PPO) on an offline task")
    # a knob's default is its config field's, read from there (one default per knob: the
    # library's; tests/test_one_default.py)
    t.add_argument("--checkpoint-dir", default=None, help="orbax checkpoints go here")
    t.add_argument("--checkpoint-every", type=int, default=CheckpointConfig.every,
                   help="save every K steps (and always at the end)")
    t.add_argument("--keep", type=int, default=CheckpointConfig.keep, metavar="K",
                   help="keep the newest K checkpoints; a resume falls back to an "
                        "older one when the newest fails verification")
    t.add_argument("--resume", action="store_true",
                   help="continue from the newest good checkpoint in --checkpoint-dir (an error "
                        "when it holds none, or when a setting that defines the run differs "
                        "from the checkpoint's; the optimizer and execution groups' settings "
                        "may change, with a warning, except --optimizer)")
    t.add_argument("--resume-or-start", action="store_true",
                   help="like --resume, but start a new run when --checkpoint-dir holds no "
                        "checkpoint")
    t.add_argument("--resume-anyway", action="store_true",
                   help="resume even though settings differ from the checkpoint's: the run is "
                        "then no longer the run that was checkpointed")
    t.add_argument("--metrics", default=None, help="per-step metrics, JSON lines")
    t.add_argument("--plot", default=None,
                   help="PNG of the run (default: next to --metrics, same name .png)")
    t.add_argument("--json", action="store_true",
                   help="print one JSON object (final_exact_match, params_sha256, ...) last")
    t.add_argument("--config", default=None, metavar="FILE",
                   help="a TOML file of flag values (keys are the flag names, e.g. steps = 200; "
                        "flags given here override it)")
    t.add_argument("--print-config", action="store_true",
                   help="print the effective flags as TOML (what --config reads) and exit")
    t.add_argument("--report-to", default=None,
                   help="trackers for every step's metrics, comma-separated: tensorboard, "
                        "wandb, mlflow (each an optional package; default: none)")
    t.add_argument("--log-dir", default=None,
                   help="the trackers' directory (default: runs/<start time>)")
    t.add_argument("--log-completions-every", type=int, default=ReportConfig.completions_every,
                   metavar="N", help="a table of sampled completions with their rewards every "
                                     "N steps (0: never)")
    _add_run_flags(t)
    _add_data_flags(t)
    t.add_argument("--no-progress", action="store_true")
    add_knob_flags(t)  # the step's knobs: one flag per field of RLConfig's parts
    return t


def _add_run_flags(t: argparse.ArgumentParser) -> None:
    """The run's flags: one per RunConfig field that one flag sets, generated from the field
    (:func:`~jaxrl_sym.rl.run.config_flags.add_run_flags`: its name, default, help and
    choices live there), then the flags that build a field together (LoRA, devices across
    processes, partial rollouts, speculation)."""
    g = add_run_flags(t)
    g.add_argument("--lora-rank", type=int, default=None, metavar="R",
                   help="train LoRA adapters of rank R over the frozen model instead of every "
                        "weight (the reference is the frozen base; checkpoints hold the adapters)")
    g.add_argument("--lora-alpha", type=float, default=None, metavar="A",
                   help="LoRA alpha: the adapters are scaled by alpha/R (default 32, TRL's)")
    g.add_argument("--lora-targets", default=None, metavar="PATTERN",
                   help="regex over parameter paths, e.g. '.*(q_proj|v_proj).kernel' (default: "
                        "all-linear: every 2-D kernel except the output head)")
    Distributed.add_flags(g, "the metrics, plot and summary")
    g.add_argument("--partial-rollout", type=float, default=None, metavar="FRACTION",
                   help="partial rollouts: a step stops generating once this share of its rows "
                        "finished, trains the complete groups and carries the rest into the "
                        "next step (default: off)")
    g.add_argument("--partial-segment", type=int, default=PartialConfig.segment, metavar="N",
                   help="with --partial-rollout on a system that cannot stop mid-generation "
                        "(padded): tokens per row per generation call; sym stops its one call "
                        "by itself, a decode tile after the rule holds")
    g.add_argument("--partial-max-carry", type=int, default=PartialConfig.max_carry,
                   metavar="K",
                   help="with --partial-rollout: steps a row may be carried")
    g.add_argument("--speculate", type=int, default=None, metavar="K",
                   help="speculative decoding, a prompt-lookup draft proposes up to "
                        "K tokens per row and the policy verifies them (same sampling "
                        "distribution; the metrics report acceptance_rate). Default 0: off")
    g.add_argument("--speculate-adaptive", action="store_true", default=None,
                   help="with --speculate (sym): k per verify from {1, 2, 4, ..., K} by "
                        "measured acceptance and verify cost")


def _add_data_flags(t: argparse.ArgumentParser) -> None:
    """Your data and your reward (``--model`` runs; :mod:`jaxrl_sym.rl.tasks.data`,
    :mod:`jaxrl_sym.rl.tasks.rewards`)."""
    t.add_argument("--dataset", default=None, metavar="PATH",
                   help="with --model, train on your rows instead of a --task: JSONL, JSON (a "
                        "list, or {\"data\": [...]}), CSV or Parquet (needs pyarrow), each row a "
                        "prompt (text or chat messages) and a numeric answer (GSM8K's question/"
                        "'... #### 72' answer work as they are); without --eval-dataset a fixed "
                        "10%% is held out for the final evaluation")
    add_row_flags(t)
    t.add_argument("--eval-dataset", default=None, metavar="PATH",
                   help="rows for the final evaluation (default: 10%% of --dataset, held out)")
    t.add_argument("--reward", action="append", default=None, metavar="NAME",
                   help="repeatable: exact_number, boxed, format, or module:function (a "
                        "function f(prompts, completions, **row_fields) -> list[float], "
                        "imported from the current directory); the reward is their weighted "
                        "sum, each logged as reward/NAME (default: the task's own reward)")
    t.add_argument("--reward-weights", default=None, metavar="W1,W2,...",
                   help="one weight per --reward, in order (default: 1 each)")


def text_of(args: argparse.Namespace) -> Any:
    """The run's :class:`~jaxrl_sym.rl.tasks.data.TextOptions` (None: none asked): the dataset read
    and checked, rewards imported — once per command line (the flag check and the run share
    it), and before JAX is imported."""
    if not hasattr(args, "_text"):
        if args.dataset is not None and args.task is not None:
            raise InputError(f"--dataset {args.dataset} replaces --task {args.task}: give one")
        args._text = text_options(
            dataset=args.dataset, prompt_field=args.prompt_field, answer_field=args.answer_field,
            eval_dataset=args.eval_dataset, system_prompt=args.system_prompt,
            reward=args.reward, reward_weights=args.reward_weights, model=args.model,
            partial_weight=args.partial_weight)
    return args._text


def _task(args: argparse.Namespace) -> str:
    """``--task``, else ``dataset`` with ``--dataset``, else the default ``reverse``."""
    return args.task or (DATASET_TASK if args.dataset is not None else "reverse")


def run_train(args: argparse.Namespace) -> int:
    """Run ``train`` with the parsed arguments; print the result; return an exit code.

    A bad input (unknown task, a checkpoint of another run, a failing reward) is reported as one
    ``error:`` line on stderr with exit code 2, not a traceback.
    """
    from jaxrl_sym.errors import InputError, SymError
    from jaxrl_sym.sharding import MeshConfig  # JAX-free: checked before JAX starts
    from jaxrl_sym.sizes import parse_bytes

    try:
        if args.mesh is not None:
            MeshConfig.parse(args.mesh)
        if args.device_memory is not None:
            parse_bytes(args.device_memory, flag="--device-memory")
        text_of(args)  # the dataset and rewards: read and imported before JAX
        report_of(args).check_installed()
        dist = Distributed.from_flags(args.coordinator, args.num_processes, args.process_id)
        if dist is not None and args.mesh is None:
            raise InputError(Distributed.NEEDS_MESH)
        reports = dist is None or _join(dist, args)
    except SymError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from jaxrl_sym.output_paths import check_output_file
    from jaxrl_sym.rl.run import interrupt
    from jaxrl_sym.rl.run.interrupt import Interrupted
    from jaxrl_sym.rl.run.train import train_run

    if dist is None:  # one process: SIGTERM / SIGINT end the run cleanly (rl/run/interrupt.py)
        interrupt.install()
    try:
        with _warnings_to_stderr():
            if args.plot:
                check_output_file(args.plot, "--plot")
            run, rl, checkpoints = train_configs(args)
            summary = train_run(run, rl, checkpoints, metrics_file=args.metrics,
                                progress=not args.no_progress, text=text_of(args),
                                report=report_of(args))
    except SymError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Interrupted as e:  # SIGTERM / SIGINT: the step finished or abandoned, state saved
        print(e.message, file=sys.stderr)
        return e.exit_code
    return _report(summary, args, reports)


def _report(summary: dict[str, Any], args: argparse.Namespace, reports: bool) -> int:
    """Print a finished run (its plot written where asked); the exit code."""
    from jaxrl_sym.rl.run.plot import plot_run, read_metrics

    hist = summary.pop("history")
    rows = read_metrics(args.metrics) if args.metrics and os.path.exists(args.metrics) else hist
    plot = args.plot or (os.path.splitext(args.metrics)[0] + ".png" if args.metrics else None)
    plot_error = None
    if plot and rows:
        try:
            summary["plot"] = plot_run(rows, plot, f"{summary['algo']} on {_shown(args)}, seed "
                                                   f"{args.seed}")
        except OSError as e:  # after the whole run: report it, never lose the summary
            flag = "--plot" if args.plot else "--metrics (its plot beside it)"
            plot_error = (f"{flag}: could not write {plot} ({e.strerror or e}); the run "
                          "finished and its summary is printed")
    summary.update(_first_last(rows))
    summary.update(task=_task(args), seed=args.seed, system=args.system)
    if not reports:
        print(f"{summary['steps']} steps done; process 0 reports",
              file=sys.stderr)
        return 0
    if args.json:
        print(jsonl.dumps(summary))
    else:
        print(f"{summary['algo']} on {_shown(args)}: {summary['steps']} steps"
              + (f" (resumed from {summary['resumed_from']})" if summary["resumed_from"] else "")
              + f", {summary['seconds']:.1f} s in this process")
        for k in ("final_exact_match", "first20_exact_match", "last20_exact_match",
                  "last20_reward", "params_sha256", "eval_source", "plot"):
            if summary.get(k) is not None:
                print(f"  {k}: {summary[k]}")
    if plot_error:
        print(f"error: {plot_error}", file=sys.stderr)
        return 1
    return 0


def _shown(args: argparse.Namespace) -> str:
    """The task as a person reads it: ``--dataset``'s file, else ``--task``."""
    return f"--dataset {args.dataset}" if args.dataset is not None else _task(args)


def _first_last(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Means of reward, exact match and KL over the run's first and last 20 steps."""
    out = {}
    for k in ("reward", "exact_match", "kl"):
        vals = [m[k] for m in rows if m.get(k) is not None]
        if vals:
            out[f"first20_{k}"] = sum(vals[:20]) / len(vals[:20])
            out[f"last20_{k}"] = sum(vals[-20:]) / len(vals[-20:])
    return out


def lora_of(args: argparse.Namespace) -> LoraConfig | None:
    """The run's LoRA from ``--lora-*`` (None without ``--lora-rank``), by LoraConfig's rules."""
    if args.lora_rank is None:
        given = [f for f, v in (("--lora-alpha", args.lora_alpha),
                                ("--lora-targets", args.lora_targets)) if v is not None]
        if given:
            raise InputError(f"{' and '.join(given)} set without --lora-rank: give --lora-rank R "
                             "to train LoRA adapters")
        return None
    kw = {k: v for k, v in (("alpha", args.lora_alpha), ("targets", args.lora_targets))
          if v is not None}
    try:
        return LoraConfig(rank=args.lora_rank, **kw)
    except InputError as err:
        raise InputError(f"--lora-rank/--lora-alpha/--lora-targets: {err}") from None


def train_configs(args: argparse.Namespace
                  ) -> tuple[RunConfig, dict[str, Any], CheckpointConfig]:
    """The run (with its speculation, from ``--speculate``), the step's knobs given (by field
    name, over the task's recipe) and the checkpoint policy the flags ask for — the objects
    ``train`` runs with, so building them checks the flags by the library's own rules (JAX-free:
    before JAX's import)."""
    partial = None if args.partial_rollout is None else PartialConfig(
        args.partial_rollout, args.partial_segment, args.partial_max_carry)
    run = RunConfig(**{**run_fields_of(args), "task": _task(args)}, partial=partial,
                    speculation=speculation_of(args.speculate, args.speculate_adaptive),
                    lora=lora_of(args))
    checkpoints = CheckpointConfig(args.checkpoint_dir, args.checkpoint_every, args.keep,
                                   args.resume, args.resume_or_start, args.resume_anyway)
    rl = knobs_of(args)  # the knobs given; the others are the recipe's, then the fields'
    return run, rl, checkpoints


def check_configs(args: argparse.Namespace) -> list[str]:
    """The library's objection to the flags' configs (empty: none), without JAX: the run, the
    checkpoint policy, partial rollouts and the step's RLConfig (on a text task its response
    limit and EOS come from the checkpoint's tokenizer later; a placeholder stands in here)."""
    try:
        text_of(args)  # the dataset and reward functions: each mistake named before JAX
        run, rl, _ = train_configs(args)
        limit = 1  # a text task's limit and EOS come from its checkpoint (read by train)
        if run.model_dir is None:
            setup_pretrained(None, run.task)  # a text task needs --model
            limit = run.task_of().max_new_tokens
        task_rl_config(run.steps, limit, None, rl)
    except InputError as e:
        return [str(e)]
    return []


def _join(dist: Any, args: argparse.Namespace) -> bool:
    """Join the multi-process run. Returns whether this process reports (process 0); the others
    drop the outputs process 0 writes (metrics, plot, progress: one each, not one per host).
    Every process trains and checkpoints: orbax coordinates the writes."""
    dist.initialize()
    if dist.reports():
        return True
    args.metrics, args.plot, args.no_progress = None, None, True
    args.report_to = None
    return False


def report_of(args: argparse.Namespace) -> Any:
    """The run's :class:`~jaxrl_sym.rl.run.trackers.ReportConfig` from ``--report-to``,
    ``--log-dir`` and ``--log-completions-every`` (its own checks name the flags)."""

    return ReportConfig.parse(args.report_to, log_dir=args.log_dir,
                              completions_every=args.log_completions_every)


@contextlib.contextmanager
def _warnings_to_stderr() -> Iterator[None]:
    """Show the library's warnings (a checkpoint skipped on resume, changed settings) as one
    ``warning:`` line each on stderr, whatever logging the process set up, and only once."""
    logger = logging.getLogger("jaxrl_sym")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("warning: %(message)s"))
    handler.setLevel(logging.WARNING)
    saved = logger.propagate
    logger.addHandler(handler)
    logger.propagate = False
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.propagate = saved


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry (``python -m jaxrl_sym.rl.run.cli train ...``)."""
    p = argparse.ArgumentParser(prog="jaxrl-sym")
    sub = p.add_subparsers(dest="cmd", required=True)
    add_train_parser(sub)
    return run_train(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
