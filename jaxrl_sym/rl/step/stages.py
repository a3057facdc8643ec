"""The stages of one RL step, as functions of a :class:`~jaxrl_sym.rl.step.state.TrainState`.

generation → pack → reference log-probs → rewards → advantages / loss arrays → update;
:func:`run_step` composes them.

Each stage takes the :class:`~jaxrl_sym.rl.step.context.StepContext` (the fixed machinery: config,
bound system, compiled programs, reward function) and the state it should read, and returns
data — the update returns a *new* state. None of them assigns to anything: the trainer's
``commit`` alone stores the state a step returns, which is what makes a failed step (a reward
function that raises, a non-finite gradient) leave the trainer exactly as it was.

Why functions and not trainer methods: the order and the data passed between stages is then
visible in one short composition (:func:`run_step`), and a stage can be run or tested on its own
with any state — e.g. scoring a rollout against the current parameters without updating them.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_sym.errors import InputError
from jaxrl_sym.rl.algorithms.advantages import (
    gae,
    informative_samples,
    sample_advantages,
    token_weights,
    whiten,
)
from jaxrl_sym.rl.algorithms.losses import merge_aux
from jaxrl_sym.rl.errors import RewardError
from jaxrl_sym.rl.knobs import AlgorithmConfig, ExecutionConfig
from jaxrl_sym.rl.step.context import RolloutSource, StepContext, rows_per_chunk
from jaxrl_sym.rl.step.rollout import Drawn, Rollout, compute_rewards, sampling_batch
from jaxrl_sym.rl.step.state import TrainState, current_lr
from jaxrl_sym.rl.step.stopwatch import OnStage, Stopwatch
from jaxrl_sym.runtime.metrics import (
    CompileCounter,
    device_peak_bytes,
    tree_bytes,
    trim_host_heap,
)
from jaxrl_sym.sharding import to_host
from jaxrl_sym.systems.layout import Layout

Arrays = dict[str, np.ndarray]


class DivergedError(InputError):
    """The update produced a non-finite loss or gradient (the step was not committed).

    ``state``: the trainer's state as it was before the step, in the buffers that now hold it
    (the update programs took the old ones as donated arguments); the trainer commits it."""

    def __init__(self, message: str, step: int, state: TrainState | None = None) -> None:
        super().__init__(message)
        self.step = step
        self.state = state


# ---------------------------------------------------------------------- batching
def row_chunks(cfg: ExecutionConfig, layout: Layout, multiple: int = 1) -> list[slice]:
    """The row slices every whole-batch forward runs (:func:`rows_per_chunk` rows each), up to
    the last row holding a sample: a slice of empty rows only adds nothing (a layout fitted
    to its micro-batches has none; one laid out for another budget may)."""
    rows, width = layout.shape
    fixed = layout.system is not None and layout.system.fixed_micro_batches
    per = rows_per_chunk(cfg, width, multiple, fixed=fixed) or rows
    return [slice(i, i + per) for i in range(0, layout.filled_rows, per)]


def micro_batches(cfg: ExecutionConfig, layout: Layout, arrays: Arrays, multiple: int = 1
                  ) -> list[tuple[tuple[np.ndarray, ...], Arrays]]:
    """Row slices of the training batch of at most ``update_tokens`` slots each (one slice
    when unset; on sym, :data:`~jaxrl_sym.rl.knobs.DEFAULT_UPDATE_TOKENS` then). Rows are never
    split: a packed row's sequences attend within the row."""
    return [(tuple(x[sl] for x in layout.inputs), {k: v[sl] for k, v in arrays.items()})
            for sl in row_chunks(cfg, layout, multiple)]


