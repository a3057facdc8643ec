"""One RL step on the symbolic runtime vs the padded baseline, and its failure modes.

The trainer and one rollout are built once (tracing + compiling dominate on a CPU); the tests then
score that same rollout on both layouts, so "same sampled tokens" holds by construction.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from functools import cache

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_sym.errors import InputError
from jaxrl_sym.models.lm import init_model, preset
from jaxrl_sym.rl import (
    RewardError,
    RLConfig,
    RLTrainer,
    Rollout,
    compute_rewards,
    get_task,
)
from jaxrl_sym.rl.step import stages
from jaxrl_sym.rl.tasks.token_tasks import EOS, VOCAB_SIZE

TASK = get_task("reverse", max_digits=3)
MODEL = preset("tiny", vocab_size=VOCAB_SIZE)
# overlap on (auto turns it off on a CPU): the overlapped reference must equal a separate pass
CFG = RLConfig.of(algo="grpo", group_size=4, beta=0.1, epochs=2, eos_id=EOS,
                  max_new_tokens=TASK.max_new_tokens, lr=1e-2, overlap_reference=True)
SEED = 3


@cache
def setup() -> tuple[RLTrainer, list[np.ndarray], Rollout, np.ndarray]:
    trainer = RLTrainer(init_model(MODEL, 0), TASK.reward, CFG, metric_fn=TASK.exact_match)
    prompts = TASK.sample(np.random.default_rng(0), 6)
    rollout = trainer.generate(prompts, seed=SEED)
    rewards = compute_rewards(TASK.reward, rollout.prompts, rollout.responses)
    return trainer, prompts, rollout, rewards


def test_rollout_shape_and_old_logprobs_are_the_policy_logprobs() -> None:
    trainer, prompts, rollout, _ = setup()
    g = CFG.algorithm.group_size
    assert len(rollout.responses) == len(prompts) * g
    for i, r in enumerate(rollout.responses):
        assert np.array_equal(rollout.prompts[i], prompts[i // g])
        assert 1 <= len(r) <= CFG.algorithm.max_new_tokens
        assert len(rollout.old_logprobs[i]) == len(r)
        assert EOS not in r[:-1]  # a row stops at its first EOS
    # Before any update the reference *is* the policy, so the reference pass over the packed
    # layout must reproduce the log-probs generation reported: no need to recompute them.
    for system in ("sym", "padded"):
        lay = trainer.layout(rollout, system)
        ref = lay.gather(stages.reference_logprobs(trainer.context, trainer.state, lay))
        for a, b in zip(ref, rollout.old_logprobs, strict=True):
            np.testing.assert_allclose(a, b, atol=1e-4)


def test_reference_scored_during_generation_equals_a_separate_pass() -> None:
    trainer, _, rollout, _ = setup()
    # beta > 0 on sym: finished rows were scored as they finished (chunks dispatched from the
    # engine's on_finished hook). This task's responses (<= 5 tokens) all end inside the first
    # full 8-step decode tile, so one chunk may hold them all.
    assert rollout.ref_logprobs is not None
    assert rollout.stats["ref_chunks"] >= 1 and rollout.stats["ref_overlapped_samples"] > 0
    lay = trainer.layout(rollout, "sym")
    after = lay.gather(stages.reference_logprobs(trainer.context, trainer.state, lay))
    for a, b, r in zip(rollout.ref_logprobs, after, rollout.responses, strict=True):
        assert len(a) == len(r)
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
    # the switch off gives the separate pass; auto (None) is off on a CPU, where scoring during
    # generation only competes with decoding for the same cores
    for value in (False, None):
        off = RLTrainer(init_model(MODEL, 0), TASK.reward, CFG.replace(overlap_reference=value))
        assert jax.devices()[0].platform != "cpu" or not off.overlaps_reference
        if not off.overlaps_reference:
            assert off.generate(setup()[1], seed=SEED).ref_logprobs is None


def _compare(trainer: RLTrainer, rollout: Rollout, rewards: np.ndarray) -> dict[str, float]:
    loss_s, aux_s, g_s = trainer.loss_and_grads(rollout, rewards, "sym")
    loss_p, aux_p, g_p = trainer.loss_and_grads(rollout, rewards, "padded")
    assert loss_s == pytest.approx(loss_p, abs=1e-5)
    # every training signal the loss reports is the same number on both layouts
    assert set(aux_s) == set(aux_p)
    for key in aux_s:
        assert aux_s[key] == pytest.approx(aux_p[key], abs=1e-5), key
    leaves_s = jax.tree_util.tree_leaves(g_s)
    leaves_p = jax.tree_util.tree_leaves(g_p)
    assert len(leaves_s) == len(leaves_p)
    assert max(float(np.abs(np.asarray(a)).max()) for a in leaves_s) > 1e-4  # not vacuous
    for a, b in zip(leaves_s, leaves_p, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)
    return aux_s


def test_sym_and_padded_loss_and_grads_match_grpo_with_kl() -> None:
    trainer, _, rollout, rewards = setup()
    # move the policy off the reference so the KL term and its gradient are non-zero
    saved = trainer.params
    trainer.params = jax.tree_util.tree_map(lambda x: x * 1.05, saved)
    try:
        _compare(trainer, rollout, rewards)
        assert trainer.loss_and_grads(rollout, rewards, "sym")[1]["kl"] > 1e-6
    finally:
        trainer.params = saved


# Each stabiliser changes which slots the loss weighs or how much: the packed and padded layouts
# must still give the same loss, signals and gradients (token-level aggregation included).
KNOBS = {
    "token_mean+clip_high+drop_zero_var+entropy": dict(
        loss_agg="token_mean", clip_eps=0.1, clip_eps_high=0.3, drop_zero_var=True,
        entropy_coef=0.02),
    "token_sum+adv_none": dict(loss_agg="token_sum", adv_norm="none", entropy_coef=0.01),
    "seq_mean+batch_std+drop_zero_var": dict(loss_agg="seq_mean", adv_norm="batch_std",
                                            drop_zero_var=True, clip_eps=0.05),
}


@pytest.mark.parametrize("name", sorted(KNOBS))
def test_sym_and_padded_agree_with_each_stabiliser(name: str) -> None:
    _, _, rollout, rewards = setup()
    trainer = RLTrainer(init_model(MODEL, 0), TASK.reward, CFG.replace(**KNOBS[name]))
    # off the sampling policy, so ratios leave 1 and both clip bounds can bind
    trainer.params = jax.tree_util.tree_map(lambda x: x * 1.05, trainer.params)
    aux = _compare(trainer, rollout, rewards)
    assert aux["ratio_min"] < 1.0 < aux["ratio_max"]
    if KNOBS[name].get("clip_eps", 0.2) <= 0.1:
        assert aux["clip_frac"] > 0  # the clip is exercised, not vacuous
        assert aux["clip_frac"] == pytest.approx(aux["clip_low_frac"] + aux["clip_high_frac"])


def test_sym_and_padded_loss_and_grads_match_ppo() -> None:
    _, _, rollout, rewards = setup()
    ppo = RLTrainer(init_model(MODEL, 0), TASK.reward,
                    CFG.replace(algo="ppo", beta=0.0), system="padded")
    # a non-zero value head, so values enter GAE and the value loss
    ppo.params["value"]["w"] = ppo.params["value"]["w"] + 0.01 * np.arange(VOCAB_SIZE) / VOCAB_SIZE
    _compare(ppo, rollout, rewards)


def test_bad_rewards_do_not_apply_the_step() -> None:
    trainer, prompts, _, _ = setup()
    sha, done = trainer.params_sha256(), trainer.steps_done

    def raises(p, r):
        if len(r) == len(setup()[2].responses[5]) and np.array_equal(r, setup()[2].responses[5]):
            raise KeyError("no answer")
        return 0.0

    cases = [
        (raises, r"raised on sample 5 .*KeyError"),
        (lambda p, r: np.ones(3), r"shape \(3,\) .*sample 0"),
        (lambda p, r: float("nan") if len(r) == len(setup()[2].responses[2]) else 0.0,
         r"returned nan on sample 2"),
        # finite but overflowing: the group std became inf and every advantage 0 (issue 29)
        (lambda p, r: 1e308 if len(r) % 2 else -1e308, r"rewards of this batch reach .*scale"),
    ]
    old = trainer.reward_fn
    try:
        for fn, msg in cases:
            trainer.reward_fn = fn
            with pytest.raises(RewardError, match=msg):
                trainer.step(prompts, seed=SEED)  # same seed: the same samples as setup()
            assert trainer.params_sha256() == sha and trainer.steps_done == done
    finally:
        trainer.reward_fn = old


def test_empty_prompt_is_rejected_before_generation() -> None:
    trainer, prompts, _, _ = setup()
    with pytest.raises(InputError, match="prompt 1 is empty"):
        trainer.step([prompts[0], np.zeros(0, np.int32)], seed=0)
    with pytest.raises(InputError, match="no prompts"):
        trainer.step([], seed=0)


def test_step_updates_policy_and_runtime_weights() -> None:
    trainer, prompts, _, _ = setup()
    before = trainer.params_sha256()
    m = trainer.step(prompts, seed=SEED + 1)
    assert trainer.params_sha256() != before and trainer.steps_done == 1
    assert trainer.engine.leaves[0] is trainer.params["lm"][0]  # set_params, no re-trace
    for key in ("reward", "exact_match", "kl", "useful_tokens_per_s", "padding_fraction",
                "peak_bytes"):
        assert np.isfinite(m[key]), key
    assert set(m["seconds"]) >= {"generation", "reference", "reward", "update"}
    assert m["peak_bytes"] > 0 and 0 <= m["padding_fraction"] < 1
    # per-stage peaks, every stage: on a CPU this process's peak RSS (getrusage, read here
    # independently), non-decreasing in stage order and never above the peak read afterwards
    peaks = m["peak_bytes_after_stage"]
    assert list(peaks) == [k for k in m["seconds"] if k != "total"]
    if m["peak_source"] == "host_rss":
        import resource
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        assert list(peaks.values()) == sorted(peaks.values()) and 0 < max(peaks.values()) <= after


def _copy(tree):
    return jax.tree_util.tree_map(jnp.copy, tree)


def test_micro_batched_update_equals_whole_batch() -> None:
    trainer, _, rollout, rewards = setup()
    layout, arrays = trainer.prepare(rollout, rewards, "sym")
    # the rows holding samples (the layout's others complete its micro-batch: empty rows)
    rows, width = layout.filled_rows, layout.shape[1]
    base = trainer.cfg
    try:
        trainer.cfg = base.replace(update_tokens=None)
        # update_once consumes the state it is given (donated buffers): each call gets a copy
        p1, _, aux1 = stages.update_once(trainer.context, *_copy((trainer.params,
                                                                  trainer.opt_state)),
                                         trainer.state, layout, arrays)
        assert rows >= 2, "the rollout must pack into several rows to split them"
        per = max(1, rows // 2)  # at least two micro-batches whatever the sampled lengths
        trainer.cfg = base.replace(update_tokens=per * width)
        chunks = stages.micro_batches(trainer.cfg.execution, layout, arrays)
        assert len(chunks) == -(-rows // per) >= 2
        p2, _, aux2 = stages.update_once(trainer.context, *_copy((trainer.params,
                                                                  trainer.opt_state)),
                                         trainer.state, layout, arrays)
    finally:
        trainer.cfg = base
    for key in ("loss", "pg_loss", "kl", "entropy", "clip_frac", "grad_norm", "n_tok"):
        assert aux2[key] == pytest.approx(aux1[key], rel=1e-5, abs=1e-6), key
    a = np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(p1)])
    b = np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(p2)])
    # Adam's first step is ~lr·sign(g): a gradient within rounding of 0 may flip; nothing else may
    assert np.mean(np.abs(a - b) <= 1e-6) > 0.999


@pytest.mark.parametrize("epochs,update_tokens", [(1, None), (2, 64)])
def test_a_diverged_update_leaves_the_trainer_as_it_was(epochs: int, update_tokens) -> None:
    """The update programs take the parameters and optimiser state as donated buffers; a
    non-finite update must still leave the trainer's state exactly as before the step (the
    same digest, every buffer alive), whether it diverged in the fused update, in the
    micro-batched apply, or in a later epoch (which must undo the earlier ones)."""
    from jaxrl_sym.rl.step.stages import DivergedError
    from jaxrl_sym.rl.step.state import params_sha256

    cfg = CFG.replace(lr=1e38, max_grad_norm=None, beta=0.0, epochs=epochs,
                      update_tokens=update_tokens)
    tr = RLTrainer(init_model(MODEL, 0), TASK.reward, cfg)
    prompts = TASK.sample(np.random.default_rng(0), 4)
    with contextlib.suppress(DivergedError):  # overflows the weights: the next is non-finite
        tr.step(prompts, seed=1)
    before = (tr.params_sha256(), params_sha256(tr.opt_state), tr.steps_done)
    with pytest.raises(DivergedError, match="the step was not applied"):
        tr.step(prompts, seed=2)
    assert (tr.params_sha256(), params_sha256(tr.opt_state), tr.steps_done) == before
    assert not any(x.is_deleted() for x in jax.tree_util.tree_leaves((tr.params, tr.opt_state)))


def test_the_update_writes_the_new_state_into_the_old_one() -> None:
    """No second copy of parameters and Adam state while the update runs: XLA aliases every
    state output to its donated input (only the step's scalars are fresh outputs); the apply
    holds no copy of the gradients either."""
    from jaxrl_sym.runtime.memory.ledger import ProgramSize, tree_nbytes

    trainer, _, rollout, rewards = setup()
    layout, arrays = trainer.prepare(rollout, rewards, "sym")
    (inputs, arr), = stages.micro_batches(replace(trainer.cfg.execution, update_tokens=None),
                                          layout, arrays)
    fns = trainer.context.fns(layout.system)
    state = tree_nbytes((trainer.params, trainer.opt_state))
    size = ProgramSize.of("update", fns["update"].lower(trainer.params, trainer.opt_state,
                                                         None, inputs, arr).compile())
    assert size.alias >= state and size.out - size.alias < 4096, size
    apply = ProgramSize.of("apply", fns["apply"].lower(trainer.params, trainer.opt_state,
                                                       trainer.params).compile())
    assert apply.alias >= state and apply.out - apply.alias < 4096, apply
    # the clipped gradients are written over the donated sum, not kept as a gradient-sized
    # temporary (as optax's chain's first link: 1.02x the parameters here, 1.0x at
    # SmolLM2-135M's shape; now 0.67x here and ~0 there, where every leaf is large)
    assert trainer.cfg.optim.max_grad_norm and apply.temp < 0.8 * tree_nbytes(trainer.params), apply


@pytest.mark.parametrize("update_tokens", [None, 16])
def test_the_clipped_update_equals_optax_clip_then_adam(update_tokens) -> None:
    """The gradient clip runs outside the optimiser (in place over the gradient sum, so it is
    no temporary); the step must still be optax's ``chain(clip_by_global_norm, adam)`` of the
    batch's gradient, in the fused update (one micro-batch) and in the apply after several.
    The clip binds: the norm limit is far below the gradient's norm."""
    import optax

    cfg = CFG.replace(beta=0.0, epochs=1, max_grad_norm=1e-3, update_tokens=update_tokens)
    trainer = RLTrainer(init_model(MODEL, 0), TASK.reward, cfg)
    _, _, rollout, rewards = setup()
    layout, arrays = trainer.prepare(rollout, rewards, "sym")
    chunks = stages.micro_batches(cfg.execution, layout, arrays)
    assert (len(chunks) > 1) == (update_tokens is not None), len(chunks)
    fns, state = trainer.context.fns(layout.system), trainer.state
    grads = None
    for inputs, arr in chunks:  # the gradient of the whole batch, summed over its micro-batches
        _, g = fns["grad"](state.params, state.frozen, inputs, arr)
        grads = g if grads is None else jax.tree_util.tree_map(jnp.add, grads, g)
    assert float(optax.tree.norm(grads)) > 10 * cfg.optim.max_grad_norm
    params0 = jax.tree_util.tree_map(np.asarray, state.params)
    tx = optax.chain(optax.clip_by_global_norm(cfg.optim.max_grad_norm), optax.adam(cfg.optim.lr))
    updates, _ = tx.update(grads, tx.init(state.params), state.params)
    want = jax.tree_util.tree_map(np.asarray, optax.apply_updates(state.params, updates))
    new, _ = stages.update(trainer.context, state, layout, arrays)
    got = jax.tree_util.tree_map(np.asarray, new.params)
    moved = [np.abs(w - p).max() for w, p in zip(jax.tree_util.tree_leaves(want),
                                                 jax.tree_util.tree_leaves(params0), strict=True)]
    assert max(moved) > 0.5 * cfg.optim.lr
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                           got, want)
