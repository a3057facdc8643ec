"""The RL layer's configuration objects, JAX-free: the ``train`` CLI builds them to check its
flags before paying JAX's import, with the same rules the library applies.

* :class:`RLConfig`: one step's knobs, composed of three parts by concern
  (:mod:`jaxrl_sym.rl.knobs`: :class:`AlgorithmConfig`, :class:`OptimizerConfig`,
  :class:`ExecutionConfig`); its sampling request is
  :class:`~jaxrl_sym.rl.step.sampling.SamplingConfig`, derived with ``SamplingConfig.of``.
* :class:`PartialConfig`: partial rollouts (:mod:`jaxrl_sym.rl.step.partial`).
* :class:`RunConfig`: a training run on a task — the task, the prompt stream, the system, the
  model, how rollouts are generated (:class:`~jaxrl_sym.runtime.options.EngineOptions`,
  :class:`~jaxrl_sym.runtime.options.Speculation`) — and :class:`CheckpointConfig`: where it is
  saved and whether it resumes.
* :func:`task_rl_config`: the :class:`RLConfig` of a run on a task (the task's recipe, its
  response limit, the caller's fields).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from jaxrl_sym import systems
from jaxrl_sym.errors import InputError
from jaxrl_sym.rl.knobs import (
    AlgorithmConfig,
    ExecutionConfig,
    OptimizerConfig,
    knob,
    not_a_flag,
)
from jaxrl_sym.rl.names import PG_LOSSES, TASK_HELP
from jaxrl_sym.rl.tasks.text_tasks import FORMAT_WEIGHT, check_format_weight, is_text_task
from jaxrl_sym.rl.tasks.token_tasks import Task, get_task
from jaxrl_sym.runtime.options import EngineOptions, Speculation
from jaxrl_sym.weights.lora_config import LoraConfig
from jaxrl_sym.weights.precision import PRECISIONS, Precision

__all__ = ["GROUPS", "PG_LOSSES", "TASK_RECIPE", "TASK_REWARD", "AlgorithmConfig",
           "CheckpointConfig", "ExecutionConfig", "OptimizerConfig", "PartialConfig", "RLConfig",
           "RunConfig", "nest_hparams", "speculation_of", "task_rl_config"]

MOVED: dict[str, str] = {
    "speculate": "the run's speculation: train(speculate=K), --speculate K, "
                 "RLTrainer(speculation=Speculation(K))",
    "speculate_adaptive": "the run's speculation: train(speculate_adaptive=True), "
                          "--speculate-adaptive, RLTrainer(speculation=Speculation(K, "
                          "adaptive=True))",
    "gen_max_pad_fraction": "the engine's max_pad_fraction: train(engine=EngineOptions("
                            "max_pad_fraction=...)), RLTrainer(engine=...)",
}
"""Former RLConfig fields (generation, not the algorithm) and where each is set now."""

GROUPS: dict[str, type] = {"algorithm": AlgorithmConfig, "optim": OptimizerConfig,
                           "execution": ExecutionConfig}
"""RLConfig's parts by attribute: what a step computes, how its gradient becomes an update
(both define the run), how it is computed (does not)."""

FIELD_GROUP: dict[str, str] = {f.name: g for g, cls in GROUPS.items() for f in fields(cls)}
"""Each knob's group. A knob has one name across the groups (tests/test_one_default.py), so a
flat ``{field: value}`` — ``train(config=...)``, a checkpoint written before the split — maps
onto the groups unambiguously."""


@dataclass(frozen=True)
class RLConfig:
    """One RL step's configuration, by concern: :class:`~jaxrl_sym.rl.knobs.AlgorithmConfig`
    (``algorithm``), :class:`~jaxrl_sym.rl.knobs.OptimizerConfig` (``optim``) and
    :class:`~jaxrl_sym.rl.knobs.ExecutionConfig` (``execution``). Each part has its own checks
    and its own reason to be a part (its docstring); code that needs one part takes that part
    (the loss an AlgorithmConfig, the optimiser an OptimizerConfig).

    ``RLConfig.of(algo="grpo", lr=1e-3, update_tokens=512)`` builds one from knob names (each
    belongs to one part); :meth:`replace` changes knobs by name.
    """

    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    optim: OptimizerConfig = field(default_factory=OptimizerConfig)
    execution: ExecutionConfig = field(default_factory=ExecutionConfig)

    def __post_init__(self) -> None:
        for name, cls in GROUPS.items():
            if not isinstance(getattr(self, name), cls):
                raise InputError(f"RLConfig.{name}={getattr(self, name)!r}: expected the "
                                 f"{cls.__name__} part (RLConfig.of builds the parts from knob "
                                 "names)")

    @classmethod
    def of(cls, **knobs: Any) -> RLConfig:
        """The config with these knobs (field names of any part), the others at their
        defaults. A name no part has is refused (a former field: naming where it is set now)."""
        parts: dict[str, dict[str, Any]] = {g: {} for g in GROUPS}
        for name, value in knobs.items():
            if name in MOVED:
                raise InputError(f"config[{name!r}] is no longer an RLConfig field (RLConfig is "
                                 f"the algorithm, optimiser and execution): it is {MOVED[name]}")
            if name not in FIELD_GROUP:
                near = difflib.get_close_matches(name, FIELD_GROUP, n=1)
                raise InputError(f"config[{name!r}] is not a knob of "
                                 f"{', '.join(c.__name__ for c in GROUPS.values())}"
                                 + (f" (did you mean {near[0]!r}?)" if near else ""))
            parts[FIELD_GROUP[name]][name] = value
        return cls(**{g: GROUPS[g](**kw) for g, kw in parts.items()})

    def replace(self, **knobs: Any) -> RLConfig:
        """This config with the given knobs (by field name) changed."""
        return RLConfig.of(**{**self.knobs(), **knobs})

    def knobs(self) -> dict[str, Any]:
        """Every knob by its field name (one flat dict: the names are unique)."""
        return {k: v for part in self.to_dict().values() for k, v in part.items()}

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """``{"algorithm": {...}, "optim": {...}, "execution": {...}}`` (what checkpoints
        record, :func:`nest_hparams` reads older flat records into it)."""
        return {g: {f.name: getattr(getattr(self, g), f.name) for f in fields(GROUPS[g])}
                for g in GROUPS}


def nest_hparams(hparams: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's recorded hyper-parameters with the step's knobs under their part
    (``algorithm``, ``optim``, ``execution``). Checkpoints written before RLConfig was split
    recorded the knobs flat, beside the run's own keys (``task``, ``seed``...): those keys are
    moved into their part, so an old checkpoint compares with a new run knob by knob. The run's
    keys, and keys no part knows (a removed field), stay where they are."""
    out = {k: v for k, v in hparams.items() if k not in FIELD_GROUP}
    for g in GROUPS:
        out[g] = {**{k: v for k, v in hparams.items() if FIELD_GROUP.get(k) == g},
                  **(hparams.get(g) or {})}
    return out