# ---------------------------------------------------------------------- stages
def generate(ctx: StepContext, state: TrainState, prompts: Sequence[np.ndarray | Sequence[int]],
             seed: int, limits: Sequence[int] | None = None) -> Rollout:
    """G samples per prompt at the sampling temperature, with their sampling log-probs; on a
    system that can, the reference log-probs too (scored while generation ran)."""
    expanded, gcfg = sampling_batch(ctx.sampling, prompts, seed, limits, ctx.vocab_size)
    if state.ref is not None and ctx.overlaps_reference:
        name = ctx.system.name
        ref_fn = ctx.fns(ctx.system.system)["ref"]  # the bound system's own programs

        def score(lay: Layout) -> Any:
            lay = ctx.system.pad_rows(lay, ctx.row_multiple)  # ReferenceOverlap reads spans
            return ctx.programs.run(f"ref-{name}", ref_fn, state.ref, lay.inputs, lay.targets,
                                    resident=tree_bytes(state.params) + state.resident_bytes())

        def ahead(lay: Layout) -> None:  # the program ``score`` will run at this chunk's shape
            lay = ctx.system.pad_rows(lay, ctx.row_multiple)
            ctx.programs.prefetch(f"ref-{name}", ref_fn, state.ref, lay.inputs, lay.targets)

        res, overlap = ctx.system.generate_scoring(expanded, gcfg, score,
                                                   row_len=ctx.cfg.execution.pack_row_len,
                                                   rows_per_chunk=ctx.rows_per_chunk,
                                                   ahead=ahead)
    else:
        res, overlap = ctx.system.generate(expanded, gcfg), None
    stats = dict(res.stats)
    ref = None
    if overlap is not None:
        t = time.perf_counter()
        ref = overlap.collect(len(expanded), res.tokens)
        stats["ref_collect_seconds"] = time.perf_counter() - t
        stats["ref_chunks"] = overlap.chunks
        stats["ref_overlapped_samples"] = overlap.overlapped_samples
    return Rollout(expanded, list(res.tokens), list(res.logprobs), ctx.sampling.group_size,
                   stats, ref)


@dataclass(frozen=True)
class Fresh:
    """The plain rollout source: G samples of each of ``prompts`` (``limits``: optional
    response limits, one per prompt or one per sample), carrying nothing into the next step."""

    prompts: Sequence[np.ndarray | Sequence[int]]
    seed: int
    limits: Sequence[int] | None = None

    def draw(self, ctx: StepContext, state: TrainState) -> Drawn:
        return Drawn(generate(ctx, state, self.prompts, self.seed, self.limits))


def reference_logprobs(ctx: StepContext, state: TrainState, layout: Layout) -> np.ndarray:
    """[rows, L] reference log-probs at the response-predicting slots (0 without a reference)."""
    if state.ref is None:
        return np.zeros(layout.shape, np.float32)
    fn = ctx.fns(layout.system)["ref"]
    out = np.zeros(layout.shape, np.float32)  # rows no chunk holds are empty
    for sl in row_chunks(ctx.cfg.execution, layout, ctx.row_multiple):
        out[sl] = to_host(ctx.programs.run(
            f"ref-{layout.system.name}", fn, state.ref, tuple(x[sl] for x in layout.inputs),
            layout.targets[sl], resident=tree_bytes(state.params) + state.resident_bytes()))
    return out


def reference_slots(ctx: StepContext, state: TrainState, layout: Layout, rollout: Rollout
                    ) -> np.ndarray:
    """The step's reference stage: scatter what generation already scored, else one pass."""
    if rollout.ref_logprobs is not None:  # scored during generation: only the read-back
        return layout.scatter(rollout.ref_logprobs)
    return reference_logprobs(ctx, state, layout)


def rewards(ctx: StepContext, rollout: Rollout) -> tuple[np.ndarray, np.ndarray | None]:
    """The optimised reward per sample, and the reported-only metric (None without one)."""
    r = compute_rewards(ctx.reward_fn, rollout.prompts, rollout.responses)
    metric = (compute_rewards(ctx.metric_fn, rollout.prompts, rollout.responses,
                              what="metric function")
              if ctx.metric_fn is not None else None)
    return r, metric


