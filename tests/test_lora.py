"""LoRA as a function of a contract model's flat leaves (``jaxrl_sym.weights.lora``).

Oracles, none sharing code with what they test:

* the base model itself: at initialisation (B = 0) the merged model's logits are the base's,
  bit for bit (``==``), for float32 and bfloat16 models;
* an independent merged-weight forward written here: it edits the model's nested pure-dict
  parameters (``W + scale * einsum(A, B)``), merges them back with NNX, and is differentiated
  with its own ``jax.grad`` — logits and adapter gradients agree within 1e-5;
* numpy (float64) for ``merged_leaves`` over random shapes, ranks and dtypes (hypothesis).

The models are the built-in ``DecoderLM`` and models of ``tests/zoo.py`` (GPT-2-like with fused
QKV and biases, Gemma-2-like with 3-D einsum weights, scan-stacked layers), driven through the
trainer's own flattening: ``nnx.split`` + ``jax.tree_util.tree_flatten``.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from zoo import GemmaishConfig, GemmaishLM, GPT2Like, GPTConfig, ScanLM, StackedConfig

from jaxrl_sym import init_model, preset
from jaxrl_sym.errors import InputError
from jaxrl_sym.weights.lora import (
    adapter_bytes,
    adapter_params,
    base_bytes,
    frozen_base,
    init_adapters,
    merged_leaves,
    merged_model,
    plan_lora,
)
from jaxrl_sym.weights.lora_config import LoraConfig

TOKENS = np.array([[3, 1, 4, 1, 5, 9, 2, 6], [5, 3, 5, 8, 9, 7, 9, 3]], np.int32)
HEADS = ("lm_head", "head")


MODELS: dict[str, Callable[[], nnx.Module]] = {
    "decoder": lambda: init_model(preset("tiny"), 0),
    "decoder_bf16": lambda: init_model(preset("tiny", dtype=jnp.bfloat16), 1),
    "gpt2": lambda: GPT2Like(GPTConfig(), rngs=nnx.Rngs(2)),
    "gemmaish": lambda: GemmaishLM(GemmaishConfig(), rngs=nnx.Rngs(3)),
}


def run(model: nnx.Module) -> jax.Array:
    pos = jnp.broadcast_to(jnp.arange(TOKENS.shape[1], dtype=jnp.int32), TOKENS.shape)
    return model(jnp.asarray(TOKENS), pos, jnp.zeros_like(pos))


def via_trainer_leaves(model: nnx.Module, plan, adapters) -> nnx.Module:
    """The model rebuilt the way the trainer would: split, flatten, merge leaves, unflatten."""
    graphdef, state = nnx.split(model)
    leaves, treedef = jax.tree_util.tree_flatten(state)
    merged = merged_leaves(plan, leaves, adapters)
    return nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, merged))


def random_adapters(plan, seed: int) -> list[dict[str, jax.Array]]:
    rng = np.random.default_rng(seed)
    return [{"a": jnp.asarray(rng.normal(0, 0.3, (i, plan.rank)), jnp.float32),
             "b": jnp.asarray(rng.normal(0, 0.3, (plan.rank, o)), jnp.float32)}
            for i, o in plan.shapes]


# --------------------------------------------------------------------------- independent oracle


def linear_kernels(model: nnx.Module) -> list[tuple[tuple, str]]:
    """(key path in the pure dict, dotted name) of every 2-D kernel outside the head."""
    params = nnx.to_pure_dict(nnx.split(model, nnx.Param, ...)[1])
    out = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        keys = tuple(p.key for p in path)
        if keys[-1] == "kernel" and leaf.ndim == 2 and keys[-2] not in HEADS:
            out.append((keys, ".".join(str(k) for k in keys)))
    return out


def oracle_forward(model: nnx.Module, by_name: dict[str, tuple], scale: float) -> jax.Array:
    """Logits with ``W + scale * A B`` written into the nested parameter dict."""
    return run(oracle_model(model, by_name, scale))


def oracle_model(model: nnx.Module, by_name: dict[str, tuple], scale: float) -> nnx.Module:
    """``model`` with ``W + scale * A B`` written into its nested parameter dict."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tree = nnx.to_pure_dict(params)
    for keys, name in linear_kernels(model):
        if name not in by_name:
            continue
        a, b = by_name[name]
        node = tree
        for k in keys[:-1]:
            node = node[k]
        w = node[keys[-1]]
        delta = jnp.einsum("ir,ro->io", a, b, precision=jax.lax.Precision.HIGHEST)
        node[keys[-1]] = (w.astype(jnp.float32) + scale * delta).astype(w.dtype)
    fresh = jax.tree.map(lambda x: x, params)
    nnx.replace_by_pure_dict(fresh, tree)
    return nnx.merge(graphdef, fresh, rest)


