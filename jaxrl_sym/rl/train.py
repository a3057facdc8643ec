"""The training loop: task prompts → RL steps → JSON-lines metrics, checkpoints, resume.

Reproducibility is by construction: the prompts and the sampling seed of step k are functions of
``(seed, k)`` only, and everything else that evolves (parameters, optimiser state) is in the
checkpoint. So a run interrupted after the checkpoint of step k and resumed replays steps k+1.. on
exactly the state the uninterrupted run had, and ends with the same ``params_sha256``.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from jaxrl_sym.errors import InputError
from jaxrl_sym.models.lm import init_model, preset
from jaxrl_sym.rl.algorithms import RLConfig
from jaxrl_sym.rl.checkpoint import Checkpointer, fingerprint
from jaxrl_sym.rl.errors import CheckpointError
from jaxrl_sym.rl.partial import PartialConfig
from jaxrl_sym.rl.pretrained import setup as setup_pretrained
from jaxrl_sym.rl.stages import DivergedError
from jaxrl_sym.rl.step import RLTrainer
from jaxrl_sym.rl.tasks import EOS, VOCAB_SIZE, Task, get_task
from jaxrl_sym.sharding import MeshConfig, describe

# FIELD_NOTES §5: ~100K parameters (d=64, 2 layers, 4 heads) learns digit reversal on a CPU.
TASK_MODEL: dict[str, Any] = dict(vocab_size=VOCAB_SIZE, d_model=64, n_layers=2, n_heads=4,
                                  n_kv_heads=4, head_dim=16, ffn_dim=192)
# The recipe that learns here (issue 12; bench/learning.py measures it over seeds and
# algorithms). FIELD_NOTES' Adam 3e-3 with plain GRPO collapsed this model (tied embeddings,
# RMSNorm) within ~10 steps; lr 1e-3, a 0.01 entropy bonus and per-sequence averaging learned on
# some seeds only: on seed 11 the entropy fell 2.2 -> 0.19 nats/token in 50 steps, 63% -> 97%
# of groups became zero-variance, and the policy settled on partial credit (reward 0.46, greedy
# exact match 0.047). Group-std advantages scale a group's near-equal partial-credit rewards up to
# unit size, so the policy sharpens on noise at full speed whatever the entropy bonus (0.05 still
# collapsed; lower lr or a warm-up only delayed it). Advantages at reward scale (Dr. GRPO) let the
# policy gradient shrink as a group's rewards converge, leaving the entropy bonus to keep sampling
# alive; halving partial credit makes the exact answer dominate the advantage.
TASK_RECIPE: dict[str, Any] = dict(entropy_coef=0.01, loss_agg="seq_mean", adv_norm="none")
TASK_REWARD: dict[str, Any] = dict(partial_weight=0.5)


EVAL_STREAM = 2**31 - 1  # the held-out prompt stream (steps use 1, 2, ...)


def step_seed(seed: int, step: int) -> int:
    """Sampling seed of step ``step`` (1-based): distinct per step, fixed per (seed, step)."""
    return (int(seed) * 1_000_003 + int(step) * 7919) & 0x7FFFFFFF


def step_rng(seed: int, step: int) -> np.random.Generator:
    """Prompt generator of step ``step``: independent of every other step (so resume replays)."""
    return np.random.default_rng([int(seed), int(step)])


log = logging.getLogger(__name__)

DEFAULT_KEEP = 3  # newest checkpoints kept: room to fall back past two damaged ones

# train() arguments that change the trajectory, and the ``jaxrl-sym train`` flag that sets each:
# a refused resume names the flag the user typed. Every other RLConfig field is compared too and
# named as ``config['field']`` (it is set through ``train(config=...)``).
FLAGS: dict[str, str] = {
    "algo": "--algo", "task": "--task", "seed": "--seed", "max_digits": "--max-digits",
    "system": "--system", "prompts_per_step": "--prompts", "group_size": "--group",
    "lr": "--lr", "beta": "--beta", "epochs": "--epochs", "loss_agg": "--loss-agg",
    "entropy_coef": "--entropy-coef", "partial_weight": "--partial-weight",
    "clip_eps": "--clip-low", "clip_eps_high": "--clip-high", "adv_norm": "--adv-norm",
    "drop_zero_var": "--drop-zero-var", "warmup_steps": "--warmup-steps",
    "lr_schedule": "--lr-schedule", "partial": "--partial-rollout",
    "speculate": "--speculate", "speculate_adaptive": "--speculate-adaptive",
}


class ResumeMismatchError(CheckpointError):
    """``--resume`` with hyper-parameters other than the checkpoint's: the continued run would not
    be the run that was checkpointed. ``diffs`` holds ``(flag, checkpoint value, given value)``."""

    def __init__(self, directory: str, step: int, diffs: list[tuple[str, Any, Any]]) -> None:
        super().__init__(
            f"--checkpoint-dir {directory} (step {step}) was written with other settings than "
            f"these: {_describe(diffs)}. Resuming with them would not continue the same run "
            "(its params_sha256 would differ from an uninterrupted one). Pass the checkpoint's "
            "values to continue it, or add --resume-anyway (resume_anyway=True) to continue "
            "from its weights as a changed run.")
        self.diffs = diffs


def _describe(diffs: list[tuple[str, Any, Any]]) -> str:
    return "; ".join(f"{flag}: checkpoint {a!r}, given {b!r}" for flag, a, b in diffs)


def run_hparams(cfg: RLConfig, **run: Any) -> dict[str, Any]:
    """Everything besides the model shape that sets the trajectory: the task and prompt stream
    (``task``, ``max_digits``, ``seed``, ``prompts_per_step``), the system (sym and padded agree
    only to float rounding) and every RLConfig field. JSON-normalised, so it compares equal to
    what a checkpoint stored."""
    return json.loads(json.dumps({**run, **cfg.to_dict()}))


def hparam_diffs(saved: dict[str, Any], given: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(flag, checkpoint value, given value)`` for each setting both know and that differs.

    A key only one side knows (a field added or removed by a library upgrade) is not a
    difference of the user's making, so it is not reported.
    """
    out = []
    for key in sorted(set(saved) & set(given)):
        if saved[key] != given[key]:
            label = f"{FLAGS[key]} ({key})" if key in FLAGS else f"config[{key!r}]"
            out.append((label, saved[key], given[key]))
    return out