def value_estimates(ctx: StepContext, state: TrainState, layout: Layout) -> np.ndarray:
    """[rows, L] PPO value estimates of the state's policy (before the update)."""
    fn = ctx.fns(layout.system)["values"]
    out = np.zeros(layout.shape, np.float32)  # rows no chunk holds are empty
    for sl in row_chunks(ctx.cfg.execution, layout, ctx.row_multiple):
        out[sl] = to_host(ctx.programs.run(
            f"values-{layout.system.name}", fn, state.params, state.frozen,
            tuple(x[sl] for x in layout.inputs), resident=state.resident_bytes()))
    return out


def loss_arrays(cfg: AlgorithmConfig, layout: Layout, rollout: Rollout, rewards: np.ndarray,
                ref_slots: np.ndarray, value_slots: np.ndarray | None = None) -> Arrays:
    """Everything the loss needs, scattered to the layout's response-predicting slots.

    Per-sample advantages and the informative-group flags are also returned (``sample_adv``,
    ``informative``; not scattered), for the step's metrics.
    """
    lengths = [len(r) for r in rollout.responses]
    informative = (informative_samples(rewards, rollout.group_size) if rollout.group_size > 1
                   else np.ones(len(lengths), bool))
    keep = informative if (cfg.drop_zero_var and cfg.algo != "ppo") else None
    arrays = {
        "targets": layout.targets,
        "mask": layout.mask(),
        "weight": layout.scatter(token_weights(lengths, cfg.loss_agg, cfg.max_new_tokens, keep)),
        "old_lp": layout.scatter(rollout.old_logprobs),
        "ref_lp": ref_slots.astype(np.float32),
    }
    if cfg.algo == "ppo":
        if value_slots is None:
            raise InputError("PPO needs value estimates: pass value_slots")
        vals = layout.gather(value_slots)
        token_rewards = []
        for n, r in zip(lengths, rewards, strict=True):
            tr = np.zeros(n, np.float32)
            tr[-1] = r  # outcome reward arrives with the last token
            token_rewards.append(tr)
        advs, rets = gae(token_rewards, vals, cfg.gamma, cfg.lam)
        if cfg.adv_norm != "none":  # zero-mean unit-std over the batch's tokens
            advs = whiten(advs)
        arrays["adv"] = layout.scatter(advs)
        arrays["returns"] = layout.scatter(rets)
        arrays["old_values"] = value_slots.astype(np.float32)
        sample_adv = np.array([float(np.mean(a)) for a in advs], np.float32)
        for name in ("adv", "returns"):
            if not np.all(np.isfinite(arrays[name])):
                i = int(np.argmax(np.abs(rewards)))
                raise RewardError(
                    f"rewards of this batch reach {rewards[i]:g} (sample {i}): PPO's {name} "
                    "overflow float32; scale the reward function's output into a moderate "
                    "range (|r| <= 1e6 is plenty). The step was not applied.", i)
    else:
        sample_adv = sample_advantages(rewards, rollout.group_size, cfg.algo, cfg.adv_eps,
                                       cfg.adv_norm)
        arrays["adv"] = layout.scatter(sample_adv)
    return arrays, {"sample_adv": sample_adv, "informative": informative}


def advantages(ctx: StepContext, state: TrainState, layout: Layout, rollout: Rollout,
               rewards: np.ndarray, ref_slots: np.ndarray) -> tuple[Arrays, Arrays]:
    """The step's advantage stage: value estimates (PPO), the loss arrays and the per-sample
    advantage / informative-group arrays the metrics report."""
    vals = value_estimates(ctx, state, layout) if ctx.cfg.algorithm.algo == "ppo" else None
    return loss_arrays(ctx.cfg.algorithm, layout, rollout, rewards, ref_slots, vals)


