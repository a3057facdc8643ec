"""DecoderLM: shapes, external-cache equivalence per attention pattern, GQA, padding/packing,
symbolic trace.

``DecoderLM`` is a plain contract model (``model(tokens, positions, segment_ids) -> logits``): it
takes no caches. The incremental-vs-full checks therefore drive it the way the padded baseline
does, through :func:`~jaxrl_sym.models.traced.trace_forward` with one
:class:`~jaxrl_sym.models.cache.PaddedKVCache` per ``attend`` call kept outside the model. They are
what makes the baselines trustworthy: a prefill followed by token-by-token decode must reproduce
the plain forward's logits (up to float reassociation) for every pattern, and for a model that is
not ``DecoderLM`` (the zoo's Gemma-2-like one) just the same.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from zoo import zoo

from jaxrl_sym.baselines import padded_forward, padded_token_logprobs
from jaxrl_sym.errors import InputError
from jaxrl_sym.models import (
    DecoderLM,
    LMConfig,
    PaddedKVCache,
    init_model,
    preset,
    preset_names,
)
from jaxrl_sym.models.contract import check_model
from jaxrl_sym.models.traced import trace_forward
from jaxrl_sym.ops.attention import Block, Causal, Linear, Window

TOL = 1e-5


def _jit_forward(model: nnx.Module) -> Callable[..., jax.Array]:
    """Forward as a jitted function of (params, ...): one compile per shape, not per op."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def fwd(state, tokens, positions, segment_ids):
        return nnx.merge(graphdef, state)(tokens, positions, segment_ids)

    return lambda tokens, positions, segment_ids=None: fwd(
        state,
        jnp.asarray(tokens, jnp.int32),
        jnp.asarray(positions, jnp.int32),
        jnp.zeros_like(jnp.asarray(positions, jnp.int32))
        if segment_ids is None
        else jnp.asarray(segment_ids, jnp.int32),
    )


def _jit_cached(model: nnx.Module, batch: int, length: int, max_len: int) -> Callable[..., Any]:
    """(tokens, positions, caches, index) -> (logits, caches) on ``[batch, length]`` tokens.

    The baselines' external cache path, not a model feature: the unmodified model is traced once
    and run by the interpreter, which writes each ``attend`` call's keys/values into that call's
    ``max_len``-slot :class:`PaddedKVCache` at slot ``index`` and attends over the whole cache.
    ``caches=None`` starts empty ones (prefill).
    """
    traced = trace_forward(model, batch, length)
    _, state = nnx.split(model)
    new_cache = lambda k, v: PaddedKVCache.like(k, v, max_len)

    @jax.jit
    def step(state, tokens, positions, caches, index):
        return traced(state, tokens, positions, jnp.zeros_like(positions), caches,
                      new_cache=new_cache, cache_index=index)

    return lambda tokens, positions, caches, index: step(
        state, jnp.asarray(tokens, jnp.int32), jnp.asarray(positions, jnp.int32), caches,
        jnp.int32(index),
    )


def _tokens(b: int, t: int, vocab: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, (b, t)).astype(np.int32)


# --------------------------------------------------------------------------- config / shapes


def test_presets_and_config() -> None:
    tiny = preset("tiny")
    assert (tiny.d_model, tiny.n_layers, tiny.n_heads, tiny.n_kv_heads, tiny.vocab_size) == (
        32, 2, 4, 2, 64,
    )
    small = preset("small")
    assert (small.d_model, small.n_layers, small.vocab_size) == (128, 4, 512)
    q = preset("qwen2.5-0.5b")
    assert (q.n_layers, q.d_model, q.n_heads, q.n_kv_heads, q.head_dim, q.ffn_dim) == (
        24, 896, 14, 2, 64, 4864,
    )
    assert q.vocab_size == 151936 and q.rope_theta == 1e6
    g = preset("gpt2-small")
    assert (g.n_layers, g.n_heads, g.n_kv_heads, g.d_model, g.head_dim, g.vocab_size) == (
        12, 12, 12, 768, 64, 50257,
    )
    assert set(preset_names()) >= {"tiny", "small", "gpt2-small", "qwen2.5-0.5b"}
    assert preset("tiny", n_layers=3).n_layers == 3
    with pytest.raises(InputError, match="unknown model preset"):
        preset("nope")

    assert LMConfig(n_layers=3).layer_patterns() == (Causal(), Causal(), Causal())
    mixed = LMConfig.mixed(4, n_layers=4)
    assert mixed.layer_patterns() == (Window(4), Causal(), Window(4), Causal())
    with pytest.raises(InputError, match="one pattern per layer"):
        LMConfig(n_layers=2, patterns=(Causal(),))
    with pytest.raises(InputError, match="n_kv_heads"):
        LMConfig(n_heads=4, n_kv_heads=3)