def _check_counts(steps: int, every: int, keep: int, resuming: bool, anyway: bool) -> None:
    if steps < 1:
        raise InputError(f"steps={steps} (--steps) must be >= 1")
    if every < 0:
        raise InputError(f"checkpoint_every={every} (--checkpoint-every) must be >= 0")
    if keep < 1:
        raise InputError(f"keep={keep} (--keep): at least the newest checkpoint must be kept; "
                         "pass 1 or more")
    if anyway and not resuming:
        raise InputError("--resume-anyway (resume_anyway=True) only applies when resuming; add "
                         "--resume or --resume-or-start")


def _probe_writable(directory: str, what: str) -> None:
    """Create and delete a file: permission bits alone say nothing for root or read-only mounts."""
    try:
        fd, name = tempfile.mkstemp(dir=directory, prefix=".jaxrl-sym-write-check-")
        os.close(fd)
        os.remove(name)
    except OSError as e:
        raise InputError(f"{what}: cannot write in {directory} ({e.strerror or e}); choose a "
                         "writable location") from e


def check_output_dir(path: str, what: str) -> bool:
    """Raise :class:`InputError` (naming ``what``, the flag) unless ``path`` is a writable
    directory or can be created in an existing, writable parent. Returns whether it exists."""
    path = os.path.abspath(path)
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise InputError(f"{what} {path} exists and is not a directory; give a directory")
        _probe_writable(path, f"{what} {path}")
        return True
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        raise InputError(f"{what} {path}: its parent directory {parent} does not exist; create "
                         "it first or fix the path")
    _probe_writable(parent, f"{what} {path}")
    return False


def check_output_file(path: str, what: str) -> None:
    """Raise :class:`InputError` (naming ``what``) unless ``path`` can be written: its parent
    exists and is writable (files are replaced via a temporary next to them) and an existing
    ``path`` is a file that opens for appending."""
    path = os.path.abspath(path)
    if os.path.isdir(path):
        raise InputError(f"{what} {path} is a directory; give a file name")
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        raise InputError(f"{what} {path}: its parent directory {parent} does not exist; create "
                         "it first or fix the path")
    _probe_writable(parent, f"{what} {path}")
    if os.path.exists(path):
        try:
            with open(path, "a"):
                pass
        except OSError as e:
            raise InputError(f"{what} {path} cannot be written ({e.strerror or e})") from e