def loss_of(logits: jax.Array) -> jax.Array:
    """A scalar that depends on every logit: next-token log-likelihood of TOKENS."""
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
    nxt = jnp.asarray(TOKENS[:, 1:] % logits.shape[-1])
    return -jnp.take_along_axis(logp, nxt[..., None], axis=-1).mean()


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("name", ["decoder", "decoder_bf16", "gpt2", "gemmaish"])
def test_init_is_exactly_the_base(name: str) -> None:
    model = MODELS[name]()
    plan = plan_lora(model, LoraConfig(rank=4))
    adapters = init_adapters(plan, jax.random.key(0))
    assert all(float(jnp.abs(ad["a"]).max()) > 0 for ad in adapters)  # A is not zero: B is
    merged = via_trainer_leaves(model, plan, adapters)
    assert np.array_equal(np.asarray(run(merged)), np.asarray(run(model)))
    leaves = jax.tree_util.tree_leaves(nnx.split(model)[1])
    again = merged_leaves(plan, leaves, adapters)
    assert all(a.dtype == b.dtype and np.array_equal(a, b) for a, b in zip(again, leaves,
                                                                             strict=True))


def test_all_linear_picks_the_linear_kernels_but_the_head() -> None:
    """The plan's targets are the oracle's own selection (2-D kernels, head left out)."""
    for make in MODELS.values():
        model = make()
        plan = plan_lora(model, LoraConfig(rank=2))
        assert sorted(plan.names) == sorted(n for _, n in linear_kernels(model))
    gpt = MODELS["gpt2"]()
    assert "lm_head.kernel" not in plan_lora(gpt, LoraConfig(rank=2)).names
    assert plan_lora(gpt, LoraConfig(rank=2, targets=r"lm_head\.kernel")).names == (
        "lm_head.kernel",)


@pytest.mark.parametrize("name", ["decoder", "gpt2", "gemmaish", "decoder_bf16"])
def test_logits_and_gradients_match_an_independent_merge(name: str) -> None:
    model = MODELS[name]()
    cfg = LoraConfig(rank=3, alpha=5.0, targets=r".*(q_proj|v_proj|c_attn|mlp_proj|gating|"
                                                 r"down)\.kernel")
    plan = plan_lora(model, cfg)
    adapters = random_adapters(plan, 7)
    tol = 1e-5 if name != "decoder_bf16" else 0.0  # bf16: same rounding on both sides

    def ours(ads):
        return loss_of(run(via_trainer_leaves(model, plan, ads)))

    def theirs(by_name):
        return loss_of(oracle_forward(model, by_name, cfg.alpha / cfg.rank))

    by_name = {n: (ad["a"], ad["b"]) for n, ad in zip(plan.names, adapters, strict=True)}
    ref_logits = oracle_forward(model, by_name, cfg.alpha / cfg.rank)
    got_logits = run(via_trainer_leaves(model, plan, adapters))
    base_move = float(jnp.abs(ref_logits - run(model)).max())
    assert base_move > 1e-2, "the adapters must visibly change the logits"
    np.testing.assert_allclose(got_logits, ref_logits, atol=tol, rtol=0)
    loss, grads = jax.jit(jax.value_and_grad(ours))(adapters)
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(theirs))(by_name)
    np.testing.assert_allclose(loss, ref_loss, atol=1e-5 if tol else 0.0)
    for n, g in zip(plan.names, grads, strict=True):
        scale = max(1.0, float(jnp.abs(ref_grads[n][0]).max()), float(jnp.abs(ref_grads[n][1])
                                                                        .max()))
        np.testing.assert_allclose(g["a"], ref_grads[n][0], atol=1e-5 * scale, err_msg=n)
        np.testing.assert_allclose(g["b"], ref_grads[n][1], atol=1e-5 * scale, err_msg=n)
        assert float(jnp.abs(g["b"]).max()) > 0, n
    assert np.array_equal(np.asarray(run(merged_model(model, plan, adapters))),
                          np.asarray(got_logits))


