"""The training loop: task prompts → RL steps → JSON-lines metrics, checkpoints, resume.

Reproducibility is by construction: the prompts and the sampling seed of step k are functions of
``(seed, k)`` only, and everything else that evolves (parameters, optimiser state) is in the
checkpoint. So a run interrupted after the checkpoint of step k and resumed replays steps k+1.. on
exactly the state the uninterrupted run had, and ends with the same ``params_sha256``.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jaxrl_sym import jsonl
from jaxrl_sym.errors import InputError
from jaxrl_sym.models.lm import init_model, preset
from jaxrl_sym.output_paths import check_output_file
from jaxrl_sym.rl.config import (
    TASK_RECIPE,
    TASK_REWARD,
    CheckpointConfig,
    PartialConfig,
    RLConfig,
    RunConfig,
    speculation_of,
    task_rl_config,
)
from jaxrl_sym.rl.errors import RewardError
from jaxrl_sym.rl.knobs import AlgorithmConfig
from jaxrl_sym.rl.run.checkpoint import Checkpointer, fingerprint
from jaxrl_sym.rl.run.identity import (
    FLAGS,
    ResumeMismatchError,
    flat_hparams,
    hparam_diffs,
    hparams_of,
    resume_checked,
    run_hparams,
)
from jaxrl_sym.rl.run.interrupt import Interrupted, abandoned, graceful
from jaxrl_sym.rl.run.pretrained import setup as setup_pretrained
from jaxrl_sym.rl.run.progress import Bar, GreedyDrift, RunHealth, recipe_line
from jaxrl_sym.rl.run.run_files import (
    open_checkpoints,
    prepare_metrics,
    save_last,
    saved_note,
)
from jaxrl_sym.rl.run.trackers import Report, ReportConfig
from jaxrl_sym.rl.step.stages import DivergedError
from jaxrl_sym.rl.step.trainer import RLTrainer
from jaxrl_sym.rl.tasks.data import TextOptions
from jaxrl_sym.rl.tasks.rewards import reward_failure
from jaxrl_sym.rl.tasks.token_tasks import EOS, VOCAB_SIZE, Task
from jaxrl_sym.runtime.metrics import trim_host_heap
from jaxrl_sym.runtime.options import EngineOptions
from jaxrl_sym.sharding import MeshConfig, describe
from jaxrl_sym.weights.lora_config import LoraConfig

# FIELD_NOTES §5: ~100K parameters (d=64, 2 layers, 4 heads) learns digit reversal on a CPU.
TASK_MODEL: dict[str, Any] = dict(vocab_size=VOCAB_SIZE, d_model=64, n_layers=2, n_heads=4,
                                  n_kv_heads=4, head_dim=16, ffn_dim=192)
__all__ = ["FLAGS", "TASK_MODEL", "TASK_RECIPE", "TASK_REWARD", "ResumeMismatchError",
           "RunHealth", "evaluate", "hparam_diffs", "run_hparams", "train", "train_run"]

EVAL_STREAM = 2**31 - 1  # the held-out prompt stream (steps use 1, 2, ...)


def step_seed(seed: int, step: int) -> int:
    """Sampling seed of step ``step`` (1-based): distinct per step, fixed per (seed, step)."""
    return (int(seed) * 1_000_003 + int(step) * 7919) & 0x7FFFFFFF


def step_rng(seed: int, step: int) -> np.random.Generator:
    """Prompt generator of step ``step``: independent of every other step (so resume replays)."""
    return np.random.default_rng([int(seed), int(step)])


def train(
    algo: str = AlgorithmConfig.algo,
    task: str = RunConfig.task,
    steps: int = RunConfig.steps,
    seed: int = RunConfig.seed,
    checkpoint_dir: str | None = None,
    checkpoint_every: int = CheckpointConfig.every,
    metrics_file: str | None = None,
    *,
    prompts_per_step: int = RunConfig.prompts_per_step,
    group_size: int = AlgorithmConfig.group_size,
    lr: float | None = None,
    beta: float = AlgorithmConfig.beta,
    epochs: int = AlgorithmConfig.epochs,
    system: str = RunConfig.system,
    max_digits: int = RunConfig.max_digits,
    partial_weight: float | None = None,
    model: dict[str, Any] | None = None,
    model_dir: str | None = None,
    config: dict[str, Any] | None = None,
    progress: bool = True,
    on_step: Callable[[dict[str, Any]], None] | None = None,
    resume: bool = False,
    resume_or_start: bool = False,
    resume_anyway: bool = False,
    keep: int = CheckpointConfig.keep,
    eval_prompts: int = RunConfig.eval_prompts,
    mesh: str | None = None,
    device_memory: str | int | None = None,
    partial: dict[str, Any] | None = None,
    speculate: int = 0,
    speculate_adaptive: bool = False,
    engine: EngineOptions | None = None,
    precision: str | None = None,
    lora: dict[str, Any] | LoraConfig | None = None,
    text: TextOptions | None = None,
    report: ReportConfig | None = None,
) -> dict[str, Any]:
    """:func:`train_run` from keyword arguments: each one is a field of :class:`RunConfig`,
    :class:`CheckpointConfig` (``checkpoint_dir``, ``checkpoint_every``, ``keep``, ``resume*``)
    or :class:`RLConfig` (``algo``, ``group_size``, ``lr``, ``beta``, ``epochs`` and every knob
    in ``config`` by field name, e.g. ``{"update_tokens": 512}``, over :data:`TASK_RECIPE`);
    ``partial`` holds :class:`PartialConfig` fields (None: off); ``speculate`` /
    ``speculate_adaptive`` the run's speculation (0: off); ``text`` a ``--model`` run's dataset,
    system prompt and rewards; ``report`` the trackers. The summary is :func:`train_run`'s.
    """
    run = RunConfig(task=task, steps=steps, seed=seed, prompts_per_step=prompts_per_step,
                    system=system, max_digits=max_digits, partial_weight=partial_weight,
                    model=model, model_dir=model_dir, eval_prompts=eval_prompts, mesh=mesh,
                    device_memory=device_memory,
                    partial=None if partial is None else PartialConfig(**partial),
                    speculation=speculation_of(speculate, speculate_adaptive), engine=engine,
                    precision=precision,
                    lora=LoraConfig(**lora) if isinstance(lora, dict) else lora)
    checkpoints = CheckpointConfig(checkpoint_dir, checkpoint_every, keep, resume,
                                   resume_or_start, resume_anyway)
    rl = {"algo": algo, "group_size": group_size, "beta": beta, "epochs": epochs,
          **({} if lr is None else {"lr": lr}), **(config or {})}
    return train_run(run, rl, checkpoints, metrics_file=metrics_file, progress=progress,
                     on_step=on_step, text=text, report=report)


def train_run(run: RunConfig, rl: dict[str, Any] | RLConfig,
              checkpoints: CheckpointConfig | None = None, *,
              metrics_file: str | None = None, progress: bool = True,
              on_step: Callable[[dict[str, Any]], None] | None = None,
              text: TextOptions | None = None, report: ReportConfig | None = None
              ) -> dict[str, Any]:
    """Train a fresh model (seeded) on an offline task, or resume one from the checkpoint
    directory.

    run: the task, prompt stream, system and model (:class:`RunConfig`; ``model_dir``
      fine-tunes a Hugging Face checkpoint on a text task, :mod:`jaxrl_sym.rl.run.pretrained`).
    rl: the step's :class:`RLConfig`, or its fields over the task's recipe, response limit and
      EOS (:func:`~jaxrl_sym.rl.config.task_rl_config`).
    checkpoints: save every ``every`` steps and at the end (:class:`CheckpointConfig`); its
      directory's parent must exist and be writable (checked before any work). ``resume``
      continues from the newest *good* checkpoint (corrupt newer ones are skipped with a
      warning and moved aside); without it, a directory that already holds a checkpoint is an
      error. Hyper-parameters that differ from the checkpoint's are refused unless
      ``resume_anyway``. The mesh is not part of a run's identity (a run may resume on another).
    metrics_file: JSON lines, one per step (appended on resume, after dropping lines of steps
      that will be re-run). on_step: called with each step's metrics (after its checkpoint).
    text: a ``--model`` run's dataset, system prompt and rewards
      (:func:`~jaxrl_sym.rl.tasks.rewards.text_options`); a reward's mean is logged as
      ``reward/<name>``, and a failing reward stops the run after saving the last finished step.
    report: trackers that get every step's metrics, the final evaluation and tables of sampled
      completions (:mod:`jaxrl_sym.rl.run.trackers`; a missing package is refused before any work).

    Returns a summary: ``algo``, ``params_sha256``, ``steps``, ``resumed_from``, ``history`` (this
    process's steps), ``seconds``, ``final_exact_match`` and (text tasks) ``final_format_rate``
    (greedy decoding of the final policy on ``eval_prompts`` held-out prompts; a function of the
    parameters alone, so an interrupted and resumed run reports the same value as an
    uninterrupted one), ``skipped_checkpoints`` (steps rejected on resume, with reasons),
    ``changed_on_resume`` (settings that differ from the checkpoint's: optimiser and execution
    knobs, :class:`~jaxrl_sym.rl.knobs.OptimizerConfig` but its rule and
    :class:`~jaxrl_sym.rl.knobs.ExecutionConfig`, and any with ``resume_anyway``;
    :mod:`jaxrl_sym.rl.run.identity`), ``partial_left_rows`` (carried
    rows never trained; not checkpointed) and ``eval_source`` (a text run's: where the
    evaluation's rows came from, e.g. the held-out split of ``--dataset``; None when that needs
    no saying).
    """
    checkpoints = checkpoints or CheckpointConfig()
    report = report or ReportConfig()
    report.check_installed()
    user_limit = (rl.algorithm.max_new_tokens if isinstance(rl, RLConfig)
                  else rl.get("max_new_tokens"))
    hf = setup_pretrained(run.model_dir, run.task, max_new_tokens=user_limit,
                          format_weight=run.reward_weight, text=text)
    task_obj = hf.task if hf else run.task_of()
    if metrics_file:
        check_output_file(metrics_file, "--metrics (metrics_file)")
    ckpt, resuming, lock = open_checkpoints(checkpoints)
    try:
        rl_cfg = rl if isinstance(rl, RLConfig) else task_rl_config(
            run.steps, task_obj.max_new_tokens, EOS,
            {**(hf.rl_config(run.lora is not None) if hf else {}), **rl})
        return _train(run, rl_cfg, task_obj, hf, ckpt, resuming, checkpoints, metrics_file,
                      progress, on_step, report)
    finally:
        if lock is not None:
            lock.release()


def _train(run: RunConfig, rl_cfg: RLConfig, task_obj: Any, hf: Any, ckpt: Checkpointer | None,
           resuming: bool, checkpoints: CheckpointConfig, metrics_file: str | None,
           progress: bool, on_step: Callable[[dict[str, Any]], None] | None,
           report_cfg: ReportConfig) -> dict[str, Any]:
    """:func:`train_run` once its checkpoint directory is open and locked."""
    report = Report(report_cfg, flat_hparams(hparams_of(run, rl_cfg, hf)))
    try:
        return _train_reported(run, rl_cfg, task_obj, hf, ckpt, resuming, checkpoints,
                               metrics_file, progress, on_step, report)
    finally:
        report.close()


def _train_reported(run: RunConfig, rl_cfg: RLConfig, task_obj: Any, hf: Any,
                    ckpt: Checkpointer | None, resuming: bool, checkpoints: CheckpointConfig,
                    metrics_file: str | None, progress: bool,
                    on_step: Callable[[dict[str, Any]], None] | None, report: Report
                    ) -> dict[str, Any]:
    trainer = _trainer(run, rl_cfg, task_obj, hf, report)
    trim_host_heap()  # the loaded model's buffers, freed once the trainer copied them
    meta = {"fingerprint": fingerprint(trainer),
            "hparams": {**hparams_of(run, rl_cfg, hf), "precision": trainer.precision.name,
                        "lora": None if run.lora is None else dataclasses.asdict(run.lora)},
            "lineage": []}
    resumed_from, changed = None, []
    if resuming:
        assert ckpt is not None
        resumed_from, changed, meta["lineage"] = resume_checked(ckpt, trainer, meta,
                                                                checkpoints.resume_anyway)
    if metrics_file:
        prepare_metrics(metrics_file, resumed_from)
    if progress:  # what this run trains with, before its first step (stored in meta as well)
        print(recipe_line(rl_cfg, trainer, run), file=sys.stderr)
        if report.trackers:
            print(f"reporting to {', '.join(report.cfg.report_to)} in {report.dir}",
                  file=sys.stderr)

    def stepped(m: dict[str, Any]) -> None:
        report.step(int(m["step"]), m)
        if on_step is not None:
            on_step(m)

    t_run = time.perf_counter()
    with Bar(progress, run.steps, trainer.steps_done, f"{rl_cfg.algorithm.algo} {run.task}") as bar:
        history = _run_steps(trainer, task_obj, run, ckpt, checkpoints.every, meta,
                             metrics_file, bar, stepped)
    final = (evaluate(trainer, getattr(task_obj, "eval_task", task_obj), run.eval_prompts,
                      run.seed) if run.eval_prompts else None)
    out = _summary(trainer, ckpt, resumed_from, changed, history, time.perf_counter() - t_run,
                   final)
    out["eval_source"] = getattr(task_obj, "eval_note", None) if final else None
    if final is not None:
        report.log(trainer.steps_done, {f"eval/{k}": v for k, v in final.items()})
    return out


def _trainer(run: RunConfig, cfg: RLConfig, task: Any, hf: Any, report: Report) -> RLTrainer:
    """The run's trainer: the task's model (seeded) or the Hugging Face one; its reward is the
    task's, with each scored sample shown to the trackers' completion tables."""
    policy = hf.load_model(run.lora) if hf else init_model(
        preset("tiny", **{**TASK_MODEL, **(run.model or {})}), run.seed)
    return RLTrainer(policy, report.scored(task), cfg, system=run.system,
                     metric_fn=task.exact_match, engine=run.engine, speculation=run.speculation,
                     mesh=None if run.mesh is None else MeshConfig.parse(run.mesh, flag="--mesh"),
                     device_memory=run.device_memory, partial=run.partial,
                     precision=run.precision, lora=run.lora)


def _summary(trainer: RLTrainer, ckpt: Checkpointer | None, resumed_from: int | None,
             changed: list[tuple[str, Any, Any]], history: list[dict[str, Any]],
             seconds: float, final: dict[str, float | None] | None) -> dict[str, Any]:
    return {
        "algo": trainer.cfg.algorithm.algo,
        "params_sha256": trainer.params_sha256(),
        "final_exact_match": None if final is None else final["exact_match"],
        # a text task's share of greedy answers in the asked format ('#### N'); None otherwise
        "final_format_rate": None if final is None else final["format"],
        "steps": trainer.steps_done,
        "resumed_from": resumed_from,
        "skipped_checkpoints": [{"step": s, "reason": r} for s, r in
                                (ckpt.skipped if ckpt is not None else [])],
        "changed_on_resume": [{"flag": f, "checkpoint": a, "given": b} for f, a, b in changed],
        "history": history,
        # the first step the health check flagged (None: never), e.g. an entropy collapse
        "health": next(({"step": m["step"], "message": m["health"]} for m in history
                        if m.get("health")), None),
        "seconds": seconds,
        "mesh": describe(trainer.mesh),
        "precision": trainer.precision.name,
        "state_bytes_per_param": trainer.state_bytes_per_param(),
        "partial_left_rows": len(trainer.rollouts.rows) if trainer.rollouts is not None else 0,
    }


def _run_steps(trainer: RLTrainer, task: Task, run: RunConfig, ckpt: Checkpointer | None,
               every: int, meta: dict[str, Any], metrics_file: str | None, bar: Bar,
               on_step: Callable[[dict[str, Any]], None] | None) -> list[dict[str, Any]]:
    """Steps ``steps_done + 1 .. run.steps``: prompts and seed from ``(seed, k)`` only (resume
    replays), one metrics line each, a checkpoint every ``every`` steps and at the end. SIGTERM
    or SIGINT stops the loop after the step under way (a second one abandons it), saves the
    last finished step and raises :class:`~jaxrl_sym.rl.run.interrupt.Interrupted`."""
    seed, steps = run.seed, run.steps
    history: list[dict[str, Any]] = []
    health = RunHealth(trainer.cfg.algorithm.algo)
    drift, probes = _drift(trainer, task, run)
    with graceful(jax.process_count() == 1) as stop:
        while trainer.steps_done < steps and stop.signum is None:
            k = trainer.steps_done + 1
            prompts = task.sample(step_rng(seed, k), run.prompts_per_step)
            try:
                with stop.step():
                    m = trainer.step(prompts, seed=step_seed(seed, k), on_stage=bar.stage)
            except DivergedError as e:
                bar.alert(f"DIVERGED at step {e.step}: {e}")
                raise
            except RewardError as e:  # the user's reward: named, the finished steps saved
                raise reward_failure(e, k, save_last(trainer, ckpt, meta)) from None
            except BaseException as e:
                if not abandoned(e):
                    raise
                break  # the step committed nothing: the state is step k - 1's
            m.update(task.reward_metrics() if hasattr(task, "reward_metrics") else {})
            m["health"] = health.check(m)
            if drift is not None and (m["health"] is None or health.stalling):
                probed = trainer.greedy(probes, task.max_new_tokens) if drift.due(k) else None
                m["health"] = drift.check(k, m, probed) or m["health"]
            history.append(m)
            _record(m, k, metrics_file, ckpt, bool(every and k % every == 0) or k == steps,
                    trainer, meta)
            bar.advance(m)
            if on_step is not None:
                on_step(m)
        if stop.signum is not None:
            raise Interrupted(stop.signum, trainer.steps_done, save_last(trainer, ckpt, meta))
    return history


def _record(m: dict[str, Any], k: int, metrics_file: str | None, ckpt: Checkpointer | None,
            due: bool, trainer: RLTrainer, meta: dict[str, Any]) -> None:
    """Step ``k``'s metrics line, then its checkpoint when one is ``due``. A metrics line that
    cannot be written (a full disk) stops the run with an error naming ``--metrics``, after
    saving the step where there is a checkpoint directory: the run is resumable, not lost."""
    if metrics_file:
        try:
            with open(metrics_file, "a") as f:
                f.write(jsonl.dumps(m) + "\n")
        except OSError as e:
            raise InputError(f"--metrics {metrics_file}: could not append step {k} "
                             f"({e.strerror or e}); the run stopped after step {k}"
                             f"{saved_note(trainer, ckpt, meta)}") from None
    if ckpt is not None and due:
        ckpt.save(k, trainer, meta)


DRIFT_PROBES = 2  # held-out prompts whose greedy responses a checkpoint run watches


def _drift(trainer: RLTrainer, task: Task, run: RunConfig
           ) -> tuple[GreedyDrift | None, list[np.ndarray]]:
    """The collapse check of a run from a pretrained checkpoint (None for the built-in models,
    which start from random weights), with its probe prompts decoded at the start."""
    if run.model_dir is None:
        return None, []
    probes = task.sample(np.random.default_rng([int(run.seed), EVAL_STREAM, 1]), DRIFT_PROBES)
    return GreedyDrift(trainer.greedy(probes, task.max_new_tokens)), probes


def evaluate(trainer: RLTrainer, task: Task, n: int, seed: int) -> dict[str, float | None]:
    """Exact match of greedy decoding on ``n`` held-out prompts (drawn from a stream no training
    step uses), and for a text task the share answered in the asked format. Greedy, so both
    depend on the parameters only — not on sampling luck."""
    prompts = task.sample(np.random.default_rng([int(seed), EVAL_STREAM]), n)
    responses = trainer.greedy(prompts, task.max_new_tokens)
    pairs = list(zip(prompts, responses, strict=True))
    fmt = getattr(task, "format_match", None)
    return {"exact_match": float(np.mean([task.exact_match(p, r) for p, r in pairs])),
            "format": None if fmt is None else float(np.mean([fmt(p, r) for p, r in pairs]))}
