"""The RL layer's configuration objects, JAX-free: the ``train`` CLI builds them to check its
flags before paying JAX's import, with the same rules the library applies.

* :class:`RLConfig`: one step's algorithm, optimiser and step knobs (its sampling part is
  :class:`~jaxrl_sym.rl.step.sampling.SamplingConfig`, derived with ``SamplingConfig.of``).
* :class:`PartialConfig`: partial rollouts (:mod:`jaxrl_sym.rl.step.partial`).
* :class:`RunConfig`: a training run on a task — the task, the prompt stream, the system, the
  model, how rollouts are generated (:class:`~jaxrl_sym.runtime.options.EngineOptions`,
  :class:`~jaxrl_sym.runtime.options.Speculation`) — and :class:`CheckpointConfig`: where it is
  saved and whether it resumes.
* :func:`task_rl_config`: the :class:`RLConfig` of a run on a task (the task's recipe, its
  response limit, the caller's fields).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from jaxrl_sym import systems
from jaxrl_sym.errors import InputError
from jaxrl_sym.generation import check_sampling_temperature
from jaxrl_sym.rl.names import ADV_NORMS, ALGOS, LOSS_AGGS, LR_SCHEDULES, OPTIMIZERS
from jaxrl_sym.rl.tasks.text_tasks import FORMAT_WEIGHT, check_format_weight, is_text_task
from jaxrl_sym.rl.tasks.token_tasks import Task, get_task
from jaxrl_sym.runtime.options import EngineOptions, Speculation
from jaxrl_sym.weights.lora_config import LoraConfig
from jaxrl_sym.weights.precision import Precision

__all__ = ["PG_LOSSES", "TASK_RECIPE", "TASK_REWARD", "CheckpointConfig", "PartialConfig",
           "RLConfig", "RunConfig", "speculation_of", "task_rl_config"]

PG_LOSSES = ("ppo_clip", "gspo", "cispo")
"""``RLConfig.pg_loss`` / ``train --pg-loss`` choices (:mod:`jaxrl_sym.rl.algorithms.losses`)."""

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


EXECUTION_KNOBS = frozenset({"update_tokens", "logprob_chunk", "remat", "overlap_reference"})
"""RLConfig fields that decide how a step is computed, not what it computes: micro-batches of
the update, log-prob chunks, recomputation in the backward, the reference pass's overlap. The
update is the same up to float rounding, so ``--resume`` takes a change of them (a memory fix
for a run that ran out of memory must not need ``--resume-anyway``) and says what changed."""


@dataclass(frozen=True)
class RLConfig:
    """Hyper-parameters of one RL fine-tuning step.

    algo: ``grpo`` (group-normalised advantages), ``rloo`` (leave-one-out baseline) or ``ppo``
      (value head + GAE).
    group_size: generations per prompt (G). GRPO/RLOO need >= 2 to have a baseline.
    temperature: sampling temperature; the loss scales logits the same way so the ratio of new
      to generation-time ("old") log-probs is 1 before the first update.
    max_new_tokens: response limit per row (a row also ends at ``eos_id``).
    clip_eps / clip_eps_high: PPO ratio clip range [1 - clip_eps, 1 + clip_eps_high] (the
      "clip_low" / "clip_high" of DAPO). clip_eps_high None means clip_eps (symmetric); a larger
      one ("clip-higher") lets a token that was unlikely at sampling time grow further in one
      update, which is how a rare correct answer gets reinforced before entropy collapses.
    pg_loss: the policy-gradient term. ``ppo_clip``: PPO's clipped surrogate per token,
      ``-min(r A, clip(r) A)`` with ``r = pi / pi_old`` (GRPO, DAPO and Dr. GRPO are this term
      with their advantages and ``loss_agg``). ``gspo``: the same with one length-normalised
      sequence ratio ``s = exp(mean_t log r_t)`` per sequence (Zheng et al. 2025,
      arXiv:2507.18071): one clipping decision per sequence; use ``loss_agg="seq_mean"`` (the
      paper's mean over sequences) and the paper's much smaller clip range, e.g. ``clip_eps``
      3e-4, ``clip_eps_high`` 4e-4 (a geometric mean of ratios stays near 1). ``cispo``:
      ``-sg(clip(r)) A log pi`` per token (MiniMax-M1, arXiv:2506.13585): the importance weight
      is clipped and held constant, so no token loses its gradient to the clip; the report
      uses ``loss_agg="token_mean"`` and no lower bound (``clip_eps`` >= 1 is allowed here
      only). Both use ``clip_eps`` / ``clip_eps_high`` as their clip range and refuse
      ``tis_cap``; at ``epochs == 1`` (ratios 1) all three give the same gradient.
    beta: weight of the k3 KL estimate against the reference policy (0 skips the reference pass).
    epochs: optimisation passes over one batch of rollouts (ratios leave 1 from the second on).
    loss_agg: how per-token terms become one number. ``token_mean``: every response token of the
      batch weighs the same (DAPO). ``seq_mean``: mean over each sequence's tokens, then over
      sequences (the GRPO paper; short responses weigh more per token). ``token_sum``: the sum over
      tokens divided by a constant, sequences x max_new_tokens (Dr. GRPO: no length bias at all).
    adv_norm: GRPO's advantage scaling after subtracting the group mean: ``group_std`` (the GRPO
      paper), ``batch_std`` (one std over the batch: a group of near-equal rewards is not blown up
      to unit scale) or ``none`` (Dr. GRPO). RLOO ignores it; PPO whitens its GAE advantages
      over the batch's tokens unless it is ``none``.
    drop_zero_var: give groups whose G rewards are all equal zero weight in the loss and spread
      the weights over the other groups (DAPO's dynamic sampling without re-sampling). Their
      advantage is 0 already; what dropping changes is that they no longer dilute the update
      and their tokens no longer feed the entropy bonus and KL term. GRPO/RLOO only.
    entropy_coef: weight of an entropy bonus on response slots (0: off). From random init the
      policy otherwise collapses onto fixed outputs before it finds the signal in the prompt.
    lr / warmup_steps / lr_schedule / total_steps / min_lr_ratio: Adam's learning rate, reached
      linearly over ``warmup_steps`` updates, then held (``constant``) or decayed to
      ``min_lr_ratio * lr`` at ``total_steps`` (``cosine``, ``linear``; they need total_steps).
      Counted in RL steps (each of the ``epochs`` updates of a step uses that step's rate).
    optimizer / weight_decay: optax's ``adam`` (the default; no weight decay), ``adamw``
      (decoupled decay, TRL's and verl's choice), ``sgd`` (decay as an L2 term), ``lion`` (one
      moment: half Adam's state) or ``adafactor`` (factored second moments: a fraction of it);
      ``weight_decay`` >= 0, refused with ``adam``, which has none (``adamw`` does).
    gamma / lam / vf_coef / vf_clip: PPO's discount, GAE lambda, value-loss weight and value clip.
    pack_row_len: row length of the packed training layout (None: at least 64 and the longest
      sequence, rounded to a length bucket).
    share_prompts: on the symbolic runtime, pack a GRPO group's samples behind one copy of
      their prompt per row (:func:`jaxrl_sym.systems.layout.shared_prefix_layout`): the reference,
      value and training forwards compute each prompt token once per row instead of G times —
      the same numbers (each response sees the same keys at the same positions), about a
      third fewer token slots on the step benchmark's workload (prompts 8-64, G = 8; the
      numbers: ``bench/results/cpu/design_notes.md``). False: every sample
      packed as its own prompt + response sequence.
    overlap_reference: on the symbolic runtime, score finished rows with the reference model
      while the rest still generate (False: one reference pass after generation). None (auto):
      on an accelerator only — on a CPU the scoring competes with decoding for the same cores
      (``RLTrainer.overlaps_reference``).
    update_tokens: token slots per training micro-batch (gradient accumulation: one optimiser
      update per epoch from the summed gradients, the same update as the whole batch at once up
      to float rounding). Bounds the update's peak memory — at Qwen2.5's 151,936-word vocabulary
      the logits alone take 0.6 MB per token in fp32. None: the whole batch in one program.
    logprob_chunk: token slots whose logits exist at once in the reference, value and loss
      programs (and the loss's backward, which recomputes each chunk's logits): the model's
      head is applied to the final hidden states one chunk at a time
      (:mod:`jaxrl_sym.rl.step.logprobs`), so the update's peak no longer grows with tokens x vocab.
      Needs a model with the contract's optional ``features``/``head`` split; without it the
      step runs unchunked and its ``logprob_chunking`` stat says why. A batch of at most this
      many slots runs unchunked too (one chunk would hold the same logits and its recomputed
      backward more). None: off (unchunked). The default, 256, is chosen for what a GPU pays:
      the chunk's backward holds about three ``[chunk x vocab]`` fp32 buffers, 1.8 GB at 1024
      slots of Qwen2.5's 151,936-word vocabulary and 0.45 GB at 256 (it lowers the projected
      update peak at the GPU preset: ``bench/results/cpu/design_notes.md``), while the head's
      flops are the same at any chunk. On a CPU a smaller chunk is slower
      (``bench/experiments/logprob_memory.py``; ``bench/results/logprob_memory.md``): set 1024
      there if time matters more than memory.
    remat: recompute each layer's activations in the update's backward instead of keeping them
      (gradient checkpointing between attention calls, :mod:`jaxrl_sym.rl.step.remat`; every
      system). On by default for what a GPU pays: at the GPU preset's micro-batch it removes
      most of the update's per-layer temporaries for about a quarter more update flops
      (``bench/results/projection.md``). False: keep them (faster where memory is plentiful).
    tis_cap: truncated importance sampling (verl, slime) for the gap between the generation's
      log-probs and the trainer's own at the same weights (bf16 generation vs a recompute,
      another system's kernels): each token's policy gradient is weighted by
      ``min(pi_trainer / pi_generation, tis_cap)`` and the PPO ratio is taken against the
      trainer's log-probs. None: off (the ratio is taken against the generation's, as before).
      Needs ``epochs == 1``: the trainer's log-probs at the step's start are those of the
      first epoch's own forward (a stop-gradient), which later epochs no longer have.
    """

    algo: str = "grpo"
    group_size: int = 8
    temperature: float = 1.0
    max_new_tokens: int = 8
    eos_id: int | None = None
    lr: float = 3e-3
    optimizer: str = "adam"
    weight_decay: float = 0.0
    max_grad_norm: float | None = 1.0
    clip_eps: float = 0.2
    clip_eps_high: float | None = None
    pg_loss: str = "ppo_clip"
    beta: float = 0.0
    epochs: int = 1
    loss_agg: str = "token_mean"
    adv_norm: str = "group_std"
    adv_eps: float = 1e-6
    drop_zero_var: bool = False
    entropy_coef: float = 0.0
    warmup_steps: int = 0
    lr_schedule: str = "constant"
    total_steps: int | None = None
    min_lr_ratio: float = 0.0
    gamma: float = 1.0
    lam: float = 0.95
    vf_coef: float = 0.5
    vf_clip: float = 0.2
    pack_row_len: int | None = None
    share_prompts: bool = True
    overlap_reference: bool | None = None
    update_tokens: int | None = None
    logprob_chunk: int | None = 256
    remat: bool = True
    tis_cap: float | None = None

    def __post_init__(self) -> None:
        if self.algo not in ALGOS:
            raise InputError(f"RLConfig.algo={self.algo!r}; choose one of {', '.join(ALGOS)}")
        for name, choices in (("loss_agg", LOSS_AGGS), ("adv_norm", ADV_NORMS),
                              ("lr_schedule", LR_SCHEDULES), ("pg_loss", PG_LOSSES),
                              ("optimizer", OPTIMIZERS)):
            if getattr(self, name) not in choices:
                raise InputError(f"RLConfig.{name}={getattr(self, name)!r}; choose one of "
                                 f"{', '.join(choices)}")
        self._check_schedule()
        if self.group_size < 1 or (self.algo in ("grpo", "rloo") and self.group_size < 2):
            raise InputError(f"RLConfig.group_size={self.group_size}: {self.algo} compares "
                             "generations of the same prompt, so it needs >= 2")
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise InputError(f"RLConfig.temperature={self.temperature} (--temperature): RL "
                             "samples, so it must be a finite number > 0 (greedy decoding has no "
                             "log-probs to take a ratio of)")
        check_sampling_temperature(self.temperature, "RLConfig.temperature")
        for name in ("update_tokens", "logprob_chunk"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise InputError(f"RLConfig.{name}={v!r} must be an integer >= 1 or None")
        if not isinstance(self.remat, bool):
            raise InputError(f"RLConfig.remat={self.remat!r} must be True or False")
        for name in ("max_new_tokens", "epochs"):
            if getattr(self, name) < 1:
                raise InputError(f"RLConfig.{name}={getattr(self, name)} must be >= 1")
        for name in ("lr", "clip_eps", "beta", "vf_coef", "vf_clip", "adv_eps", "entropy_coef",
                     "clip_eps_high", "weight_decay"):
            v = getattr(self, name)
            if v is not None and not (np.isfinite(v) and v >= 0):
                raise InputError(f"RLConfig.{name}={v} must be finite and >= 0")
        if self.tis_cap is not None and not (np.isfinite(self.tis_cap) and self.tis_cap >= 1.0):
            raise InputError(f"RLConfig.tis_cap={self.tis_cap} (--tis-cap) must be finite and "
                             ">= 1 (a cap below 1 down-weights tokens the two policies agree on)")
        if self.tis_cap is not None and self.epochs != 1:
            raise InputError(f"RLConfig.tis_cap (--tis-cap) needs epochs == 1, got epochs="
                             f"{self.epochs}: the trainer's log-probs at the step's start come "
                             "from the first epoch's forward")
        self._check_pg_loss()

    def _check_pg_loss(self) -> None:
        """The clip range and TIS against the policy-gradient term (``pg_loss``)."""
        if self.pg_loss != "cispo" and not 0.0 <= self.clip_eps < 1.0:
            raise InputError(f"RLConfig.clip_eps={self.clip_eps} (--clip-low) must be in [0, 1): "
                             "the ratio's lower clip bound 1 - clip_eps must stay positive "
                             "(pg_loss='cispo' alone accepts >= 1: no lower bound on its weight)")
        if self.pg_loss != "ppo_clip" and self.tis_cap is not None:
            raise InputError(f"RLConfig.tis_cap (--tis-cap) re-bases ppo_clip's token ratio on "
                             f"the trainer's own log-probs; pg_loss={self.pg_loss!r} (--pg-loss) "
                             "defines its own ratio: leave tis_cap None")

    def _check_schedule(self) -> None:
        """The learning-rate schedule's fields, each named as the ``train`` flag that sets it."""
        if isinstance(self.warmup_steps, bool) or self.warmup_steps < 0:
            raise InputError(f"RLConfig.warmup_steps={self.warmup_steps} (--warmup-steps) must "
                             "be an integer >= 0")
        if self.optimizer == "adam" and self.weight_decay:
            raise InputError(f"RLConfig.weight_decay={self.weight_decay} (--weight-decay) with "
                             "optimizer='adam': Adam has no weight decay (an L2 term in its "
                             "gradient is not one); use --optimizer adamw")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise InputError(f"RLConfig.min_lr_ratio={self.min_lr_ratio} must be in [0, 1]")
        if self.lr_schedule != "constant" and (self.total_steps is None
                                               or self.total_steps <= self.warmup_steps):
            raise InputError(
                f"RLConfig.lr_schedule={self.lr_schedule!r} (--lr-schedule) decays until "
                f"total_steps, which must be set and > warmup_steps ({self.warmup_steps}); "
                f"got total_steps={self.total_steps}")

    @property
    def clip_high(self) -> float:
        return self.clip_eps if self.clip_eps_high is None else self.clip_eps_high

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


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

    task / max_digits / partial_weight: the task (``reverse``, ``copy``, ``sort``, ``add``; with
    ``model_dir`` a text task) and its reward's weight on partial credit (None: the recipe's).
    steps / seed / prompts_per_step: the run's length and its prompt and sampling stream.
    system: the registered system the steps run on. model: overrides of the built-in model's
    fields; model_dir: a Hugging Face checkpoint to fine-tune instead. eval_prompts: held-out
    prompts for the final greedy evaluation (0: skip). mesh / device_memory: see
    :class:`~jaxrl_sym.rl.step.trainer.RLTrainer`. partial: partial rollouts (None: off).
    speculation: speculative decoding of the rollouts (None: plain; :func:`speculation_of`
    builds it from ``--speculate``). engine: the generation engine's options (None: the
    runtime's defaults, ``EngineOptions()``). precision: ``fp32``, ``bf16-mixed`` or ``bf16``
    (:mod:`jaxrl_sym.weights.precision`; None: bf16-mixed for a checkpoint on an accelerator,
    else fp32). lora: LoRA adapters over the frozen model (None: full fine-tuning).
    """

    task: str = "reverse"
    steps: int = 400
    seed: int = 0
    prompts_per_step: int = 32
    system: str = systems.REFERENCE
    max_digits: int = 3
    partial_weight: float | None = None
    model: dict[str, Any] | None = None
    model_dir: str | None = None
    eval_prompts: int = 256
    mesh: str | None = None
    device_memory: str | int | None = None
    partial: PartialConfig | None = None
    speculation: Speculation | None = None
    engine: EngineOptions | None = None
    precision: str | None = None
    lora: LoraConfig | None = None

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
    limit and EOS, then ``fields_`` (the caller's: algorithm, rates, ``--max-new-tokens``...);
    a decaying learning-rate schedule without ``total_steps`` ends with the run. A former
    field (:data:`MOVED`) is refused naming where it is set now."""
    moved = sorted(set(fields_) & set(MOVED))
    if moved:
        raise InputError(f"config[{moved[0]!r}] is no longer an RLConfig field (RLConfig is the "
                         f"algorithm and optimiser): it is {MOVED[moved[0]]}")
    merged = {"max_new_tokens": max_new_tokens, "eos_id": eos_id, **TASK_RECIPE, **fields_}
    if merged.get("lr_schedule", "constant") != "constant" and merged.get("total_steps") is None:
        merged["total_steps"] = steps
    return RLConfig(**merged)
