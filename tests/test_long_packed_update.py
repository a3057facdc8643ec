"""A reasoning-length sample trains right (issue 47): a packed row of more than 4k tokens — one
long response beside a short one behind their shared prompt — gives the loss and gradients of
the plain model run on each sample alone, with the GRPO objective written out here.

Oracle: the plain ``DecoderLM`` (its own ``__call__``, no packing, no tracer, no runtime
attention) on each prompt + response, log-probs from ``jax.nn.log_softmax``, the group's
advantages from numpy, the token-mean policy-gradient term at ratio 1 (the rollout's old
log-probs are the policy's own: its value is ``-sum_i A_i |y_i| / N``), differentiated with
``jax.grad``. The trainer's loss comes
from its packed layout (sym, shared prompt: one 4,160+-token row) through the update program.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_sym.models.lm import init_model, preset
from jaxrl_sym.rl import RLConfig, RLTrainer, Rollout

MODEL = preset("tiny", n_heads=2, n_kv_heads=1)  # 2 layers, vocabulary 64, GQA 2:1
PROMPT, LONG, SHORT = 64, 4100, 37
CFG = RLConfig.of(algo="grpo", group_size=2, max_new_tokens=LONG, eos_id=None, beta=0.0,
                  entropy_coef=0.0, loss_agg="token_mean", adv_norm="group_std", epochs=1,
                  logprob_chunk=512, update_tokens=None)


def _sequences() -> tuple[np.ndarray, list[np.ndarray]]:
    rng = np.random.default_rng(7)
    prompt = rng.integers(1, MODEL.vocab_size, PROMPT).astype(np.int32)
    return prompt, [rng.integers(1, MODEL.vocab_size, n).astype(np.int32) for n in (LONG, SHORT)]


def _plain_logprobs(model: nnx.Module, prompt: np.ndarray, response: np.ndarray) -> jax.Array:
    tokens = jnp.asarray(np.concatenate([prompt, response]))[None]
    positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
    logp = jax.nn.log_softmax(model(tokens, positions, jnp.zeros_like(positions))[0])
    steps = jnp.arange(len(prompt) - 1, tokens.shape[1] - 1)
    return logp[steps, jnp.asarray(response)]


@pytest.mark.slow  # ~1 CPU-minute, mostly running 4k x 4k attention (short rows: test_packed)
def test_a_4k_token_packed_row_gives_the_plain_models_loss_and_gradients() -> None:
    prompt, responses = _sequences()
    rewards = np.array([1.0, 0.0], np.float32)
    adv = (rewards - rewards.mean()) / (rewards.std() + CFG.algorithm.adv_eps)  # GRPO, one group
    graphdef, params, rest = nnx.split(init_model(MODEL, 0), nnx.Param, ...)

    def objective(p: nnx.State) -> jax.Array:
        model = nnx.merge(graphdef, p, rest)
        lps = [_plain_logprobs(model, prompt, r) for r in responses]
        tokens = sum(len(r) for r in responses)
        return -sum(a * jnp.sum(lp) for a, lp in zip(adv, lps, strict=True)) / tokens

    want_grads = jax.jit(jax.grad(objective))(params)
    old = [np.asarray(jax.jit(lambda p, r=r: _plain_logprobs(
        nnx.merge(graphdef, p, rest), prompt, r))(params)) for r in responses]

    trainer = RLTrainer(init_model(MODEL, 0), lambda p, r: 0.0, CFG, system="sym")
    rollout = Rollout([prompt, prompt], responses, old, group_size=2)
    layout = trainer.layout(rollout, "sym")
    assert max(layout.shape) >= PROMPT + LONG  # the long sample is one row of 4k+ tokens
    loss, aux, grads = trainer.loss_and_grads(rollout, rewards, "sym")
    # the surrogate at ratio 1 is -sum_i A_i |y_i| / N; its gradient is the objective's
    n = np.array([len(r) for r in responses])
    np.testing.assert_allclose(loss, -float(adv @ n) / n.sum(), rtol=1e-5)
    assert abs(aux["ratio_max"] - 1) < 1e-3 and abs(aux["ratio_min"] - 1) < 1e-3
    got, want = jax.tree_util.tree_leaves(grads["lm"]), jax.tree_util.tree_leaves(want_grads)
    assert len(got) == len(want)
    assert max(float(np.abs(np.asarray(w)).max()) for w in want) > 1e-4  # not vacuous
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-3, atol=2e-6)
