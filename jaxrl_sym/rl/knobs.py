"""One RL step's knobs, one frozen dataclass per concern (JAX-free):

* :class:`AlgorithmConfig`: what a step computes — the rollouts it learns from and the
  objective. Part of the run's identity: ``--resume`` refuses a change.
* :class:`OptimizerConfig`: how the gradient becomes an update. ``--resume`` takes a changed
  rate, schedule, decay or clip and says what changed; another rule (``--optimizer``) is refused,
  since the checkpoint's optimiser state is the old rule's.
* :class:`ExecutionConfig`: how a step is computed (memory, layout, overlap), not what: the same
  update up to float rounding, so ``--resume`` takes a change and says what changed.

Every field is declared with :func:`knob`: its one default, and its ``train`` flag's help (and
choices) in the field's metadata; the flags are generated from these
(:mod:`jaxrl_sym.rl.run.config_flags`), one per field, named as the field with ``-`` unless the
metadata names an older flag. A field that is not a flag says why (:func:`not_a_flag`).
:class:`~jaxrl_sym.rl.config.RLConfig` composes the three; the run's own fields
(:class:`~jaxrl_sym.rl.config.RunConfig`) are declared the same way.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import Field, dataclass, field, fields
from typing import Any, get_args, get_type_hints

from jaxrl_sym.errors import InputError
from jaxrl_sym.generation import check_sampling_temperature
from jaxrl_sym.rl.names import ADV_NORMS, ALGOS, LOSS_AGGS, LR_SCHEDULES, OPTIMIZERS, PG_LOSSES

__all__ = ["DEFAULT_UPDATE_TOKENS", "AlgorithmConfig", "ExecutionConfig", "OptimizerConfig",
           "choices_of", "flag_label", "flag_of", "knob", "knob_type", "not_a_flag"]

DEFAULT_UPDATE_TOKENS = 4096
"""Token slots per training micro-batch of a system with fixed micro-batches (sym) when
``ExecutionConfig.update_tokens`` is unset. Such a system runs every batch in micro-batches of
``max(1, budget // row_len)`` rows, so a budget there must exist: without one the micro-batch
would be the whole batch, whose row count changes every step, and every step would compile a
new reference and update program (``bench/results/cpu/growing_rl.md``: 15 update layouts in 30
steps). Why 4096: the GPU step benchmark's micro-batch, measured to fit at Qwen2.5-0.5B's
151,936-word vocabulary (``bench/results/nvidia-h100-80gb-hbm3/README.md``), and at most the
whole batch's slots at every GPU workload there. The cost: a batch is completed with empty rows
to whole micro-batches, under one micro-batch of filler per step; a batch smaller than one
micro-batch runs at the next power of two of its rows instead
(:func:`jaxrl_sym.rl.step.context.micro_batch_rows`), under half of it filler."""


def knob(default: Any, help: str, *, flag: str | None = None,
         choices: tuple[str, ...] | Callable[[], tuple[str, ...]] | None = None,
         metavar: str | None = None) -> Any:
    """A config field: its one default, and what its ``train`` flag says (``help``; ``flag``:
    the flag's name without ``--`` where it predates the field's name; ``choices``: the values
    the field takes, offered by the flag and checked by the dataclass (:func:`choices_of`)).
    ``choices`` may be a function for a set known only when the flag is built: the registry's
    systems that train, which a plugin adds to after this module is imported."""
    meta = {"help": help, "flag": flag, "choices": choices, "metavar": metavar}
    return field(default=default, metadata={k: v for k, v in meta.items() if v is not None})


def not_a_flag(default: Any, why: str) -> Any:
    """A config field without a ``train`` flag, and why (the CLI test reads it)."""
    return field(default=default, metadata={"not_a_flag": why})


def flag_of(cls: type, name: str) -> str | None:
    """The ``train`` flag of ``cls``'s field ``name`` (``--clip-low``), None for a field that is
    not a flag."""
    meta = {f.name: f.metadata for f in fields(cls)}[name]
    if "not_a_flag" in meta:
        return None
    return "--" + meta.get("flag", name.replace("_", "-"))


def knob_type(cls: type, name: str) -> tuple[type, bool]:
    """The type of ``cls``'s field ``name`` and whether None is one of its values too
    (``int | None`` -> ``(int, True)``)."""
    hint = get_type_hints(cls)[name]
    args = [a for a in get_args(hint) if a is not type(None)]
    return (args[0] if args else hint), bool(args) and len(args) < len(get_args(hint))


def flag_label(cls: type, name: str) -> str | None:
    """The flag as messages name it: ``--lr``, ``--remat/--no-remat`` for a switch; None for a
    field that is not a flag."""
    flag = flag_of(cls, name)
    if flag is None or knob_type(cls, name)[0] is not bool:
        return flag
    return f"{flag}/--no-{flag[2:]}"


def _refuse(cfg: Any, name: str, why: str) -> InputError:
    """An error naming the field, its value and its flag: ``Class.name=value (--flag) why``."""
    flag = flag_of(type(cfg), name)
    sep = "" if why.startswith(":") else " "
    return InputError(f"{type(cfg).__name__}.{name}={getattr(cfg, name)!r}"
                      f"{f' ({flag})' if flag else ''}{sep}{why}")


def choices_of(f: Field[Any]) -> tuple[str, ...] | None:
    """The values field ``f`` takes (its metadata's ``choices``, called if a function), or None
    for a field of any value."""
    choices = f.metadata.get("choices")
    return choices() if callable(choices) else choices


def _check_choices(cfg: Any) -> None:
    """Every field with ``choices`` in its metadata holds one of them."""
    for f in fields(cfg):
        choices = choices_of(f)
        if choices is not None and getattr(cfg, f.name) not in choices:
            raise _refuse(cfg, f.name, f"is not one of {', '.join(choices)}")


def _check_at_least(cfg: Any, names: tuple[str, ...], low: float, what: str,
                    integer: bool = False) -> None:
    """Each of ``names`` (unless None) is a finite number >= ``low`` (an integer if asked)."""
    for name in names:
        v = getattr(cfg, name)
        if v is None:
            continue
        kind = numbers.Integral if integer else numbers.Real
        if isinstance(v, bool) or not isinstance(v, kind) or not math.isfinite(v) or v < low:
            raise _refuse(cfg, name, f"must be {what}")


@dataclass(frozen=True)
class AlgorithmConfig:
    """What one RL step computes: the rollouts it learns from (G samples per prompt at a
    temperature, up to a response limit) and the objective (advantages, policy-gradient term,
    clip range, KL, entropy bonus, aggregation, PPO's critic).

    Why a group: these define the run. A change gives another trajectory (another
    ``params_sha256``) from the same checkpoint, so ``--resume`` refuses one (``--resume-anyway``
    continues as a changed run).

    Notes the flags' one-line help leaves out:

    temperature: the loss scales logits the same way, so the ratio of new to generation-time
      ("old") log-probs is 1 before the first update.
    clip_eps / clip_eps_high: the ratio clip [1 - clip_eps, 1 + clip_eps_high] (DAPO's
      "clip_low" / "clip_high"). A larger high end ("clip-higher") lets a token that was unlikely
      at sampling time grow further in one update, which is how a rare correct answer gets
      reinforced before entropy collapses.
    pg_loss: ``ppo_clip``: PPO's clipped surrogate per token, ``-min(r A, clip(r) A)`` with
      ``r = pi / pi_old`` (GRPO, DAPO and Dr. GRPO are this term with their advantages and
      ``loss_agg``). ``gspo``: the same with one length-normalised sequence ratio
      ``s = exp(mean_t log r_t)`` per sequence (Zheng et al. 2025, arXiv:2507.18071): one
      clipping decision per sequence; use ``loss_agg="seq_mean"`` and the paper's much smaller
      clip range, e.g. ``clip_eps`` 3e-4, ``clip_eps_high`` 4e-4 (a geometric mean of ratios
      stays near 1). ``cispo``: ``-sg(clip(r)) A log pi`` per token (MiniMax-M1,
      arXiv:2506.13585): the importance weight is clipped and held constant, so no token loses
      its gradient to the clip; the report uses ``loss_agg="token_mean"`` and no lower bound
      (``clip_eps`` >= 1 is allowed here only). Both refuse ``tis_cap``; at ``epochs == 1``
      (ratios 1) all three give the same gradient.
    loss_agg: ``token_mean``: every response token of the batch weighs the same (DAPO).
      ``seq_mean``: mean over each sequence's tokens, then over sequences (the GRPO paper; short
      responses weigh more per token). ``token_sum``: the sum over tokens divided by a constant,
      sequences x max_new_tokens (Dr. GRPO: no length bias at all).
    adv_norm: ``batch_std`` keeps a group of near-equal rewards from being blown up to unit
      scale. RLOO ignores it; PPO whitens its GAE advantages over the batch's tokens unless it is
      ``none``.
    drop_zero_var: DAPO's dynamic sampling without re-sampling. Such a group's advantage is 0
      already; dropping it stops it diluting the update and feeding the entropy bonus and KL.
    entropy_coef: from random init the policy otherwise collapses onto fixed outputs before it
      finds the signal in the prompt.
    tis_cap: truncated importance sampling (verl, slime) for the gap between the generation's
      log-probs and the trainer's own at the same weights (bf16 generation vs a recompute,
      another system's kernels): the PPO ratio is then taken against the trainer's log-probs.
      Needs ``epochs == 1``: the trainer's log-probs at the step's start are those of the first
      epoch's own forward (a stop-gradient), which later epochs no longer have.
    """

    algo: str = knob("grpo", "grpo (group-normalised advantages), rloo (leave-one-out "
                     "baseline) or ppo (value head + GAE)", choices=ALGOS)
    group_size: int = knob(8, "generations per prompt (G); grpo and rloo need >= 2 for a "
                           "baseline", flag="group")
    temperature: float = knob(1.0, "sampling temperature of the rollouts (> 0; the loss scales "
                              "its logits the same way)")
    max_new_tokens: int = knob(8, "response limit per row (a row also ends at EOS); default: "
                               "the task's")
    eos_id: int | None = not_a_flag(None, "the end-of-sequence token is the task's (the "
                                    "checkpoint tokenizer's with --model), not a choice")
    pg_loss: str = knob("ppo_clip", "policy-gradient term: ppo_clip (GRPO/DAPO/Dr. GRPO's); "
                        "gspo: one clipped ratio per sequence (e.g. --clip-low 3e-4 --clip-high "
                        "4e-4 --loss-agg seq_mean); cispo: clipped stop-gradient IS weights, "
                        "every token keeps its gradient (e.g. --clip-low 1 --loss-agg "
                        "token_mean)", choices=PG_LOSSES)
    clip_eps: float = knob(0.2, "ratio clip 1 - eps (clip_eps)", flag="clip-low")
    clip_eps_high: float | None = knob(None, "ratio clip 1 + eps_high (clip_eps_high; above "
                                       "--clip-low: DAPO's clip-higher); default: --clip-low's",
                                       flag="clip-high")
    beta: float = knob(0.0, "weight of the k3 KL estimate against the reference policy (0: no "
                       "reference pass)")
    epochs: int = knob(1, "optimisation passes over one batch of rollouts (ratios leave 1 from "
                       "the second on)")
    loss_agg: str = knob("token_mean", "how per-token terms become one number: token_mean "
                         "(DAPO), seq_mean (GRPO), token_sum (Dr. GRPO)", choices=LOSS_AGGS)
    adv_norm: str = knob("group_std", "advantage scale after subtracting the group mean: "
                         "group_std (GRPO), batch_std (one std over the batch) or none "
                         "(Dr. GRPO)", choices=ADV_NORMS)
    adv_eps: float = knob(1e-6, "added to the std the advantages are divided by")
    drop_zero_var: bool = knob(False, "give groups whose rewards are all equal zero weight in "
                               "the loss (grpo, rloo)")
    entropy_coef: float = knob(0.0, "weight of an entropy bonus on response tokens (0: off)")
    tis_cap: float | None = knob(None, "truncated importance sampling: weight each token's "
                                 "gradient by min(pi_trainer / pi_generation, C), for a "
                                 "precision or kernel mismatch between generation and training "
                                 "(verl's TIS; e.g. 2; needs --epochs 1; ppo_clip only); "
                                 "default: off", metavar="C")
    gamma: float = knob(1.0, "PPO's discount")
    lam: float = knob(0.95, "PPO's GAE lambda")
    vf_coef: float = knob(0.5, "PPO's value-loss weight")
    vf_clip: float = knob(0.2, "PPO's value clip range")

    def __post_init__(self) -> None:
        _check_choices(self)
        _check_at_least(self, ("group_size", "max_new_tokens", "epochs"), 1,
                        "an integer >= 1", integer=True)
        if self.algo in ("grpo", "rloo") and self.group_size < 2:
            raise _refuse(self, "group_size", f"{self.algo} compares generations of the same "
                          "prompt, so it needs >= 2")
        if not (isinstance(self.temperature, numbers.Real) and math.isfinite(self.temperature)
                and self.temperature > 0):
            raise _refuse(self, "temperature", ": RL samples, so it must be a finite number > 0 "
                          "(greedy decoding has no log-probs to take a ratio of)")
        check_sampling_temperature(self.temperature, "AlgorithmConfig.temperature")
        _check_at_least(self, ("clip_eps", "clip_eps_high", "beta", "adv_eps", "entropy_coef",
                               "vf_coef", "vf_clip"), 0, "finite and >= 0")
        if self.tis_cap is not None and not (math.isfinite(self.tis_cap) and self.tis_cap >= 1):
            raise _refuse(self, "tis_cap", "must be finite and >= 1 (a cap below 1 down-weights "
                          "tokens the two policies agree on)")
        if self.tis_cap is not None and self.epochs != 1:
            raise _refuse(self, "tis_cap", f"needs epochs == 1, got epochs={self.epochs}: the "
                          "trainer's log-probs at the step's start come from the first epoch's "
                          "forward")
        if self.pg_loss != "cispo" and not 0.0 <= self.clip_eps < 1.0:
            raise _refuse(self, "clip_eps", "must be in [0, 1): the ratio's lower clip bound "
                          "1 - clip_eps must stay positive (pg_loss='cispo' alone accepts >= 1: "
                          "no lower bound on its weight)")
        if self.pg_loss != "ppo_clip" and self.tis_cap is not None:
            raise _refuse(self, "tis_cap", f"re-bases ppo_clip's token ratio on the trainer's "
                          f"own log-probs; pg_loss={self.pg_loss!r} (--pg-loss) defines its own "
                          "ratio: leave tis_cap None")

    @property
    def clip_high(self) -> float:
        """The ratio clip's upper eps (``clip_eps_high``, else ``clip_eps``: symmetric)."""
        return self.clip_eps if self.clip_eps_high is None else self.clip_eps_high


@dataclass(frozen=True)
class OptimizerConfig:
    """How a step's gradient becomes an update: optax's rule, its learning-rate schedule (counted
    in RL steps: each of the ``epochs`` updates of a step uses that step's rate), weight decay and
    the gradient clip.

    Why a group: these are tuned while a run goes (a rate lowered after a spike, a schedule
    stretched for a longer run), not what defines it, so ``--resume`` takes a change, warns
    naming it and records it in the checkpoint's lineage: the rate's schedule and the gradient
    clip are built from this config when the trainer is, and a restore keeps this config's weight
    decay (:func:`jaxrl_sym.rl.step.state.with_config_hyperparams`). The rule (``optimizer``) is
    the exception: its optimiser state has its own structure (Adam's two moments, Lion's one),
    which a checkpoint of another rule does not hold, so a resume refuses a change even with
    ``--resume-anyway`` (:mod:`jaxrl_sym.rl.run.identity`).

    lr / warmup_steps / lr_schedule / total_steps / min_lr_ratio: the rate is reached linearly
    over ``warmup_steps``, then held (``constant``) or decayed to ``min_lr_ratio * lr`` at
    ``total_steps`` (``cosine``, ``linear``; they need total_steps). optimizer / weight_decay:
    optax's ``adam`` (the default; no weight decay), ``adamw`` (decoupled decay, TRL's and verl's
    choice), ``sgd`` (decay as an L2 term), ``lion`` (one moment: half Adam's state) or
    ``adafactor`` (factored second moments: a fraction of it); ``weight_decay`` with ``adam`` is
    refused (an L2 term in its gradient is not a decay; ``adamw`` has one).
    """

    optimizer: str = knob("adam", "optax's rule: adam, adamw (decoupled weight decay), sgd, lion "
                          "or adafactor (lion, adafactor: less optimiser state)",
                          choices=OPTIMIZERS)
    lr: float = knob(3e-3, "learning rate (after warm-up)")
    weight_decay: float = knob(0.0, "decay rate (adamw, sgd, lion, adafactor; adam has none)")
    max_grad_norm: float | None = knob(1.0, "clip the gradients to this global norm before the "
                                       "update (none: no clip)")
    warmup_steps: int = knob(0, "linear learning-rate warm-up, in RL steps")
    lr_schedule: str = knob("constant", "after warm-up: constant, or decay (cosine, linear) to "
                            "--min-lr-ratio x lr at --total-steps", choices=LR_SCHEDULES)
    total_steps: int | None = knob(None, "the RL step a decaying schedule ends at; default: "
                                   "--steps")
    min_lr_ratio: float = knob(0.0, "a decaying schedule's final rate as a fraction of lr")

    def __post_init__(self) -> None:
        _check_choices(self)
        _check_at_least(self, ("lr", "weight_decay", "max_grad_norm"), 0, "finite and >= 0")
        _check_at_least(self, ("warmup_steps",), 0, "an integer >= 0", integer=True)
        _check_at_least(self, ("total_steps",), 1, "an integer >= 1", integer=True)
        if self.optimizer == "adam" and self.weight_decay:
            raise _refuse(self, "weight_decay", "with optimizer='adam': Adam has no weight decay "
                          "(an L2 term in its gradient is not one); use --optimizer adamw")
        if not (isinstance(self.min_lr_ratio, numbers.Real) and 0.0 <= self.min_lr_ratio <= 1.0):
            raise _refuse(self, "min_lr_ratio", "must be in [0, 1]")
        if self.lr_schedule != "constant" and (self.total_steps is None
                                               or self.total_steps <= self.warmup_steps):
            raise _refuse(self, "lr_schedule", f"decays until total_steps, which must be set and "
                          f"> warmup_steps ({self.warmup_steps}); got total_steps="
                          f"{self.total_steps}")


@dataclass(frozen=True)
class ExecutionConfig:
    """How a step is computed, not what: micro-batches of the update, log-prob chunks,
    recomputation in the backward, the reference pass's overlap with generation, the packed
    layout's rows.

    Why a group: the update is the same up to float rounding whatever these are (their
    equivalence is tested: test_rl_step, test_remat, test_chunked_logprobs, test_shared_prefix),
    so they are not part of the run's identity. ``--resume`` takes a change — a run that ran out
    of memory resumes with a smaller ``--update-tokens`` without ``--resume-anyway`` — and says
    what changed.

    update_tokens: bounds the update's peak memory — at Qwen2.5's 151,936-word vocabulary the
      logits alone take 0.6 MB per token in fp32. Gradients accumulate over the micro-batches:
      one optimiser update per epoch, the same as the whole batch at once. On sym (a system
      with ``fixed_micro_batches``) every micro-batch has the same rows for a row length, the
      last completed with empty rows, so the programs compile once per row length; unset,
      sym uses :data:`DEFAULT_UPDATE_TOKENS` and padded runs the whole batch at once.
    logprob_chunk: the model's head is applied to the final hidden states one chunk at a time
      (:mod:`jaxrl_sym.rl.step.logprobs`), so the update's peak no longer grows with tokens x
      vocab. Needs a model with the contract's optional ``features``/``head`` split; without it
      the step runs unchunked and its ``logprob_chunking`` stat says why. A batch of at most
      this many slots runs unchunked too. The default, 256, is chosen for what a GPU pays: the
      chunk's backward holds about three ``[chunk x vocab]`` fp32 buffers, 1.8 GB at 1024 slots
      of Qwen2.5's vocabulary and 0.45 GB at 256 (``bench/results/cpu/design_notes.md``), while
      the head's flops are the same at any chunk. On a CPU a smaller chunk is slower
      (``bench/results/logprob_memory.md``): set 1024 there if time matters more than memory.
    remat: gradient checkpointing between attention calls (:mod:`jaxrl_sym.rl.step.remat`;
      every system). On by default for what a GPU pays: at the GPU preset's micro-batch it
      removes most of the update's per-layer temporaries for about a quarter more update flops
      (``bench/results/projection.md``).
    overlap_reference: None (auto) overlaps on an accelerator only — on a CPU the scoring
      competes with decoding for the same cores (``RLTrainer.overlaps_reference``).
    share_prompts: the sym runtime packs a GRPO group's samples behind one copy of their prompt
      per row (:func:`jaxrl_sym.systems.layout.shared_prefix_layout`): each prompt token is
      computed once per row instead of G times, the same numbers (each response sees the same
      keys at the same positions), about a third fewer token slots on the step benchmark's
      workload (``bench/results/cpu/design_notes.md``).
    """

    update_tokens: int | None = knob(None, "token slots per training micro-batch (gradients "
                                     "accumulate over micro-batches: less memory, the same "
                                     f"update; none: sym {DEFAULT_UPDATE_TOKENS}, padded "
                                     "the whole batch at once)", metavar="N")
    logprob_chunk: int | None = knob(256, "token slots whose logits exist at once in the "
                                     "reference, value and loss programs (none: unchunked)",
                                     metavar="N")
    remat: bool = knob(True, "recompute each layer's activations in the update's backward "
                       "instead of keeping them (--no-remat: faster, more memory)")
    overlap_reference: bool | None = knob(None, "sym: score finished rows with the reference "
                                          "model while the rest still generate; default: on "
                                          "an accelerator, off on a CPU")
    pack_row_len: int | None = knob(None, "row length of the packed training layout; default: "
                                    "at least 64 and the longest sequence, rounded to a length "
                                    "bucket", metavar="N")
    share_prompts: bool = knob(True, "sym's training rows hold a group's prompt once, its G "
                               "responses attending to it (--no-share-prompts packs every "
                               "sample whole)")

    def __post_init__(self) -> None:
        _check_at_least(self, ("update_tokens", "logprob_chunk", "pack_row_len"), 1,
                        "an integer >= 1 or None", integer=True)
        for name in ("remat", "share_prompts", "overlap_reference"):
            v = getattr(self, name)
            if not (isinstance(v, bool) or (v is None and name == "overlap_reference")):
                raise _refuse(self, name, "must be True or False")