def test_forward_shapes_and_dtypes() -> None:
    cfg = preset("tiny")
    model = init_model(cfg)
    tok = _tokens(2, 5, cfg.vocab_size)
    pos = np.tile(np.arange(5, dtype=np.int32), (2, 1))
    logits = _jit_forward(model)(tok, pos)
    assert logits.shape == (2, 5, cfg.vocab_size) and logits.dtype == jnp.float32
    assert np.isfinite(np.asarray(logits)).all()

    # The external cache path sees one attend call per layer, with the config's kv heads.
    out, new = _jit_cached(model, 2, 5, 8)(tok, pos, None, 0)
    assert out.shape == (2, 5, cfg.vocab_size) and len(new) == cfg.n_layers
    assert isinstance(new[0], PaddedKVCache) and new[0].k.shape == (2, 8, 2, cfg.head_dim)
    np.testing.assert_array_equal(np.asarray(new[0].pos[:, :5]), pos)
    assert (np.asarray(new[0].pos[:, 5:]) == -1).all()

    # bf16 params/activations still give fp32 logits (the tied head runs in fp32). Checked
    # abstractly: eval_shape + make_jaxpr compile nothing.
    bf_cfg = preset("tiny", dtype=jnp.bfloat16)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: DecoderLM(bf_cfg, rngs=nnx.Rngs(0))))
    assert {x.dtype for x in jax.tree.leaves(state)} == {jnp.dtype(jnp.bfloat16)}
    spec = jax.ShapeDtypeStruct((2, 5), jnp.int32)
    (out,) = jax.make_jaxpr(lambda st, t, p: nnx.merge(graphdef, st)(t, p))(
        state, spec, spec
    ).out_avals
    assert out.shape == (2, 5, cfg.vocab_size) and out.dtype == jnp.float32


def test_decoder_lm_is_a_plain_contract_model() -> None:
    """No cache arguments anywhere: the model and its blocks take only the contract's arrays."""
    cfg = preset("tiny")
    model = init_model(cfg)
    assert list(inspect.signature(model.__call__).parameters) == [
        "tokens", "positions", "segment_ids",
    ]
    for mod in (model.layers[0], model.layers[0].attn):
        assert list(inspect.signature(mod.__call__).parameters) == [
            "x", "positions", "segment_ids",
        ]
    info = check_model(model)
    assert (info.vocab_size, info.logits_dtype, info.name) == (cfg.vocab_size, "float32",
                                                               "DecoderLM")


# --------------------------------------------------------------------------- cache equivalence


PATTERN_STACKS = {
    "causal": (Causal(), Causal()),
    "window3": (Window(3), Window(3)),
    "block4": (Block(4), Block(4)),
    "linear": (Linear(), Linear()),
    "mixed": LMConfig.mixed(3).layer_patterns(),
}


