"""The unmerged LoRA model (``jaxrl_sym.weights.lora_model``): what every system generates and
scores with in a LoRA run, so no merged copy of the weights is ever held.

Oracles that share no LoRA code: the base model itself (adapters off: bit for bit), the model
with ``W + scale * A B`` written into its nested parameter dict (``test_lora.oracle_model``),
and ``zoo.naive_generate`` (re-runs the whole sequence every step) on that merged model for the
tokens the symbolic runtime and the padded baseline generate from the unmerged one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from test_lora import MODELS, oracle_model, random_adapters, run
from zoo import naive_generate

from jaxrl_sym.baselines import padded_generate
from jaxrl_sym.generation import GenerationConfig
from jaxrl_sym.runtime.engine import SymbolicLM
from jaxrl_sym.weights.lora import plan_lora
from jaxrl_sym.weights.lora_config import LoraConfig
from jaxrl_sym.weights.lora_model import LoraSplitModel, lora_leaves, lora_model, zero_adapters


def _setup(name: str, rank: int = 4, seed: int = 3):
    base = MODELS[name]()
    plan = plan_lora(base, LoraConfig(rank=rank, alpha=2.0 * rank))
    adapters = random_adapters(plan, seed)
    by_name = {n: (a["a"], a["b"]) for n, a in zip(plan.names, adapters, strict=True)}
    return base, plan, adapters, by_name


@pytest.mark.parametrize("name", ["decoder", "decoder_bf16", "gpt2", "gemmaish"])
def test_logits_equal_the_merged_oracle_and_adapters_off_the_base(name: str) -> None:
    base, plan, adapters, by_name = _setup(name)
    got = np.asarray(run(lora_model(base, plan, adapters)), np.float32)
    want = np.asarray(run(oracle_model(base, by_name, plan.scale)), np.float32)
    if any(x.dtype == jnp.bfloat16 for x in jax.tree_util.tree_leaves(nnx.state(base))):
        # bf16 rounds the unmerged products and the merged weight differently: both must be
        # about as far from the float32 computation of the same model
        exact = np.asarray(run(oracle_model(_f32(base), by_name, plan.scale)), np.float32)
        assert np.abs(got - exact).max() <= 2 * np.abs(want - exact).max() + 1e-3
    else:
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    dt = jax.tree_util.tree_leaves(nnx.state(base))[0].dtype
    off = run(lora_model(base, plan, zero_adapters(plan, dt)))
    assert np.array_equal(np.asarray(off), np.asarray(run(base)))  # adapters off: the base


def _f32(model: nnx.Module) -> nnx.Module:
    """``model`` computing in float32: its bf16 weights cast up, every ``dtype`` attribute
    float32."""
    graphdef, state = nnx.split(model)
    up = jax.tree.map(lambda x: x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating)
                      else x, state)
    out = nnx.merge(graphdef, up)
    for _, module in nnx.iter_modules(out):
        for attr in ("dtype", "param_dtype"):
            if getattr(module, attr, None) is not None:
                setattr(module, attr, jnp.float32)
    return out


@pytest.mark.parametrize("name", ["decoder", "gpt2", "gemmaish"])
def test_leaves_are_the_adapters_then_the_base_itself(name: str) -> None:
    base, plan, adapters, _ = _setup(name)
    model = lora_model(base, plan, adapters)
    got = jax.tree_util.tree_leaves(nnx.split(model)[1])
    want = lora_leaves(adapters, jax.tree_util.tree_leaves(nnx.split(base)[1]))
    assert len(got) == len(want)
    assert all(x is y for x, y in zip(got, want, strict=True))  # no copy of any weight
    split = callable(getattr(base, "features", None))
    assert isinstance(model, LoraSplitModel) == split


@settings(max_examples=4, deadline=None)
@given(st.integers(1, 6), st.lists(st.integers(1, 9), min_size=1, max_size=3),
       st.integers(0, 100))
def test_sym_and_padded_generate_the_merged_models_tokens(rank: int, lens: list[int],
                                                          seed: int) -> None:
    """Greedy tokens from the unmerged model, through the symbolic runtime and the padded
    baseline, equal a whole-sequence re-run of the merged oracle (ragged prompts)."""
    base, plan, adapters, by_name = _setup("gpt2", rank, seed)
    merged = oracle_model(base, by_name, plan.scale)
    rng = np.random.default_rng(seed)
    vocab = run(base).shape[-1]
    prompts = [rng.integers(0, vocab, n).astype(np.int32) for n in lens]
    cfg = GenerationConfig(max_new_tokens=4, temperature=0.0)
    model = lora_model(base, plan, adapters)
    sym = SymbolicLM(model).generate(prompts, cfg)
    pad = padded_generate(model, prompts, cfg)
    for i, p in enumerate(prompts):
        want, _ = naive_generate(merged, p, 4)
        np.testing.assert_array_equal(sym.tokens[i], want, err_msg=f"sym row {i}")
        np.testing.assert_array_equal(pad.tokens[i], want, err_msg=f"padded row {i}")
