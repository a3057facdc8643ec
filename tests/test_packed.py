"""Packed forward over exact-length sequences vs the padded forward: logits and gradients."""

from __future__ import annotations

from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl_sym.baselines.padded import padded_forward
from jaxrl_sym.models.lm import DecoderLM, preset
from jaxrl_sym.ops.attention import Block, Causal, Linear, Window
from jaxrl_sym.runtime.engine import PackedBatch, SymbolicLM

PATTERNS = [(Causal(), Causal()), (Window(3), Causal()), (Block(4), Linear())]


def _setup(patterns):
    cfg = replace(preset("tiny"), patterns=patterns)
    model = DecoderLM(cfg, rngs=nnx.Rngs(1))
    return model, SymbolicLM(model)


def _padded_batch(seqs):
    lens = np.array([len(s) for s in seqs])
    toks = np.zeros((len(seqs), lens.max()), np.int32)
    for i, s in enumerate(seqs):
        toks[i, : len(s)] = s
    return toks, lens


def _nll_padded(model, seqs):
    graphdef, state = nnx.split(model)
    toks, lens = _padded_batch(seqs)

    def loss(st):
        m = nnx.merge(graphdef, st)
        logits = padded_forward(m, jnp.asarray(toks), jnp.asarray(lens))
        lp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
        tgt = jnp.take_along_axis(lp, jnp.asarray(toks)[:, 1:, None], axis=-1)[..., 0]
        mask = jnp.arange(toks.shape[1] - 1)[None] < (jnp.asarray(lens)[:, None] - 1)
        per_seq = jnp.sum(jnp.where(mask, tgt, 0.0), axis=1) / jnp.maximum(lens - 1, 1)
        return -jnp.mean(per_seq)

    return jax.jit(jax.value_and_grad(loss))(state)  # eager would compile every op


def _nll_packed(engine, model, seqs):
    _, state = nnx.split(model)
    leaves, treedef = jax.tree_util.tree_flatten(state)
    pb = PackedBatch.build(seqs)
    fwd = engine.forward_fn()
    # next-token targets within each segment, on the packed layout
    nxt = np.zeros_like(pb.tokens)
    valid = np.zeros(pb.tokens.shape, bool)
    weight = np.zeros(pb.tokens.shape, np.float32)
    for (r, s, n) in pb.where:
        nxt[r, s:s + n - 1] = pb.tokens[r, s + 1:s + n]
        valid[r, s:s + n - 1] = True
        weight[r, s:s + n - 1] = 1.0 / max(n - 1, 1)

    def loss(lv):
        logits = fwd(lv, pb.tokens, pb.positions, pb.segment_ids)
        lp = jax.nn.log_softmax(logits, axis=-1)
        tgt = jnp.take_along_axis(lp, jnp.asarray(nxt)[..., None], axis=-1)[..., 0]
        return -jnp.sum(jnp.where(valid, tgt * weight, 0.0)) / len(seqs)

    val, g = jax.jit(jax.value_and_grad(loss))(leaves)
    return val, jax.tree_util.tree_unflatten(treedef, g)


@pytest.mark.parametrize("patterns", PATTERNS, ids=["full", "window+full", "block+linear"])
def test_packed_logits_match_padded(patterns) -> None:
    model, engine = _setup(patterns)
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 64, size=n).astype(np.int32) for n in (5, 1, 9, 3, 7)]
    packed = engine.packed_logits(seqs)
    toks, lens = _padded_batch(seqs)
    ref = np.asarray(padded_forward(model, jnp.asarray(toks), jnp.asarray(lens)))
    for i, s in enumerate(seqs):
        np.testing.assert_allclose(packed[i], ref[i, : len(s)], atol=1e-4, rtol=0)


@pytest.mark.parametrize("patterns", PATTERNS, ids=["full", "window+full", "block+linear"])
def test_gradients_through_packed_forward_equal_padded(patterns) -> None:
    model, engine = _setup(patterns)
    rng = np.random.default_rng(2)
    seqs = [rng.integers(0, 64, size=n).astype(np.int32) for n in (6, 2, 11, 4)]
    v_pad, g_pad = _nll_padded(model, seqs)
    v_pk, g_pk = _nll_packed(engine, model, seqs)
    np.testing.assert_allclose(v_pk, v_pad, atol=1e-5)
    for a, b in zip(jax.tree_util.tree_leaves(g_pk), jax.tree_util.tree_leaves(g_pad),
                    strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)


@settings(max_examples=25, deadline=None)
@given(lens=st.lists(st.integers(1, 40), min_size=1, max_size=12))
def test_packing_is_exact_and_tight(lens) -> None:
    seqs = [np.full(n, i % 7, np.int32) for i, n in enumerate(lens)]
    pb = PackedBatch.build(seqs)
    for i, s in enumerate(seqs):
        r, st_, n = pb.where[i]
        assert n == len(s)
        assert np.array_equal(pb.tokens[r, st_:st_ + n], s)
        assert np.array_equal(pb.positions[r, st_:st_ + n], np.arange(n))
        assert (pb.segment_ids[r, st_:st_ + n] == i).all()
    # no slot is used twice
    used = (pb.segment_ids >= 0).sum()
    assert used == sum(lens)
    assert pb.tokens.shape[1] < 2 * max(lens) + 8
    # flattened boundaries for the varlen kernel: every sequence is exactly one segment
    cu = pb.cu_seqlens.tolist()
    assert cu[0] == 0 and cu == sorted(cu) and cu[-1] == pb.tokens.size
    bounds = set(cu)
    for r, st_, n in pb.where:
        start = r * pb.tokens.shape[1] + st_
        assert start in bounds and start + n in bounds
        assert not any(start < b < start + n for b in bounds)


def test_packing_rejects_empty() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        PackedBatch.build([np.zeros(0, np.int32)])