def update_once(ctx: StepContext, params: Any, opt_state: Any, state: TrainState,
                layout: Layout, arrays: Arrays) -> tuple[Any, Any, dict[str, float]]:
    """One optimiser update from the whole batch: fused loss-grad-update when it is one
    micro-batch, else gradients summed over micro-batches, then one optax update.

    Consumes ``params`` and ``opt_state``: the update programs take them as donated buffers
    (use the returned ones; a non-finite update returns their values unchanged). ``state``
    gives what the update reads but never changes: the reference and LoRA's frozen base."""
    fns, sys_ = ctx.fns(layout.system), layout.system.name
    frozen = state.frozen
    resident = state.resident_bytes() - tree_bytes(state.opt_state)
    chunks = micro_batches(ctx.cfg.execution, layout, arrays, ctx.row_multiple)
    if len(chunks) == 1:
        params, opt_state, aux = ctx.programs.run(
            f"update-{sys_}", fns["update"], params, opt_state, frozen, *chunks[0],
            resident=resident)
        return params, opt_state, {k: float(v) for k, v in jax.device_get(aux).items()}
    grads, parts = None, []
    held = resident + tree_bytes(opt_state)
    for inputs, arr in chunks:
        if grads is None:
            (_, aux), grads = ctx.programs.run(f"grad-{sys_}", fns["grad"], params, frozen,
                                               inputs, arr, resident=held)
        else:  # the running sum is donated to the program that adds this micro-batch to it
            (_, aux), grads = ctx.programs.run(f"accumulate-{sys_}", fns["accumulate"], params,
                                               grads, frozen, inputs, arr, resident=held)
        parts.append(aux)
    merged = merge_aux([{k: float(v) for k, v in jax.device_get(a).items()} for a in parts])
    if _nonfinite(merged):  # the state was not donated yet: leave it as it is
        return params, opt_state, {**merged, "grad_norm": math.nan}
    params, opt_state, gnorm, _ = ctx.programs.run(  # the clipped gradients: dropped
        f"apply-{sys_}", fns["apply"], params, opt_state, grads, resident=resident)
    return params, opt_state, {**merged, "grad_norm": float(gnorm)}


def update(ctx: StepContext, state: TrainState, layout: Layout, arrays: Arrays
           ) -> tuple[TrainState, list[dict[str, float]]]:
    """``cfg.algorithm.epochs`` updates over the batch; the state after this step and each
    epoch's aux.

    Raises before returning anything when the last epoch's loss or gradients are non-finite, so
    a diverged update is never committed.
    """
    params, opt_state = state.params, state.opt_state
    # the update programs take the state as donated buffers; with several epochs a diverged
    # later epoch must give back the state from before the first, so that one is kept
    before = (_copy(params), _copy(opt_state)) if ctx.cfg.algorithm.epochs > 1 else None
    auxes = []
    for _ in range(ctx.cfg.algorithm.epochs):
        params, opt_state, aux = update_once(ctx, params, opt_state, state, layout, arrays)
        auxes.append(aux)
        if bad := _nonfinite(aux):
            # the guarded programs returned the state's values unchanged in fresh buffers
            kept = before or (params, opt_state)
            raise DivergedError(f"non-finite {', '.join(bad)} in the update of step "
                                f"{state.step + 1}; the step was not applied. Lower the "
                                "learning rate or check rewards.", state.step + 1,
                                state=state.replace(params=kept[0], opt_state=kept[1]))
    return state.replace(params=params, opt_state=opt_state, step=state.step + 1), auxes


def _update_without_forward_copy(ctx: StepContext, state: TrainState, layout: Layout,
                                 arrays: Arrays) -> tuple[TrainState, list[dict[str, float]]]:
    """:func:`update`, with the bound systems' copy of the forward's weights (bf16 cast, LoRA
    adapters) released first (:meth:`Forwards.release_params`): the update never reads it and the
    commit replaces it, so holding it would only add a model's weights to the update's peak.
    If the update raises, the systems get the state's forward weights back (a diverged update
    hands back its state, which the trainer commits)."""
    trim_host_heap()  # generation's freed stores leave RSS before the update's peak
    released = ctx.forwards.release_params(ctx.cfg)
    try:
        return update(ctx, state, layout, arrays)
    except DivergedError:
        raise  # the trainer commits the state it carries: set_params follows
    except BaseException:
        if released and not any(x.is_deleted() for x in jax.tree_util.tree_leaves(state.params)):
            ctx.forwards.set_params(ctx.forwards.forward_leaves(state))
        raise


