"""LoRA without merged weights (``jaxrl_sym.weights.lora_apply.lora_call``).

Oracles that share no code with the rewrite:

* the base model itself: at initialisation (B = 0) the logits are the base's, bit for bit;
* ``test_lora.oracle_forward``: ``W + scale * A B`` written into the model's nested parameter
  dict and merged back with NNX, differentiated by its own ``jax.grad``;
* numpy (float64) on hypothesis-drawn shapes, for a function that reads a target both through a
  matmul (rewritten) and otherwise (a sum: the merged weight is formed for that use).

And the point of it, in bytes: the compiled gradient program holds fewer temporaries than the
merged-weight one (XLA's ``memory_analysis``, nothing run).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from test_lora import MODELS, loss_of, oracle_forward, random_adapters, run

from jaxrl_sym import init_model, preset
from jaxrl_sym.weights.lora import LoraPlan, init_adapters, merged_leaves, plan_lora
from jaxrl_sym.weights.lora_apply import lora_call
from jaxrl_sym.weights.lora_config import LoraConfig


def forward_of(model: nnx.Module):
    """``fn(leaves) -> logits`` over the trainer's flat leaves, and the leaves."""
    graphdef, state = nnx.split(model)
    leaves, treedef = jax.tree_util.tree_flatten(state)

    def fn(lv):
        return run(nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, lv)))

    return fn, leaves


@pytest.mark.parametrize("name", ["decoder", "decoder_bf16", "gpt2", "gemmaish"])
def test_at_initialisation_the_logits_are_the_base_models(name: str) -> None:
    model = MODELS[name]()
    plan = plan_lora(model, LoraConfig(rank=4))
    fn, leaves = forward_of(model)
    got = lora_call(fn, plan)(leaves, init_adapters(plan, jax.random.key(0)))
    assert np.array_equal(np.asarray(got), np.asarray(run(model)))


@pytest.mark.parametrize("name", ["decoder", "gpt2", "gemmaish"])
def test_logits_and_adapter_gradients_equal_the_merged_oracle(name: str) -> None:
    model = MODELS[name]()
    plan = plan_lora(model, LoraConfig(rank=4, alpha=8))
    adapters = random_adapters(plan, 3)
    fn, leaves = forward_of(model)
    by_name = lambda ads: {n: (a["a"], a["b"]) for n, a in zip(plan.names, ads, strict=True)}
    want = oracle_forward(model, by_name(adapters), plan.scale)
    got = jax.jit(lora_call(fn, plan))(leaves, adapters)
    # x @ (W + s A B) against x @ W + s (x A) B: the same sum, rounded in another order (fp32)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=5e-5, rtol=1e-4)
    g_want = jax.jit(jax.grad(lambda ads: loss_of(oracle_forward(model, by_name(ads),
                                                                 plan.scale))))(adapters)
    g_got = jax.jit(jax.grad(lambda ads: loss_of(lora_call(fn, plan)(leaves, ads))))(adapters)
    for w, g in zip(jax.tree.leaves(g_want), jax.tree.leaves(g_got), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5, rtol=1e-4)


def test_the_update_holds_fewer_bytes_than_with_merged_weights() -> None:
    """The gradient program, compiled (not run) at a width where weights dominate: XLA's own
    temporaries with the rewrite are below the merged-weight program's."""
    model = init_model(preset("tiny", d_model=256, ffn_dim=1024, n_layers=4, vocab_size=64), 0)
    plan = plan_lora(model, LoraConfig(rank=4))
    adapters = random_adapters(plan, 1)
    fn, leaves = forward_of(model)
    merged = jax.jit(jax.grad(lambda ads: loss_of(fn(merged_leaves(plan, leaves, ads)))))
    low = jax.jit(jax.grad(lambda ads: loss_of(lora_call(fn, plan)(leaves, ads))))
    temp = lambda f: f.lower(adapters).compile().memory_analysis().temp_size_in_bytes
    assert temp(low) < temp(merged), (temp(low), temp(merged))


def _plan(shapes: list[tuple[int, int]], rank: int) -> LoraPlan:
    return LoraPlan(LoraConfig(rank=rank, alpha=2 * rank), len(shapes), tuple(range(len(shapes))),
                    tuple(f"w{i}" for i in range(len(shapes))), tuple(shapes))


@settings(max_examples=12, deadline=None)
@given(rows=st.integers(1, 5), d_in=st.integers(1, 9), d_mid=st.integers(1, 9),
       d_out=st.integers(1, 9), rank=st.integers(1, 4), seed=st.integers(0, 2**16),
       other_use=st.booleans())
def test_matmul_chains_equal_numpy(rows, d_in, d_mid, d_out, rank, seed, other_use) -> None:
    """``tanh(x @ W0) @ W1`` (+ ``sum(W0)`` when ``other_use``: a read that is not a matmul, so
    the merged weight is formed for it) against numpy in float64."""
    rng = np.random.default_rng(seed)
    w = [rng.normal(size=(d_in, d_mid)), rng.normal(size=(d_mid, d_out))]
    ads = [{"a": rng.normal(size=(s[0], rank)), "b": rng.normal(size=(rank, s[1]))}
           for s in ((d_in, d_mid), (d_mid, d_out))]
    x = rng.normal(size=(rows, d_in))
    plan = _plan([(d_in, d_mid), (d_mid, d_out)], rank)

    def fn(lv, x):
        y = jnp.tanh(x @ lv[0]) @ lv[1]
        return y + jnp.sum(lv[0]) if other_use else y

    f32 = lambda t: jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), t)
    got = lora_call(fn, plan)(f32(w), f32(ads), f32(x))
    m = [wi + plan.scale * a["a"] @ a["b"] for wi, a in zip(w, ads, strict=True)]
    want = np.tanh(x @ m[0]) @ m[1] + (m[0].sum() if other_use else 0.0)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=2e-4, atol=2e-4)