def test_jit_with_the_plan_static_and_dtype_cast() -> None:
    model = MODELS["decoder"]()
    plan = plan_lora(model, LoraConfig(rank=2))
    hash(plan)
    leaves = jax.tree_util.tree_leaves(nnx.split(model)[1])
    adapters = random_adapters(plan, 1)
    eager = merged_leaves(plan, leaves, adapters, jnp.bfloat16)
    jitted = jax.jit(merged_leaves, static_argnums=(0, 3))(plan, leaves, adapters, jnp.bfloat16)
    assert all(x.dtype == jnp.bfloat16 for x in jitted)
    assert all(np.array_equal(a, b) for a, b in zip(eager, jitted, strict=True))


def test_frozen_base_and_bytes() -> None:
    model = MODELS["decoder"]()
    plan = plan_lora(model, LoraConfig(rank=4, base_dtype="bfloat16"))
    leaves = jax.tree_util.tree_leaves(nnx.split(model)[1])
    base = frozen_base(plan, leaves)
    assert all(x.dtype == jnp.bfloat16 for x in base)
    assert base_bytes(base) * 2 == base_bytes(leaves)
    expected = sum(4 * (i + o) for i, o in plan.shapes)
    assert adapter_params(plan) == expected and adapter_bytes(plan) == 4 * expected
    # the plan of an abstract model (shapes only) is the same plan
    abstract = nnx.eval_shape(lambda: init_model(preset("tiny"), 0))
    assert plan_lora(abstract, plan.cfg) == plan


def test_target_errors_name_what_to_do() -> None:
    model = MODELS["decoder"]()
    with pytest.raises(InputError, match=r"match no parameter path.*layers\.0\.attn\.k_proj"):
        plan_lora(model, LoraConfig(targets="q_proj"))  # must match the whole path
    with pytest.raises(InputError, match=r"no 2-D 'kernel' leaf.*stack\.wq \[3, 32, 32\]"):
        plan_lora(ScanLM(StackedConfig(), rngs=nnx.Rngs(0)), LoraConfig())
    with pytest.raises(InputError, match=r"stack\.wq has shape \[3, 32, 32\].*2-D"):
        plan_lora(ScanLM(StackedConfig(), rngs=nnx.Rngs(0)), LoraConfig(targets=r"stack\.wq"))
    with pytest.raises(InputError, match=r"c_attn\.bias has shape \[96\]"):
        plan_lora(MODELS["gpt2"](), LoraConfig(targets=r".*c_attn\..*"))
    with pytest.raises(InputError, match=r"rank=17.*layers\.0\.attn\.k_proj\.kernel of shape "
                                         r"\[32, 16\].*rank <= 16"):
        plan_lora(model, LoraConfig(rank=17))


def test_config_errors() -> None:
    with pytest.raises(InputError, match=r"dropout=0\.05: only 0\.0.*merged weights"):
        LoraConfig(dropout=0.05)
    with pytest.raises(InputError, match=r"rank=0"):
        LoraConfig(rank=0)
    with pytest.raises(InputError, match=r"alpha=-1"):
        LoraConfig(alpha=-1)
    with pytest.raises(InputError, match=r"base_dtype='float16'"):
        LoraConfig(base_dtype="float16")
    with pytest.raises(InputError, match=r"targets='\(q_proj' is not a valid regular"):
        LoraConfig(targets="(q_proj")
    assert LoraConfig().scale == 2.0 and LoraConfig(rank=8, alpha=8).scale == 1.0


