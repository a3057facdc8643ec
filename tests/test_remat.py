"""Remat between attention calls (:mod:`jaxrl_sym.rl.step.remat`): the same loss and gradients as
the function itself — checked against jax.grad of the plain model, no remat — and fewer bytes
kept for the backward, read from XLA's own buffer assignment."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl_sym.models.lm import DecoderLM, LMConfig
from jaxrl_sym.ops.attention import Causal, Window, attention_p
from jaxrl_sym.rl.step.remat import remat_between_attention, segments
from tests import zoo


def _model(layers: int, ffn: int = 64) -> DecoderLM:
    cfg = LMConfig(vocab_size=64, d_model=32, n_layers=layers, n_heads=4, n_kv_heads=2,
                   head_dim=8, ffn_dim=ffn, patterns=(Causal(), Window(3)) * (layers // 2)
                   + (Causal(),) * (layers % 2))
    return DecoderLM(cfg, rngs=nnx.Rngs(layers))


def _loss(model: nnx.Module):
    graphdef, state = nnx.split(model)
    leaves, treedef = jax.tree_util.tree_flatten(state)

    def loss(leaves, tokens, positions, targets):
        m = nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, leaves))
        logp = jax.nn.log_softmax(m(tokens, positions, jnp.zeros_like(positions)))
        return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], -1))

    return loss, leaves


@settings(max_examples=4, deadline=None)
@given(layers=st.integers(1, 3), rows=st.integers(1, 2), length=st.integers(2, 9),
       seed=st.integers(0, 1000))
def test_loss_and_gradients_equal_the_plain_model(layers: int, rows: int, length: int,
                                                  seed: int) -> None:
    loss, leaves = _loss(_model(layers))
    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(0, 64, (rows, length)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (rows, length))
    targets = jnp.asarray(rng.integers(0, 64, (rows, length)), jnp.int32)
    want = jax.jit(jax.value_and_grad(loss))(leaves, tokens, positions, targets)
    got = jax.jit(jax.value_and_grad(remat_between_attention(loss)))(
        leaves, tokens, positions, targets)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    for g, w in zip(got[1], want[1], strict=True):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=1e-6)


def test_segments_cut_at_every_attention_call() -> None:
    loss, leaves = _loss(_model(3))
    t = jnp.zeros((1, 4), jnp.int32)
    eqns = jax.make_jaxpr(loss)(leaves, t, t, t).eqns
    cuts = [(a, b) for a, b, remat in segments(eqns) if not remat]
    assert sum(eqns[a].primitive is attention_p for a, _ in cuts) == 3
    spans = segments(eqns)
    assert [a for a, _, _ in spans] == [0] + [b for _, b, _ in spans[:-1]]  # a partition
    assert spans[-1][1] == len(eqns)


@pytest.mark.parametrize("name", ["gpt2", "scan", "shared", "gemmaish"])
def test_zoo_models_gradients(name: str) -> None:
    """Models we did not write the cut for: learned positions, layers under lax.scan (a loop
    is its own segment), one block applied repeatedly, soft-capped logits."""
    loss, leaves = _loss(zoo.zoo()[name])
    t = jnp.asarray(np.arange(12).reshape(2, 6) % 7, jnp.int32)
    p = jnp.broadcast_to(jnp.arange(6, dtype=jnp.int32), (2, 6))
    want = jax.jit(jax.grad(loss))(leaves, t, p, t)
    got = jax.jit(jax.grad(remat_between_attention(loss)))(leaves, t, p, t)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=1e-6)


def test_backward_keeps_less() -> None:
    """Per-layer temporaries of the gradient program (two depths, same width): what the
    backward keeps per layer falls by more than half (an MLP 8x wider than the model)."""
    def temp(layers: int, remat: bool) -> int:
        loss, leaves = _loss(_model(layers, ffn=512))
        f = remat_between_attention(loss) if remat else loss
        t = jnp.zeros((2, 256), jnp.int32)
        return jax.jit(jax.grad(f)).lower(leaves, t, t, t).compile().memory_analysis() \
            .temp_size_in_bytes

    plain = temp(4, False) - temp(2, False)
    rem = temp(4, True) - temp(2, True)
    assert rem < 0.5 * plain, (rem, plain)


@pytest.mark.parametrize("system", ["sym", "padded"])
@pytest.mark.parametrize("lora", [False, True])
def test_trainer_gradients_equal_with_remat_off(system: str, lora: bool) -> None:
    """Through the whole update path (the sym PDG interpreter or the padded model, LoRA's
    rewrite, the chunked head): the trainer's loss and gradients with the layers recomputed
    equal those with them kept (the oracle tests of the loss run with remat on, the default)."""
    from jaxrl_sym.models.lm import init_model, preset
    from jaxrl_sym.rl import RLConfig, RLTrainer, compute_rewards, get_task
    from jaxrl_sym.rl.tasks.token_tasks import EOS, VOCAB_SIZE
    from jaxrl_sym.weights.lora_config import LoraConfig

    task = get_task("reverse", max_digits=3)
    out = []
    for remat in (True, False):
        cfg = RLConfig.of(algo="grpo", group_size=4, beta=0.1, eos_id=EOS, remat=remat,
                          max_new_tokens=task.max_new_tokens, logprob_chunk=8)
        tr = RLTrainer(init_model(preset("tiny", vocab_size=VOCAB_SIZE), 0), task.reward, cfg,
                       system=system, lora=LoraConfig(rank=4, alpha=8.0) if lora else None)
        if lora:  # B = 0 at initialisation: move it so the low-rank path carries gradient
            tr.params = jax.tree_util.tree_map(lambda x: x + 0.01, tr.params)
        rollout = tr.generate(task.sample(np.random.default_rng(0), 4), seed=1)
        rewards = compute_rewards(task.reward, rollout.prompts, rollout.responses)
        out.append(tr.loss_and_grads(rollout, rewards, system))
    (l1, _, g1), (l0, _, g0) = out
    np.testing.assert_allclose(l1, l0, rtol=1e-6, atol=1e-7)
    for a, b in zip(jax.tree_util.tree_leaves(g1), jax.tree_util.tree_leaves(g0), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
