"""What defines a training run, and what ``--resume`` compares.

A checkpoint records the run's hyper-parameters (:func:`hparams_of`): the task, data, model and
seed, the system, and the step's knobs by part (``algorithm``, ``optim``, ``execution``:
:mod:`jaxrl_sym.rl.knobs`). A resume compares them with the new run's before any array is read
(:func:`resume_checked`):

* the run's own keys and the ``algorithm`` and ``optim`` parts define the run: a difference is
  refused (:class:`ResumeMismatchError`) unless ``--resume-anyway`` accepts it, and then logged
  and kept in the checkpoint's lineage;
* the ``execution`` part decides how a step is computed, not what: a difference is accepted,
  logged as a warning and kept in the lineage (a run that ran out of memory resumes with a
  smaller ``--update-tokens``).

A checkpoint written before the step's knobs were split into parts recorded them flat;
:func:`~jaxrl_sym.rl.config.nest_hparams` reads it into the parts, so it compares knob by knob.
Every difference is named by the flag that sets it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import fields
from typing import TYPE_CHECKING, Any

from jaxrl_sym.rl.config import FIELD_GROUP, GROUPS, RLConfig, RunConfig, nest_hparams
from jaxrl_sym.rl.errors import CheckpointError
from jaxrl_sym.rl.knobs import flag_label, flag_of

if TYPE_CHECKING:
    from jaxrl_sym.rl.run.checkpoint import Checkpointer
    from jaxrl_sym.rl.step.trainer import RLTrainer

__all__ = ["FLAGS", "ResumeMismatchError", "defines_run", "flat_hparams", "hparam_diffs",
           "hparams_of", "resume_checked", "run_hparams"]

log = logging.getLogger(__name__)

# The run's recorded keys that are not a field with one flag (a step's knob or a RunConfig field
# such as ``task`` or ``prompts_per_step``: those are named by the flag their field declares), and
# the ``jaxrl-sym train`` flag that sets each: a refused resume names the flag the user typed.
# ``speculate`` and ``speculate_adaptive`` are the run's Speculation (RLConfig fields before;
# same keys, so a checkpoint written then compares as before).
FLAGS: dict[str, str] = {
    "partial": "--partial-rollout", "speculate": "--speculate",
    "speculate_adaptive": "--speculate-adaptive",
    "lora": "--lora-rank/--lora-alpha/--lora-targets",
    # a --model run's own data and rewards (jaxrl_sym.rl.tasks.data.TextOptions.hparams)
    "dataset": "--dataset", "prompt_field": "--prompt-field", "answer_field": "--answer-field",
    "system_prompt": "--system-prompt", "eval_dataset": "--eval-dataset",
    "dataset_sha256": "--dataset (the file's contents)",
    "eval_dataset_sha256": "--eval-dataset (the file's contents)", "reward": "--reward",
    "reward_weights": "--reward-weights", "reward_sha256": "--reward (its module's source)",
    "base_sha256": "--model (its weights)", "task_sha256": "--task jsonl:FILE (its contents)",
}


_RUN_FIELDS = {f.name for f in fields(RunConfig)}


class ResumeMismatchError(CheckpointError):
    """``--resume`` with hyper-parameters other than the checkpoint's: the continued run would not
    be the run that was checkpointed. ``diffs`` holds ``(flag, checkpoint value, given value)``."""

    def __init__(self, directory: str, step: int, diffs: list[tuple[str, Any, Any]]) -> None:
        super().__init__(
            f"--checkpoint-dir {directory} (step {step}) was written with other settings than "
            f"these: {describe(diffs)}. Resuming with them would not continue the same run "
            "(its params_sha256 would differ from an uninterrupted one). Pass the checkpoint's "
            "values to continue it, or add --resume-anyway (resume_anyway=True) to continue "
            "from its weights as a changed run.")
        self.diffs = diffs


def describe(diffs: list[tuple[str, Any, Any]]) -> str:
    return "; ".join(f"{flag}: checkpoint {a!r}, given {b!r}" for flag, a, b in diffs)


def run_hparams(cfg: RLConfig, **run: Any) -> dict[str, Any]:
    """Everything besides the model shape that sets the trajectory, and the execution knobs:
    the task and prompt stream (``task``, ``max_digits``, ``seed``, ``prompts_per_step``), the
    system (sym and padded agree only to float rounding), speculation, and the step's knobs by
    part (``cfg.to_dict()``). JSON-normalised, so it compares equal to what a checkpoint stored.

    The engine's options are not recorded, as the mesh is not: they decide how rows are grouped
    and stored while generating, not which tokens are sampled (sampling is keyed by seed, step
    and row). A checkpoint written when ``gen_max_pad_fraction`` was an RLConfig field has that
    key alone, so it is not compared (:func:`hparam_diffs`)."""
    return json.loads(json.dumps({**run, **cfg.to_dict()}))


def hparams_of(run: RunConfig, cfg: RLConfig, hf: Any) -> dict[str, Any]:
    """The run's hyper-parameters as a checkpoint records them (:func:`run_hparams`), with the
    source model of a ``--model`` run (a resume compares it, export reads it)."""
    spec = run.speculation
    hparams = run_hparams(cfg, task=run.task, max_digits=run.max_digits, seed=run.seed,
                          system=run.system, prompts_per_step=run.prompts_per_step,
                          partial_weight=run.reward_weight,
                          partial=None if run.partial is None else run.partial.to_dict(),
                          speculate=0 if spec is None else spec.k,
                          speculate_adaptive=spec is not None and spec.adaptive)
    return {**hparams, **(hf.hparams if hf is not None else {})}


def flat_hparams(hparams: dict[str, Any]) -> dict[str, Any]:
    """Recorded hyper-parameters in one flat dict: the run's keys and every knob by its field
    name (a knob has one name across the parts), from a new or an old (flat) record alike."""
    nested = nest_hparams(hparams)
    return {**{k: v for k, v in nested.items() if k not in GROUPS},
            **{k: v for g in GROUPS for k, v in nested[g].items()}}


def defines_run(key: str) -> bool:
    """Whether a recorded key is part of the run's identity: all but the execution knobs."""
    return FIELD_GROUP.get(key) != "execution"