def test_mismatched_inputs_are_refused() -> None:
    model = MODELS["decoder"]()
    plan = plan_lora(model, LoraConfig(rank=2))
    leaves = jax.tree_util.tree_leaves(nnx.split(model)[1])
    adapters = init_adapters(plan, jax.random.key(0))
    with pytest.raises(InputError, match=r"plan was made for a model with 20"):
        merged_leaves(plan, leaves[:-1], adapters)
    bad = [dict(ad) for ad in adapters]
    bad[0]["a"] = bad[0]["a"][:, :1]
    with pytest.raises(InputError, match=r"adapter for layers\.0\.attn\.k_proj\.kernel"):
        merged_leaves(plan, leaves, bad)


DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}


@settings(max_examples=40)
@given(st.integers(1, 9), st.integers(1, 9), st.integers(1, 9), st.integers(0, 2**31 - 1),
       st.sampled_from(list(DTYPES)), st.floats(0.5, 64.0))
def test_merged_leaves_against_numpy(n_in: int, n_out: int, r: int, seed: int, dt: str,
                                     alpha: float) -> None:
    """On a plain pytree (not a module): targets get W + alpha/r A B in float64, rounded once
    to the leaf's dtype; a 1-D leaf and an int leaf pass through untouched."""
    r = min(r, n_in, n_out)
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(n_in, n_out)).astype(DTYPES[dt])
    state = {"blk": {"kernel": jnp.asarray(w), "bias": jnp.asarray(rng.normal(size=n_out))},
             "step": jnp.asarray(3, jnp.int32),
             "z": {"kernel": jnp.asarray(rng.normal(size=(n_out, n_in)), jnp.float32)}}
    plan = plan_lora(state, LoraConfig(rank=r, alpha=alpha, targets=r"blk\.kernel"))
    assert plan.names == ("blk.kernel",) and plan.shapes == ((n_in, n_out),)
    a = rng.normal(size=(n_in, r)).astype(np.float32)
    b = rng.normal(size=(r, n_out)).astype(np.float32)
    leaves = jax.tree_util.tree_leaves(state)
    out = merged_leaves(plan, leaves, [{"a": jnp.asarray(a), "b": jnp.asarray(b)}])
    want = w.astype(np.float64) + alpha / r * (a.astype(np.float64) @ b.astype(np.float64))
    got = np.asarray(out[plan.indices[0]])
    assert got.dtype == w.dtype
    if dt == "float32":
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * alpha)
    else:  # one bf16 rounding of the float32 sum: within one bf16 ulp of the exact value
        np.testing.assert_allclose(got.astype(np.float64), want, rtol=2**-7, atol=1e-5 * alpha)
    for i, leaf in enumerate(leaves):
        if i != plan.indices[0]:
            assert out[i] is leaf


class WithDropout(nnx.Module):
    """A module whose state also holds RNG leaves (a counter and a typed key)."""

    def __init__(self) -> None:
        self.lin = nnx.Linear(4, 6, rngs=nnx.Rngs(0))
        self.drop = nnx.Dropout(0.1, rngs=nnx.Rngs(1))


def test_rng_leaves_pass_through_and_are_refused_as_targets() -> None:
    model = WithDropout()
    plan = plan_lora(model, LoraConfig(rank=2, base_dtype="bfloat16"))
    assert plan.names == ("lin.kernel",)
    leaves = jax.tree_util.tree_leaves(nnx.split(model)[1])
    out = merged_leaves(plan, leaves, init_adapters(plan, jax.random.key(0)), jnp.bfloat16)
    base = frozen_base(plan, leaves)
    for got, leaf in [*zip(out, leaves, strict=True), *zip(base, leaves, strict=True)]:
        if not jnp.issubdtype(leaf.dtype, jnp.floating):
            assert got is leaf
    assert base_bytes(leaves) == 4 + 8 + 4 * (6 + 24)  # counter, key data, bias, kernel
    with pytest.raises(InputError, match=r"drop\.rngs\.count has shape \[\] and dtype uint32"):
        plan_lora(model, LoraConfig(rank=2, targets=r"drop\..*"))