def _check_incremental(model: nnx.Module, tokens: np.ndarray, prefill: int) -> tuple[Any, ...]:
    """Prefill ``prefill`` tokens, then decode one at a time through the external caches;
    compare every step's logits with the plain full forward. Returns the final caches."""
    b, t = tokens.shape
    pos = np.tile(np.arange(t, dtype=np.int32), (b, 1))
    full = np.asarray(_jit_forward(model)(tokens, pos))
    max_len = t + 2  # 2 spare slots stay empty (masked)
    lg, caches = _jit_cached(model, b, prefill, max_len)(tokens[:, :prefill], pos[:, :prefill],
                                                         None, 0)
    np.testing.assert_allclose(np.asarray(lg), full[:, :prefill], atol=TOL, rtol=TOL)
    step = _jit_cached(model, b, 1, max_len)
    for i in range(prefill, t):
        lg, caches = step(tokens[:, i : i + 1], pos[:, i : i + 1], caches, i)
        np.testing.assert_allclose(np.asarray(lg[:, 0]), full[:, i], atol=TOL, rtol=TOL)
    for c in caches:  # every token written once at its own slot; the spare slots untouched
        np.testing.assert_array_equal(np.asarray(c.pos[:, :t]), pos)
        assert (np.asarray(c.pos[:, t:]) == -1).all()
    return caches


@pytest.mark.parametrize("name", list(PATTERN_STACKS))
def test_incremental_decode_matches_full_forward(name: str) -> None:
    cfg = preset("tiny", patterns=PATTERN_STACKS[name])
    model = init_model(cfg, seed=1)
    caches = _check_incremental(model, _tokens(2, 9, cfg.vocab_size, seed=2), prefill=3)
    assert len(caches) == cfg.n_layers


def test_incremental_decode_matches_full_forward_on_a_zoo_model() -> None:
    """The same check on a model written independently of DecoderLM (Gemma-2-like: interleaved
    Window/Causal GQA layers, attention and final soft-capping, einsum projections)."""
    model = zoo(seed=5)["gemmaish"]
    caches = _check_incremental(model, _tokens(2, 9, check_model(model).vocab_size, seed=6),
                                prefill=3)
    assert len(caches) == len(model.blocks)
    assert caches[0].k.shape == (2, 11, model.c.num_kv_heads, model.c.head_dim)


@pytest.mark.parametrize("n_kv_heads", [2, 1])
def test_gqa_matches_mha_with_repeated_kv(n_kv_heads: int) -> None:
    """GQA query head h reads kv head h // (Hq // Hkv): equal to MHA with kv weights repeated."""
    cfg = preset("tiny", n_heads=4, n_kv_heads=n_kv_heads)
    gqa = init_model(cfg, seed=3)
    mha = init_model(preset("tiny", n_heads=4, n_kv_heads=4), seed=4)
    g = cfg.n_heads // n_kv_heads
    _, gqa_state = nnx.split(gqa)
    _, mha_state = nnx.split(mha)
    mha_state = jax.tree.map(lambda x: x, mha_state)
    flat_g = dict(nnx.to_flat_state(gqa_state))
    new = {}
    for path, var in nnx.to_flat_state(mha_state):
        val = flat_g[path][...]
        if path[-2] in ("k_proj", "v_proj"):
            d = val.shape[0]
            val = jnp.repeat(val.reshape(d, n_kv_heads, cfg.head_dim), g, axis=1)
            val = val.reshape(d, cfg.n_heads * cfg.head_dim)
        new[path] = var.replace(val)
    nnx.update(mha, nnx.from_flat_state(new))

    tok = _tokens(2, 7, cfg.vocab_size, seed=5)
    pos = np.tile(np.arange(7, dtype=np.int32), (2, 1))
    np.testing.assert_allclose(
        np.asarray(_jit_forward(gqa)(tok, pos)), np.asarray(_jit_forward(mha)(tok, pos)),
        atol=TOL, rtol=TOL,
    )
    if n_kv_heads == 1:  # n_kv_heads=2 caches are covered by the pattern tests above
        _check_incremental(gqa, tok, prefill=2)


# --------------------------------------------------------------------------- padding and packing