def open_checkpoints(directory: str | None, resume: bool, resume_or_start: bool, keep: int
                     ) -> tuple[Checkpointer | None, bool]:
    """Open ``directory`` for this run — before the (slow) model set-up, so a wrong path costs
    nothing. Returns the checkpointer and whether to resume from it."""
    wants = resume or resume_or_start
    if directory is None:
        if wants:
            raise InputError("--resume / --resume-or-start need --checkpoint-dir (the directory "
                             "holding the run's checkpoints)")
        return None, False
    flag = "--checkpoint-dir (checkpoint_dir)"
    exists = check_output_dir(directory, flag)
    full = os.path.abspath(directory)
    if not exists and resume and not resume_or_start:
        raise InputError(f"--resume: {flag} {full} does not exist, so there is nothing to "
                         "resume. Check the path, or pass --resume-or-start to start a new run "
                         "there when it holds no checkpoint.")
    ckpt = Checkpointer(directory, max_to_keep=keep, create=True)
    latest = ckpt.latest_step()
    if latest is None:
        if resume and not resume_or_start:
            raise InputError(f"--resume: {flag} {full} holds no checkpoint, so there is nothing "
                             "to resume. Check the path, or pass --resume-or-start to start a "
                             "new run there.")
        if resume_or_start:
            log.warning("no checkpoint in %s: starting a new run there", full)
        return ckpt, False
    if not wants:
        raise InputError(
            f"checkpoint_dir {full} already holds a checkpoint of step {latest}; pass "
            "resume=True (--resume) to continue that run, or choose an empty directory for a "
            "new one")
    return ckpt, True


def _prepare_metrics(path: str, resumed_from: int | None) -> None:
    """A fresh run starts a fresh log; a resumed one keeps the lines up to its checkpoint."""
    if resumed_from is not None:
        _truncate_metrics(path, resumed_from)
    elif os.path.exists(path):
        os.remove(path)


def _truncate_metrics(path: str, last_step: int) -> None:
    """Drop lines of steps after the checkpoint being resumed (they will be run again)."""
    if not os.path.exists(path):
        return
    keep = []
    with open(path) as f:
        for line in f:
            try:
                if json.loads(line).get("step", 0) <= last_step:
                    keep.append(line if line.endswith("\n") else line + "\n")
            except json.JSONDecodeError:
                break  # a line cut by the interruption: it and anything after are dropped
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(keep)
    os.replace(tmp, path)