@dataclass(frozen=True)
class PartialConfig:
    """fraction: share of the step's generating rows that must finish before it stops (in
    (0, 1]; 1 stops only when all have). segment: tokens per row per generation call (the stopping
    granularity). max_carry: steps a row may be carried (>= 1)."""

    fraction: float
    segment: int = 4  # used only by systems that cannot stop mid-generation
    max_carry: int = 1

    def __post_init__(self) -> None:
        if not 0.0 < float(self.fraction) <= 1.0:
            raise InputError(f"partial rollout fraction={self.fraction} (--partial-rollout) must "
                             "be in (0, 1]: the share of rows that must finish before a step "
                             "stops generating")
        for name, flag in (("segment", "--partial-segment"), ("max_carry", "--partial-max-carry")):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InputError(f"partial rollout {name}={v!r} ({flag}) must be an integer >= 1")

    def to_dict(self) -> dict[str, Any]:
        return {"fraction": float(self.fraction), "segment": self.segment,
                "max_carry": self.max_carry}


# The recipe that learns here (issue 12; bench/learning.py measures it over seeds and
# algorithms). FIELD_NOTES' Adam 3e-3 with plain GRPO collapsed this model (tied embeddings,
# RMSNorm) within ~10 steps; lr 1e-3, a 0.01 entropy bonus and per-sequence averaging learned on
# some seeds only: on seed 11 the entropy collapsed, most groups became zero-variance, and the
# policy settled on partial credit (bench/results/learning.md, "Why seed 11 stalled before").
# Group-std advantages scale a group's near-equal partial-credit rewards up to
# unit size, so the policy sharpens on noise at full speed whatever the entropy bonus (0.05 still
# collapsed; lower lr or a warm-up only delayed it). Advantages at reward scale (Dr. GRPO) let the
# policy gradient shrink as a group's rewards converge, leaving the entropy bonus to keep sampling
# alive; halving partial credit makes the exact answer dominate the advantage.
TASK_RECIPE: dict[str, Any] = dict(lr=1e-3, entropy_coef=0.01, loss_agg="seq_mean",
                                   adv_norm="none")
TASK_REWARD: dict[str, Any] = dict(partial_weight=0.5)