def _nonfinite(aux: dict[str, float]) -> list[str]:
    return sorted(k for k, v in aux.items() if not math.isfinite(v))


def _copy(tree: Any) -> Any:
    return jax.tree_util.tree_map(jnp.copy, tree)


# ---------------------------------------------------------------------- report
def peak_bytes(ctx: StepContext, state: TrainState, rollout: Rollout) -> int:
    """The device's own peak where it reports one, else the larger of generation's accounted
    peak (plus the resident state) and the largest program's."""
    gen_peak = int(rollout.stats.get("accounted_peak_bytes",
                                     rollout.stats.get("accounted_bytes", 0)))
    dev_peak = device_peak_bytes()
    return int(dev_peak if dev_peak is not None else max(gen_peak + state.resident_bytes(),
                                                          ctx.programs.peak))


def signals(state: TrainState, rollout: Rollout, rewards: np.ndarray, per_sample: Arrays,
            auxes: list[dict[str, float]]) -> dict[str, Any]:
    """The step's training signals (see README "Training signals"): the loss-side ones from the
    first epoch's aux (ratios are exactly 1 there; ``clip_frac`` / ``ratio_*`` / ``kl_old``
    from the last epoch, where the policy has moved), the sample-side ones from the rollout.
    ``state`` is the committed one (``step`` counts it, ``lr`` is the rate its update used)."""
    aux_h, last_aux = auxes[0], auxes[-1]
    adv, informative = per_sample["sample_adv"], per_sample["informative"]
    return {
        "step": state.step,
        "reward": float(rewards.mean()),
        "reward_std": float(rewards.std()),
        # k3 estimate of KL(policy || reference) over response tokens; None without a
        # reference pass (beta = 0), where there is nothing to compare against
        "kl": aux_h["kl"] if state.ref is not None else None,
        "kl_old": last_aux["kl_old"],
        "loss": aux_h["loss"],
        "clip_frac": last_aux["clip_frac"],
        "clip_low_frac": last_aux["clip_low_frac"],
        "clip_high_frac": last_aux["clip_high_frac"],
        "ratio_mean": last_aux["ratio_mean"],
        "ratio_min": last_aux["ratio_min"],
        "ratio_max": last_aux["ratio_max"],
        "entropy": aux_h["entropy"],
        # rollout/trainer mismatch: |generation log-prob - trainer log-prob| per response token
        # at the weights that sampled, and the share of tokens whose ratio leaves [0.8, 1.25]
        "logprob_mismatch_mean": aux_h["lp_mismatch_mean"],
        "logprob_mismatch_max": aux_h["lp_mismatch_max"],
        "mismatch_ratio_outside": aux_h["ratio_outside"],
        "grad_norm": aux_h["grad_norm"],
        "lr": current_lr(state.opt_state),
        "adv_mean": float(adv.mean()),
        "adv_std": float(adv.std()),
        # groups whose G rewards were all equal: no preference, no policy gradient
        "zero_var_frac": float(1.0 - informative.mean()),
    }