def test_left_padded_batch_matches_each_prompt_alone() -> None:
    cfg = preset("tiny", patterns=LMConfig.mixed(2).layer_patterns())
    model = init_model(cfg, seed=6)
    fwd = _jit_forward(model)
    rng = np.random.default_rng(7)
    lens = [2, 6, 4]
    prompts = [rng.integers(0, cfg.vocab_size, n).astype(np.int32) for n in lens]
    p = max(lens)
    tok = np.zeros((3, p), np.int32)
    pos = np.full((3, p), -1, np.int32)
    for i, pr in enumerate(prompts):
        tok[i, p - pr.size :] = pr
        pos[i, p - pr.size :] = np.arange(pr.size)
    # Garbage in pad slots must not matter: positions -1 mask them.
    tok[0, 0] = 17
    batch = np.asarray(fwd(tok, pos))
    right = np.asarray(
        nnx.jit(padded_forward)(
            model, jnp.asarray(np.stack([np.pad(pr, (0, p - pr.size)) for pr in prompts])),
            jnp.asarray(lens),
        )
    )
    for i, pr in enumerate(prompts):
        alone = np.asarray(fwd(pr[None], np.arange(pr.size, dtype=np.int32)[None]))[0]
        np.testing.assert_allclose(batch[i, p - pr.size :], alone, atol=TOL, rtol=TOL)
        np.testing.assert_allclose(right[i, : pr.size], alone, atol=TOL, rtol=TOL)


def test_packed_segments_match_separate_sequences() -> None:
    """Two sequences in one row (segment ids 0/1, positions restarting) = each run alone."""
    cfg = preset("tiny", patterns=(Window(3), Block(2)))
    model = init_model(cfg, seed=8)
    fwd = _jit_forward(model)
    a, b = _tokens(1, 5, cfg.vocab_size, 9)[0], _tokens(1, 3, cfg.vocab_size, 10)[0]
    tok = np.concatenate([a, b])[None]
    pos = np.concatenate([np.arange(5), np.arange(3)]).astype(np.int32)[None]
    seg = np.array([[0] * 5 + [1] * 3], np.int32)
    packed = np.asarray(fwd(tok, pos, seg))[0]
    for x, sl in ((a, slice(0, 5)), (b, slice(5, 8))):
        alone = np.asarray(fwd(x[None], np.arange(x.size, dtype=np.int32)[None]))[0]
        np.testing.assert_allclose(packed[sl], alone, atol=TOL, rtol=TOL)


def test_padded_logprob_gradients_ignore_padding() -> None:
    """The gradient oracle: pad-slot contents change neither log-probs nor gradients."""
    cfg = preset("tiny")
    model = init_model(cfg, seed=11)
    tok = _tokens(2, 6, cfg.vocab_size, 12)
    lens = np.array([6, 3], np.int32)
    tok2 = tok.copy()
    tok2[1, 3:] = (tok2[1, 3:] + 5) % cfg.vocab_size

    @nnx.jit
    def loss_and_grad(m, t):
        return nnx.value_and_grad(lambda m_: padded_token_logprobs(m_, t, lens).sum())(m)

    l1, g1 = loss_and_grad(model, jnp.asarray(tok))
    l2, g2 = loss_and_grad(model, jnp.asarray(tok2))
    np.testing.assert_allclose(float(l1), float(l2), atol=TOL)
    for x, y in zip(jax.tree.leaves(g1), jax.tree.leaves(g2), strict=True):
        assert np.isfinite(np.asarray(x)).all()
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=TOL)


# --------------------------------------------------------------------------- symbolic shapes


def test_forward_traces_with_symbolic_shapes() -> None:
    cfg = preset("tiny", patterns=(Window(3), Linear()))
    model = init_model(cfg)
    graphdef, state = nnx.split(model)

    def f(params, tokens, positions, segment_ids):
        return nnx.merge(graphdef, params)(tokens, positions, segment_ids)

    b, t = jax.export.symbolic_shape("B, T")
    spec = jax.ShapeDtypeStruct((b, t), jnp.int32)
    jaxpr = jax.make_jaxpr(f)(state, spec, spec, spec)
    (out,) = jaxpr.out_avals
    assert out.shape == (b, t, cfg.vocab_size) and out.dtype == jnp.float32
    prims = [e.primitive.name for e in jaxpr.jaxpr.eqns]
    assert prims.count("sym_attention") == cfg.n_layers
    # Nothing in the top-level program reduces or scans over the sequence axis.
    assert not {"cumsum", "cumlogsumexp", "pad", "dynamic_slice"} & set(prims)
