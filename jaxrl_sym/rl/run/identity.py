"""What defines a training run, and what ``--resume`` compares.

A checkpoint records the run's hyper-parameters (:func:`hparams_of`): the task, data, model and
seed, the system, and the step's knobs by part (``algorithm``, ``optim``, ``execution``:
:mod:`jaxrl_sym.rl.knobs`). A resume compares them with the new run's before any array is read
(:func:`resume_checked`), and each recorded key falls under one rule (:func:`resume_rule`):

* ``run``: the run's own keys and the ``algorithm`` part define the run (another task, data,
  model, seed or objective is another experiment): a difference is refused
  (:class:`ResumeMismatchError`) unless ``--resume-anyway`` accepts it, and then logged and kept
  in the checkpoint's lineage;
* ``optim``: the optimiser's hyper-parameters (learning rate, its schedule, weight decay, the
  gradient clip) are how the gradient becomes an update, tuned as a run goes: a difference is
  accepted, logged as a warning and kept in the lineage. It takes effect: the rate's schedule and
  the clip are built from the new config when the trainer is (only the schedule's step count is
  restored), and a restore puts the new weight decay into the restored state
  (:func:`~jaxrl_sym.rl.step.state.with_config_hyperparams`);
* ``state``: the optimiser's rule (``--optimizer``) decides the structure of the optimiser state
  a checkpoint holds (Adam's two moments, Lion's one, SGD's none), and a resume restores that
  state into the new rule's: a difference is refused even with ``--resume-anyway``
  (:class:`OptimizerStateMismatchError`), since no flag restarts the optimiser state;
* ``execution``: how a step is computed, not what: a difference is accepted, logged as a
  warning and kept in the lineage (a run that ran out of memory resumes with a smaller
  ``--update-tokens``).

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

__all__ = ["FLAGS", "RULES", "STATE_KEYS", "OptimizerStateMismatchError", "ResumeMismatchError",
           "defines_run", "flat_hparams", "hparam_diffs", "hparams_of", "resume_checked",
           "resume_rule", "run_hparams"]

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


STATE_KEYS: tuple[str, ...] = ("optimizer",)
"""Optimiser knobs whose change makes the checkpoint's optimiser state unusable: the rule
decides the state's structure (Adam's two moments, Lion's one, SGD's none), which the other
knobs (rate, schedule, decay, clip) do not."""

RULES: dict[str, str] = {
    "run": "defines the run: refused unless --resume-anyway",
    "state": "shapes the saved optimiser state: refused",
    "optim": "the optimiser's hyper-parameters: taken from the resume on, with a warning",
    "execution": "how a step is computed, not what: taken, with a warning",
}
"""What a resume does with a changed key of each rule (:func:`resume_rule`)."""

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


class OptimizerStateMismatchError(ResumeMismatchError):
    """``--resume`` with another optimiser rule than the checkpoint's: its saved optimiser state
    has another structure than this rule's, and a resume restores it, so no flag continues the
    run (``--resume-anyway`` neither: it accepts another trajectory, not another state)."""

    def __init__(self, directory: str, step: int, diffs: list[tuple[str, Any, Any]]) -> None:
        CheckpointError.__init__(
            self, f"--checkpoint-dir {directory} (step {step}) was written with another "
            f"optimiser: {describe(diffs)}. It cannot be resumed with this one: the "
            "checkpoint's optimiser state is its rule's (Adam's two moments, Lion's one, "
            "SGD's none...), a resume restores that state, and this rule's state has another "
            "structure. --resume-anyway cannot change that (a resume never starts the "
            "optimiser state anew). Resume with the checkpoint's value, or start a new run in "
            "another --checkpoint-dir.")
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


def resume_rule(key: str) -> str:
    """What a resume does with a change of the recorded ``key``: one of :data:`RULES`
    (``state`` for :data:`STATE_KEYS`, the knob's part for the other optimiser and execution
    knobs, else ``run``)."""
    if key in STATE_KEYS:
        return "state"
    part = FIELD_GROUP.get(key)
    return part if part in ("optim", "execution") else "run"


def defines_run(key: str) -> bool:
    """Whether a recorded key is part of the run's identity (a change is refused unless
    ``--resume-anyway``): neither an optimiser nor an execution knob."""
    return resume_rule(key) == "run"


def _label(key: str) -> str:
    """How a difference is named: the flag that sets the key (declared by its field, else
    :data:`FLAGS`), else ``config['key']``."""
    if key in FLAGS:
        return f"{FLAGS[key]} ({key})"
    flag = (flag_of(RunConfig, key) if key in _RUN_FIELDS else
            flag_label(GROUPS[FIELD_GROUP[key]], key) if key in FIELD_GROUP else None)
    return f"{flag} ({key})" if flag else f"config[{key!r}]"


def hparam_diffs(saved: dict[str, Any], given: dict[str, Any], *, rule: str | None = None
                 ) -> list[tuple[str, Any, Any]]:
    """``(flag, checkpoint value, given value)`` for each setting both know and that differs
    (a record flat or by part: :func:`flat_hparams`); ``rule``: only the keys of that
    :func:`resume_rule` (``run``, ``state``, ``optim``, ``execution``).

    A key only one side knows (a field added or removed by a library upgrade) is not a
    difference of the user's making, so it is not reported.
    """
    a, b = flat_hparams(saved), flat_hparams(given)
    return [(_label(k), a[k], b[k]) for k in sorted(set(a) & set(b))
            if a[k] != b[k] and (rule is None or resume_rule(k) == rule)]


def resume_checked(ckpt: Checkpointer, trainer: RLTrainer, meta: dict[str, Any], anyway: bool
                   ) -> tuple[int, list[tuple[str, Any, Any]], list[dict[str, Any]]]:
    """Restore the newest good checkpoint after comparing its hyper-parameters with this run's
    (before any array is read). Returns the step, the differences taken (the run's own with
    ``anyway``, then the optimiser's and the execution knobs) and the lineage that later
    checkpoints carry (each change, with its step)."""
    found: dict[str, Any] = {}

    def check(saved: dict[str, Any]) -> None:
        old, new = saved.get("hparams", {}), meta["hparams"]
        diffs = {rule: hparam_diffs(old, new, rule=rule) for rule in RULES}
        if diffs["state"]:  # first: no flag resumes it, so naming the others would mislead
            raise OptimizerStateMismatchError(ckpt.directory, int(saved["step"]),
                                              diffs["state"])
        if diffs["run"] and not anyway:
            raise ResumeMismatchError(ckpt.directory, int(saved["step"]), diffs["run"])
        found["diffs"], found["lineage"] = diffs, list(saved.get("lineage", []))

    saved = ckpt.restore(trainer, meta["fingerprint"], check_meta=check)
    step, diffs, lineage = int(saved["step"]), found["diffs"], found["lineage"]
    notes = {"optim": ("optimiser settings", "they apply from this step on, over the restored "
                       "optimiser state; the trajectory is no longer the uninterrupted run's"),
             "execution": ("execution settings", "how a step is computed, not what: the same "
                           "run up to float rounding")}
    for rule, (what, why) in notes.items():
        if diffs[rule]:
            log.warning("resuming %s at step %d with changed %s: %s (%s)", ckpt.directory,
                        step, what, describe(diffs[rule]), why)
            lineage.append({"step": step, rule: [list(d) for d in diffs[rule]]})
    if diffs["run"]:
        log.warning("resuming %s at step %d with changed settings (--resume-anyway): %s; this "
                    "is no longer the run that was checkpointed", ckpt.directory, step,
                    describe(diffs["run"]))
        lineage.append({"step": step, "changed": [list(d) for d in diffs["run"]]})
    return step, diffs["run"] + diffs["optim"] + diffs["execution"], lineage