def _label(key: str) -> str:
    """How a difference is named: the flag that sets the key (declared by its field, else
    :data:`FLAGS`), else ``config['key']``."""
    if key in FLAGS:
        return f"{FLAGS[key]} ({key})"
    flag = (flag_of(RunConfig, key) if key in _RUN_FIELDS else
            flag_label(GROUPS[FIELD_GROUP[key]], key) if key in FIELD_GROUP else None)
    return f"{flag} ({key})" if flag else f"config[{key!r}]"


def hparam_diffs(saved: dict[str, Any], given: dict[str, Any], *, run_only: bool | None = None
                 ) -> list[tuple[str, Any, Any]]:
    """``(flag, checkpoint value, given value)`` for each setting both know and that differs
    (a record flat or by part: :func:`flat_hparams`); ``run_only`` True: only those that
    define the run (:func:`defines_run`), False: only the execution knobs.

    A key only one side knows (a field added or removed by a library upgrade) is not a
    difference of the user's making, so it is not reported.
    """
    a, b = flat_hparams(saved), flat_hparams(given)
    return [(_label(k), a[k], b[k]) for k in sorted(set(a) & set(b))
            if a[k] != b[k] and (run_only is None or defines_run(k) == run_only)]


def resume_checked(ckpt: Checkpointer, trainer: RLTrainer, meta: dict[str, Any], anyway: bool
                   ) -> tuple[int, list[tuple[str, Any, Any]], list[dict[str, Any]]]:
    """Restore the newest good checkpoint after comparing its hyper-parameters with this run's
    (before any array is read). Returns the step, the differences taken (execution knobs, and
    with ``anyway`` the run's own) and the lineage that later checkpoints carry (each change,
    with its step)."""
    found: dict[str, Any] = {}

    def check(saved: dict[str, Any]) -> None:
        old, new = saved.get("hparams", {}), meta["hparams"]
        diffs = hparam_diffs(old, new, run_only=True)
        if diffs and not anyway:
            raise ResumeMismatchError(ckpt.directory, int(saved["step"]), diffs)
        found["diffs"], found["lineage"] = diffs, list(saved.get("lineage", []))
        found["how"] = hparam_diffs(old, new, run_only=False)

    saved = ckpt.restore(trainer, meta["fingerprint"], check_meta=check)
    step, diffs, lineage = int(saved["step"]), found["diffs"], found["lineage"]
    if found["how"]:
        log.warning("resuming %s at step %d with changed execution settings: %s (how a step is "
                    "computed, not what: the same run up to float rounding)", ckpt.directory,
                    step, describe(found["how"]))
        lineage.append({"step": step, "execution": [list(d) for d in found["how"]]})
    if diffs:
        log.warning("resuming %s at step %d with changed settings (--resume-anyway): %s; this "
                    "is no longer the run that was checkpointed", ckpt.directory, step,
                    describe(diffs))
        lineage.append({"step": step, "changed": [list(d) for d in diffs]})
    return step, diffs + found["how"], lineage