def train(
    algo: str = "grpo",
    task: str = "reverse",
    steps: int = 400,
    seed: int = 0,
    checkpoint_dir: str | None = None,
    checkpoint_every: int = 0,
    metrics_file: str | None = None,
    *,
    prompts_per_step: int = 32,
    group_size: int = 8,
    lr: float = 1e-3,
    beta: float = 0.0,
    epochs: int = 1,
    system: str = "sym",
    max_digits: int = 3,
    partial_weight: float | None = None,
    model: dict[str, Any] | None = None,
    model_dir: str | None = None,
    config: dict[str, Any] | None = None,
    progress: bool = True,
    on_step: Callable[[dict[str, Any]], None] | None = None,
    resume: bool = False,
    resume_or_start: bool = False,
    resume_anyway: bool = False,
    keep: int = DEFAULT_KEEP,
    eval_prompts: int = 256,
    mesh: str | None = None,
    device_memory: str | int | None = None,
    partial: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Train a fresh model (seeded) on an offline task, or resume one from ``checkpoint_dir``.

    Args:
      algo: ``grpo`` | ``rloo`` | ``ppo``.   task: ``reverse`` | ``copy`` | ``sort`` | ``add``.
      steps: total steps of the run (a resumed run continues up to this count).
      checkpoint_dir / checkpoint_every: save every this many steps and at the end (0: only at
        the end, when a directory is given). Its parent must exist and it must be writable
        (checked before any work).
      keep: how many of the newest checkpoints to keep (older ones are deleted).
      metrics_file: JSON lines, one per step (appended on resume, after dropping lines of steps
        that will be re-run).
      partial_weight: the task reward's weight on partial credit (None: :data:`TASK_REWARD`'s).
      model: overrides of :data:`TASK_MODEL` (LMConfig fields).
      model_dir: fine-tune this Hugging Face checkpoint directory instead, on a text task
        (``word-problems`` or ``jsonl:PATH``; see :mod:`jaxrl_sym.rl.pretrained`).
      config: RLConfig fields overriding :data:`TASK_RECIPE` and the arguments above.
      on_step: called with each step's metrics (after its checkpoint, if any).
      resume: continue from the newest *good* checkpoint in ``checkpoint_dir`` (corrupt newer
        ones are skipped with a warning and moved aside). A missing directory or one without a
        checkpoint is an error; without ``resume``, a directory that already holds a checkpoint
        is an error (a new run must not silently continue an old one, nor overwrite it).
      resume_or_start: resume when ``checkpoint_dir`` holds a checkpoint, else start a new run
        there (logged).
      resume_anyway: accept hyper-parameters that differ from the checkpoint's (by default a
        difference is refused: the run would no longer be the one that was checkpointed).
      eval_prompts: held-out prompts for the final greedy evaluation (0: skip).
      mesh: ``"data=4,model=2"``: train on a device mesh (:mod:`jaxrl_sym.sharding`); not part
        of the checkpoint's identity, so a run may resume on another mesh.
      device_memory: bytes one device may hold (``"16GB"``): see :class:`RLTrainer`.
      partial: partial rollouts, :class:`~jaxrl_sym.rl.partial.PartialConfig` fields
        (``{"fraction": 0.75, "segment": 4, "max_carry": 1}``; None: off). Rows still carried
        when the run ends are not trained (``partial_left_rows`` counts them); the buffer is not
        checkpointed, so a resumed run starts without carried rows.
    Returns a summary: ``params_sha256``, ``steps``, ``resumed_from``, ``history`` (this
    process's steps), ``seconds``, ``final_exact_match`` (greedy decoding of the final policy on
    ``eval_prompts`` held-out prompts; a function of the parameters alone, so an interrupted and
    resumed run reports the same value as an uninterrupted one), ``skipped_checkpoints`` (steps
    rejected on resume, with reasons) and ``changed_on_resume`` (hyper-parameters overridden by
    ``resume_anyway``).
    """
    if partial_weight is None:
        partial_weight = TASK_REWARD["partial_weight"]
    # --model DIR: a text task on a Hugging Face checkpoint (None: the built-in model)
    hf = setup_pretrained(model_dir, task, max_new_tokens=(config or {}).get("max_new_tokens"))
    # unknown task → InputError, before any work
    task_obj = hf.task if hf else get_task(task, max_digits=max_digits,
                                           partial_weight=partial_weight)
    _check_counts(steps, checkpoint_every, keep, resume or resume_or_start, resume_anyway)
    if metrics_file:
        check_output_file(metrics_file, "--metrics (metrics_file)")
    ckpt, resuming = open_checkpoints(checkpoint_dir, resume, resume_or_start, keep)
    if hf is not None:
        config = {**hf.rl_config, **(config or {})}
    fields = {"algo": algo, "group_size": group_size, "lr": lr, "beta": beta, "epochs": epochs,
              "max_new_tokens": task_obj.max_new_tokens, "eos_id": EOS, **TASK_RECIPE,
              **(config or {})}
    if fields.get("lr_schedule", "constant") != "constant" and fields.get("total_steps") is None:
        fields["total_steps"] = steps  # a decaying schedule ends with the run
    rl_cfg = RLConfig(**fields)
    partial_cfg = None if partial is None else PartialConfig(**partial)
    lm_cfg = preset("tiny", **{**TASK_MODEL, **(model or {})})
    policy = hf.load_model() if hf else init_model(lm_cfg, seed)
    trainer = RLTrainer(policy, task_obj.reward, rl_cfg, system=system,
                        metric_fn=task_obj.exact_match,
                        mesh=None if mesh is None else MeshConfig.parse(mesh, flag="--mesh"),
                        device_memory=device_memory, partial=partial_cfg)
    hparams = run_hparams(rl_cfg, task=task, max_digits=max_digits, seed=seed, system=system,
                          prompts_per_step=prompts_per_step, partial_weight=partial_weight,
                          partial=None if partial_cfg is None else partial_cfg.to_dict())
    if hf is not None:  # the source model: a resume compares it, export reads it
        hparams.update(hf.hparams)
    meta = {"fingerprint": fingerprint(trainer), "hparams": hparams, "lineage": []}
    resumed_from, changed = None, []
    if resuming:
        assert ckpt is not None
        resumed_from, changed, meta["lineage"] = _resume(ckpt, trainer, meta, resume_anyway)
    if metrics_file:
        _prepare_metrics(metrics_file, resumed_from)
    t_run = time.perf_counter()
    with _progress(progress, steps, trainer.steps_done, f"{algo} {task}") as bar:
        history = _run_steps(trainer, task_obj, seed, steps, prompts_per_step, ckpt,
                             checkpoint_every, meta, metrics_file, bar, on_step)
    final = evaluate(trainer, task_obj, eval_prompts, seed) if eval_prompts else None
    return {
        "params_sha256": trainer.params_sha256(),
        "final_exact_match": final,
        "steps": trainer.steps_done,
        "resumed_from": resumed_from,
        "skipped_checkpoints": [{"step": s, "reason": r} for s, r in
                                (ckpt.skipped if ckpt is not None else [])],
        "changed_on_resume": [{"flag": f, "checkpoint": a, "given": b} for f, a, b in changed],
        "history": history,
        # the first step the health check flagged (None: never), e.g. an entropy collapse
        "health": next(({"step": m["step"], "message": m["health"]} for m in history
                        if m.get("health")), None),
        "seconds": time.perf_counter() - t_run,
        "mesh": describe(trainer.mesh),
        "partial_left_rows": len(trainer.rollouts.rows) if trainer.rollouts is not None else 0,
    }


def _run_steps(trainer: RLTrainer, task: Task, seed: int, steps: int, prompts_per_step: int,
               ckpt: Checkpointer | None, every: int, meta: dict[str, Any],
               metrics_file: str | None, bar: _Bar,
               on_step: Callable[[dict[str, Any]], None] | None) -> list[dict[str, Any]]:
    """Steps ``steps_done + 1 .. steps``: prompts and seed from ``(seed, k)`` only (resume
    replays), one metrics line each, a checkpoint every ``every`` steps and at the end."""
    history: list[dict[str, Any]] = []
    health = RunHealth()
    while trainer.steps_done < steps:
        k = trainer.steps_done + 1
        prompts = task.sample(step_rng(seed, k), prompts_per_step)
        try:
            m = trainer.step(prompts, seed=step_seed(seed, k))
        except DivergedError as e:
            bar.alert(f"DIVERGED at step {e.step}: {e}")
            raise
        m["health"] = health.check(m)
        history.append(m)
        if metrics_file:
            with open(metrics_file, "a") as f:
                f.write(json.dumps(m) + "\n")
        if ckpt is not None and ((every and k % every == 0) or k == steps):
            ckpt.save(k, trainer, meta)
        bar.advance(m)
        if on_step is not None:
            on_step(m)
    return history


def _resume(ckpt: Checkpointer, trainer: RLTrainer, meta: dict[str, Any], anyway: bool
            ) -> tuple[int, list[tuple[str, Any, Any]], list[dict[str, Any]]]:
    """Restore the newest good checkpoint after comparing its hyper-parameters with this run's
    (before any array is read). Returns the step, the overridden differences and the lineage
    that later checkpoints carry (every ``resume_anyway`` change, with its step)."""
    found: dict[str, Any] = {}

    def check(saved: dict[str, Any]) -> None:
        diffs = hparam_diffs(saved.get("hparams", {}), meta["hparams"])
        if diffs and not anyway:
            raise ResumeMismatchError(ckpt.directory, int(saved["step"]), diffs)
        found["diffs"], found["lineage"] = diffs, list(saved.get("lineage", []))

    saved = ckpt.restore(trainer, meta["fingerprint"], check_meta=check)
    step, diffs, lineage = int(saved["step"]), found["diffs"], found["lineage"]
    if diffs:
        log.warning("resuming %s at step %d with changed settings (--resume-anyway): %s; this "
                    "is no longer the run that was checkpointed", ckpt.directory, step,
                    _describe(diffs))
        lineage.append({"step": step, "changed": [list(d) for d in diffs]})
    return step, diffs, lineage


def evaluate(trainer: RLTrainer, task: Task, n: int, seed: int) -> float:
    """Exact match of greedy decoding on ``n`` held-out prompts (drawn from a stream no training
    step uses). Greedy, so it depends on the parameters only — not on sampling luck."""
    prompts = task.sample(np.random.default_rng([int(seed), EVAL_STREAM]), n)
    responses = trainer.greedy(prompts, task.max_new_tokens)
    return float(np.mean([task.exact_match(p, r) for p, r in zip(prompts, responses,
                                                                   strict=True)]))


class RunHealth:
    """Flags a run that has stopped learning, from its per-step metrics (``health`` per line).

    ``non-finite``: a reported metric is NaN/inf. ``entropy collapse``: the policy's entropy
    fell below :attr:`entropy_floor` nats/token while the reward moved less than
    :attr:`flat_tol` between the two halves of the last :attr:`window` steps — every group
    then samples (nearly) the same answer, its advantages are 0, and nothing changes any more.
    A run that converged to the right answers also ends with low entropy and a flat reward;
    the flag says the run has stopped moving, the reward says at what level.
    """

    entropy_floor = 0.05
    window = 50
    flat_tol = 0.01

    def __init__(self) -> None:
        self.rewards: list[float] = []

    def check(self, m: dict[str, Any]) -> str | None:
        bad = [k for k in ("reward", "loss", "entropy", "grad_norm")
               if m.get(k) is not None and not np.isfinite(m[k])]
        if bad:
            return f"diverged: non-finite {', '.join(bad)}"
        self.rewards.append(float(m["reward"]))
        if len(self.rewards) < self.window or m.get("entropy") is None:
            return None
        last = self.rewards[-self.window:]
        half = self.window // 2
        a, b = float(np.mean(last[:half])), float(np.mean(last[half:]))
        if m["entropy"] < self.entropy_floor and abs(b - a) < self.flat_tol:
            return (f"entropy collapse: entropy {m['entropy']:.3f} < {self.entropy_floor}, "
                    f"reward flat ({a:.3f} -> {b:.3f} over {self.window} steps)")
        return None


class _Bar:
    """Rich progress bar with the latest reward / exact match; a no-op when disabled."""

    def __init__(self, enabled: bool, total: int, done: int, title: str) -> None:
        self.enabled = enabled
        self.total, self.done, self.title = total, done, title
        self.progress: Any = None
        self.seconds: list[float] = []  # per step of this run (a resumed run starts afresh)

    def __enter__(self) -> _Bar:
        if self.enabled:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
            )

            # stderr: stdout stays machine-readable (``--json`` prints one object there)
            self.progress = Progress(TextColumn("{task.description}"), BarColumn(),
                                     MofNCompleteColumn(), TimeElapsedColumn(),
                                     TextColumn("{task.fields[info]}"),
                                     console=Console(stderr=True))
            self.progress.__enter__()
            self.task = self.progress.add_task(self.title, total=self.total,
                                               completed=self.done, info="")
        return self

    def advance(self, m: dict[str, Any]) -> None:
        if self.progress is not None:
            info = f"reward {m['reward']:.3f}"
            if "exact_match" in m:
                info += f"  exact {m['exact_match']:.3f}"
            # the mean over this run's steps (the last step alone jumps with compiles and with
            # response lengths), plus the remaining time it implies
            self.seconds.append(m["seconds"]["total"])
            mean = sum(self.seconds) / len(self.seconds)
            left = (self.total - self.done - len(self.seconds)) * mean
            info += f"  {mean:.2f}s/step (mean of {len(self.seconds)}), ~{left:.0f}s left"
            if m.get("entropy") is not None:
                info += f"  entropy {m['entropy']:.3f}"
            if m.get("health"):
                info += f"  [red]{m['health'].upper()}[/red]"
            self.progress.update(self.task, advance=1, info=info)

    def alert(self, text: str) -> None:
        """Show ``text`` in the progress line (the run is about to stop)."""
        if self.progress is not None:
            self.progress.update(self.task, info=f"[red]{text}[/red]")

    def __exit__(self, *exc: object) -> None:
        if self.progress is not None:
            self.progress.__exit__(*exc)


def _progress(enabled: bool, total: int, done: int, title: str) -> _Bar:
    return _Bar(enabled, total, done, title)