def metrics(ctx: StepContext, state: TrainState, rollout: Rollout, layout: Layout,
            rewards: np.ndarray, metric: np.ndarray | None, per_sample: Arrays,
            auxes: list[dict[str, float]], sec: dict[str, float], cc: CompileCounter
            ) -> dict[str, Any]:
    """The step's metrics: its :func:`signals`, then what it generated and what it cost."""
    lengths = [len(r) for r in rollout.responses]
    useful = rollout.useful_tokens
    out: dict[str, Any] = {
        **signals(state, rollout, rewards, per_sample, auxes),
        "response_len": float(np.mean(lengths)),
        "response_len_max": int(max(lengths)),
        "samples": len(lengths),
        "generated_tokens": int(sum(lengths)),
        "responses_sha256": rollout.responses_sha256,  # same prompts + seed: same on every system
        "useful_tokens": useful,
        "useful_tokens_per_s": useful / sec["total"],
        "padding_fraction": layout.padding_fraction,
        "layout_shape": list(layout.shape),
        "peak_bytes": peak_bytes(ctx, state, rollout),
        # generation's own accounted bytes this step (stores, caches, its programs' temporaries):
        # unlike peak_bytes on a CPU (the largest program so far), it follows this step's lengths
        "generation_peak_bytes": int(rollout.stats.get("accounted_peak_bytes",
                                                       rollout.stats.get("accounted_bytes", 0))),
        # "on: N token slots per chunk", or "off: <why>" (ExecutionConfig.logprob_chunk, the model)
        "logprob_chunking": ctx.fns(layout.system)["logprob_chunking"],
        "compiles": cc.count,
        "compile_seconds": cc.seconds,
        # generation's own split (the padded baseline compiles its program on every call)
        "generation_run_seconds": float(rollout.stats.get("run_seconds", sec["generation"])),
        "generation_compile_seconds": float(rollout.stats.get("compile_seconds", 0.0)),
        # reference chunks dispatched while generation still ran (0: a separate pass)
        "reference_chunks_during_generation": int(rollout.stats.get("ref_chunks", 0)),
        "seconds": sec,
    }
    if metric is not None:
        out["exact_match"] = float(metric.mean())
    if "acceptance_rate" in rollout.stats:  # speculative rollouts: drafts the policy kept
        out.update({k: rollout.stats[k] for k in ("acceptance_rate", "drafted_tokens",
                                                  "accepted_tokens", "verify_steps")})
    if "v_loss" in auxes[0]:
        out["v_loss"] = auxes[0]["v_loss"]
    return out


# ---------------------------------------------------------------------- the step
@dataclass(frozen=True)
class StepOutcome:
    """A step that succeeded, not yet committed: the new state, the step's metrics and the rows
    its rollout source carries into the next step (None: nothing carried)."""

    state: TrainState
    metrics: dict[str, Any]
    carried: Any = None


def run_step(ctx: StepContext, state: TrainState, rollout_source: RolloutSource,
             on_stage: OnStage | None = None) -> StepOutcome:
    """One RL step from ``state``: draw a rollout from ``rollout_source`` (fresh prompts, or
    partial rollouts), then pack → reference → reward → advantages → update, each timed.

    Changes nothing it was given: the caller commits the returned state (and carried rows);
    a stage that raises leaves the trainer as it was. Stages are timed separately (``seconds``);
    compile time lands in whichever stage first needed a program of that shape (``compiles``
    counts XLA compiles in the step). ``on_stage`` hears each stage start and end.
    """
    ctx.programs.peak = 0
    clock = Stopwatch(on_stage)
    with CompileCounter() as cc:
        with clock("generation"):
            drawn = rollout_source.draw(ctx, state)
            clock.tokens = sum(len(r) for r in drawn.rollout.responses)
        rollout = drawn.rollout
        with clock("pack"):
            layout = ctx.layout(rollout)
        with clock("reference"):
            ref = reference_slots(ctx, state, layout, rollout)
        # reading back overlapped reference chunks is reference work, not generation
        clock.move(rollout.stats.get("ref_collect_seconds", 0.0), "generation", "reference")
        with clock("reward"):
            rew, metric = rewards(ctx, rollout)
        with clock("advantage"):
            arrays, per_sample = advantages(ctx, state, layout, rollout, rew, ref)
        with clock("update"):
            new_state, auxes = _update_without_forward_copy(ctx, state, layout, arrays)
    sec = clock.sec
    sec["total"] = sum(sec.values())
    out = metrics(ctx, new_state, rollout, layout, rew, metric, per_sample, auxes, sec, cc)
    out["peak_bytes_after_stage"] = clock.peaks
    out["peak_source"] = clock.peak_source
    return StepOutcome(new_state, {**out, **drawn.report}, drawn.carried)