def _at_least(value: Any, minimum: int, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise InputError(f"{what} must be an integer >= {minimum}")
    if value < minimum:
        raise InputError(f"{what} must be >= {minimum}")


@dataclass(frozen=True)
class RunConfig:
    """A training run on an offline task, besides the step's :class:`RLConfig`.

    Each field that one ``train`` flag sets is declared with :func:`~jaxrl_sym.rl.knobs.knob`,
    as the step's knobs are: its one default, and its flag's help, name (``--prompts``,
    ``--model``) and choices in the field's metadata, from which
    :mod:`jaxrl_sym.rl.run.config_flags` generates the flag. Why: these flags were written by
    hand beside the fields, so a knob had a name, a default and a help in two places. The fields
    no single flag sets say why (:func:`~jaxrl_sym.rl.knobs.not_a_flag`).

    partial_weight: None is the recipe's (:attr:`reward_weight`). mesh / device_memory: see
    :class:`~jaxrl_sym.rl.step.trainer.RLTrainer`. precision:
    :mod:`jaxrl_sym.weights.precision`; None: bf16-mixed for a checkpoint on an accelerator,
    else fp32.
    """

    task: str = knob("reverse", TASK_HELP)
    steps: int = knob(400, "RL steps in all (a resumed run continues up to this step)")
    seed: int = knob(0, "the run's seed: step k's prompts and samples depend on (seed, k) "
                     "only; it also initialises the built-in model")
    prompts_per_step: int = knob(32, "prompts per step", flag="prompts")
    system: str = knob(systems.REFERENCE, "the registered system the steps run on",
                       choices=lambda: systems.names(trains=True))
    max_digits: int = knob(3, "a built-in task's longest number, in digits")
    partial_weight: float | None = knob(
        None, "task reward: weight of partial credit for a non-exact answer, in [0, 1] "
        f"(default: {TASK_REWARD['partial_weight']}); with --model, the weight of the '#### N' "
        f"format in a correct answer's reward, in [0, 0.5) (default: {FORMAT_WEIGHT}; 0: the "
        "exact answer only)")
    model: dict[str, Any] | None = not_a_flag(None, "overrides of the built-in model's fields: "
                                              "train(model={...}) only")
    model_dir: str | None = knob(None, "fine-tune this Hugging Face checkpoint directory on a "
                                 "text task: --task word-problems or jsonl:FILE ({prompt, "
                                 "answer} lines), or --dataset FILE", flag="model",
                                 metavar="DIR")
    eval_prompts: int = knob(256, "held-out prompts for the final greedy exact match (0: skip)")
    mesh: str | None = knob(None, "train on a device mesh, e.g. data=4,model=2 (axes "
                            "data/fsdp/model; the sizes must multiply to the device count): "
                            "parameters and optimiser state sharded FSDP-style, batch rows split "
                            "over data. See README 'Multi-device and multi-host'", metavar="AXES")
    device_memory: str | int | None = knob(
        None, "bytes one device may hold, e.g. 16GB or 512MiB: the sharded state and every "
        "compiled program are checked against it before they run, so a model that does not fit "
        "fails at once naming the mesh it needs", metavar="SIZE")
    partial: PartialConfig | None = not_a_flag(None, "partial rollouts: a PartialConfig from "
                                               "--partial-rollout, --partial-segment and "
                                               "--partial-max-carry (None: off)")
    speculation: Speculation | None = not_a_flag(None, "speculative decoding of the rollouts: "
                                                 "a Speculation from --speculate and "
                                                 "--speculate-adaptive (speculation_of; None: "
                                                 "plain)")
    engine: EngineOptions | None = not_a_flag(None, "the generation engine's options: "
                                              "train(engine=EngineOptions(...)) only (None: the "
                                              "runtime's defaults)")
    precision: str | None = knob(None, "fp32; bf16-mixed (fp32 master weights and Adam state, a "
                                 "bf16 copy for generation, scoring and the forward/backward); "
                                 "bf16 (everything bf16: small updates round away) (default: "
                                 "bf16-mixed for a --model checkpoint on a GPU/TPU, else fp32)",
                                 choices=PRECISIONS)
    lora: LoraConfig | None = not_a_flag(None, "LoRA adapters over the frozen model: a "
                                         "LoraConfig from --lora-rank, --lora-alpha and "
                                         "--lora-targets (None: full fine-tuning)")

    def __post_init__(self) -> None:
        if self.lora is not None and not isinstance(self.lora, LoraConfig):
            raise InputError(f"lora={self.lora!r}: give a LoraConfig or None")
        _check_trains(self.system)
        if self.precision is not None:
            Precision(self.precision)  # its own rule: one of PRECISIONS, named by the flag
        if self.engine is not None and not isinstance(self.engine, EngineOptions):
            raise InputError(f"engine={self.engine!r}: give an EngineOptions or None")
        if self.speculation is not None and not isinstance(self.speculation, Speculation):
            raise InputError(f"speculation={self.speculation!r}: give a Speculation or None "
                             "(speculation_of builds one from --speculate)")
        _at_least(self.steps, 1, f"steps={self.steps} (--steps)")
        _at_least(self.prompts_per_step, 1, f"prompts_per_step={self.prompts_per_step} "
                  "(--prompts)")
        _at_least(self.eval_prompts, 0, f"eval_prompts={self.eval_prompts} (--eval-prompts)")
        if self.model_dir is None and not is_text_task(self.task):
            self.task_of()  # the task's own rules: its name, digits, reward weight
        elif self.partial_weight is not None:
            check_format_weight(self.partial_weight)  # a text task's: the format's weight

    @property
    def reward_weight(self) -> float:
        """The task reward's partial-credit weight (the recipe's when unset): for a text task of
        a checkpoint (``model_dir``), the weight of the answer format."""
        pw = self.partial_weight
        if pw is not None:
            return pw
        return FORMAT_WEIGHT if self.model_dir is not None else TASK_REWARD["partial_weight"]

    def task_of(self) -> Task:
        """The built-in token task this run trains on
        (:func:`~jaxrl_sym.rl.tasks.token_tasks.get_task`)."""
        return get_task(self.task, max_digits=self.max_digits, partial_weight=self.reward_weight)


@dataclass(frozen=True)
class CheckpointConfig:
    """Where a run is saved and whether it continues one.

    directory: checkpoints go here (None: none are written). every: save every this many steps
    and at the end (0: only at the end). keep: the newest checkpoints kept. resume: continue the
    newest good checkpoint (an error without one); resume_or_start: resume when there is one,
    else start; resume_anyway: accept settings that differ from the checkpoint's.
    """

    directory: str | None = None
    every: int = 0
    keep: int = 3  # newest checkpoints kept: room to fall back past two damaged ones
    resume: bool = False
    resume_or_start: bool = False
    resume_anyway: bool = False

    def __post_init__(self) -> None:
        _at_least(self.every, 0, f"checkpoint_every={self.every} (--checkpoint-every)")
        if isinstance(self.keep, bool) or not isinstance(self.keep, int) or self.keep < 1:
            raise InputError(f"keep={self.keep} (--keep): at least the newest checkpoint must be "
                             "kept; pass 1 or more")
        if self.resume_anyway and not self.resuming:
            raise InputError("--resume-anyway (resume_anyway=True) only applies when resuming; "
                             "add --resume or --resume-or-start")
        if self.resuming and self.directory is None:
            raise InputError("--resume / --resume-or-start need --checkpoint-dir (the directory "
                             "holding the run's checkpoints)")

    @property
    def resuming(self) -> bool:
        return self.resume or self.resume_or_start


def _check_trains(name: Any) -> None:
    """``name`` is a registered system that trains (JAX-free: the spec says so, its RL half is
    not imported); else an :class:`InputError` naming those that do."""
    try:
        trains = isinstance(name, str) and systems.get(name).capabilities.trains
    except InputError:
        trains = False
    if not trains:
        raise InputError(f"system={name!r} (--system): choose one of "
                         f"{', '.join(systems.names(trains=True))} (the systems that train)")


def speculation_of(k: int | None, adaptive: bool | None = False) -> Speculation | None:
    """``--speculate K`` / ``--speculate-adaptive`` as the run's :class:`Speculation` (None:
    K None or 0, plain decoding); errors name the flags."""
    if isinstance(k, bool) or not isinstance(k, int | type(None)) or (k or 0) < 0:
        raise InputError(f"speculate={k!r} (--speculate): draft tokens per verify, an integer "
                         ">= 0 (0: plain decoding)")
    if not k:
        if adaptive:
            raise InputError("speculate_adaptive (--speculate-adaptive) picks k per verify up to "
                             "--speculate K; give --speculate K >= 1 too")
        return None
    return Speculation(int(k), bool(adaptive))


def task_rl_config(steps: int, max_new_tokens: int, eos_id: Any,
                   fields_: dict[str, Any]) -> RLConfig:
    """The :class:`RLConfig` of a run on a task: :data:`TASK_RECIPE`, the task's response
    limit and EOS, then ``fields_`` (the caller's knobs by name: algorithm, rates,
    ``--max-new-tokens``...); a decaying learning-rate schedule without ``total_steps`` ends
    with the run. A former field (:data:`MOVED`) is refused naming where it is set now."""
    merged = {"max_new_tokens": max_new_tokens, "eos_id": eos_id, **TASK_RECIPE, **fields_}
    if merged.get("lr_schedule", "constant") != "constant" and merged.get("total_steps") is None:
        merged["total_steps"] = steps
    return RLConfig.of(**merged)
