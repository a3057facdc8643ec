"""Packed prefill against the block prefill it replaces: same stores, same first tokens.

The block prefill (the right-aligned ``[rows, prompt block]`` rectangle, itself checked against
the padded baseline and a naive re-run elsewhere) is the oracle: after the packed prefill every
store must hold the same keys, values and positions in every slot the block prefill filled
(ring/block stores: the same last slots; linear: the same recurrent state), and the sampled
token 0 and its log-prob must agree. Packing rows are kept short and the logits budget tiny so
prompts share rows, straddle nothing, and the chunked scan over packed rows runs.
"""

from __future__ import annotations

from dataclasses import replace
from functools import cache

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxrl_sym.models.lm import DecoderLM, preset
from jaxrl_sym.ops.attention import Block, Causal, Linear, Window
from jaxrl_sym.runtime.engine import SymbolicLM
from jaxrl_sym.runtime.options import EngineOptions
from jaxrl_sym.runtime.packing import PackedPrompts
from jaxrl_sym.runtime.policy import GroupShape
from jaxrl_sym.runtime.prefill import packed_prefill

PATTERNS = {"full": (Causal(), Causal()), "window": (Window(3), Causal()),
            "block": (Block(4), Block(4)), "linear": (Linear(), Window(5))}


@cache
def engine(kind: str) -> SymbolicLM:
    cfg = replace(preset("tiny"), patterns=PATTERNS[kind])
    return SymbolicLM(DecoderLM(cfg, rngs=nnx.Rngs(1)), EngineOptions(min_capacity=4))


@settings(max_examples=8, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(sorted(PATTERNS)),
       lens=st.lists(st.integers(1, 11), min_size=1, max_size=5),
       filler=st.integers(0, 2), pack_row=st.sampled_from([6, 12, 64]),
       temperature=st.sampled_from([0.0, 1.0]), copies=st.integers(1, 3))
def test_packed_prefill_fills_the_stores_the_block_prefill_fills(kind, lens, filler, pack_row,
                                                                 temperature, copies) -> None:
    """``copies``: each prompt appears that many times (shuffled), as a GRPO group's samples;
    the packed prefill computes it once and copies its store rows, the block prefill every row."""
    lm = engine(kind)
    rng = np.random.default_rng(sum(lens) + filler)
    distinct = [rng.integers(1, 60, n).astype(np.int32) for n in lens]
    prompts = [distinct[i] for i in rng.permutation(np.repeat(np.arange(len(lens)), copies))]
    lens = [len(p) for p in prompts]
    shape = GroupShape.plan(lens, [4] * len(lens), min_capacity=4)
    rows, pcap = len(lens) + filler, shape.prompt_slots
    cap = shape.capacity
    slotted = [*prompts, *([None] * filler)]
    hoisted, seed = lm._hoist(), jnp.uint32(7)
    row_ids = jnp.arange(rows, dtype=jnp.int32)
    kw = dict(temperature=temperature, want_logits=True)

    tok_in = np.zeros((rows, pcap), np.int32)
    pos_in = np.full((rows, pcap), -1, np.int32)
    for i, p in enumerate(prompts):
        tok_in[i, pcap - len(p):] = p
        pos_in[i, pcap - len(p):] = np.arange(len(p))
    # jitted like the packed prefill below (op by op, its many small programs cost more CPU)
    want_st, want_tok, want_lp, want_lg = jax.jit(
        lambda *a: lm.builder.prefill(*a, chunk=pcap, **kw))(
        hoisted, lm.builder.init_stores(rows, cap), jnp.asarray(tok_in), jnp.asarray(pos_in),
        row_ids, seed)

    pk = PackedPrompts.build(slotted, pcap, vocab=lm.vocab_size,
                             logits_bytes=4 * lm.vocab_size * 2 * 12, pack_row=pack_row)
    assert pk.tokens.shape[0] % pk.chunk_rows == 0
    first = {p.tobytes(): i for i, p in reversed(list(enumerate(prompts)))}
    assert pk.source[:len(prompts)].tolist() == [first[p.tobytes()] for p in prompts]
    assert pk.shared == (copies > 1 or len(first) < len(prompts))
    cp = pk.copies  # the other way round: every slot written exactly once, from its source
    assert sorted(cp[cp < len(cp)].tolist()) == list(range(len(cp)))
    assert all(i in cp[pk.source[i]] for i in range(len(cp)))
    assert sorted(pk.rows[pk.rows >= 0].tolist()) == sorted(  # each distinct prompt once
        i for i in first.values() for _ in range(lens[i]))
    got_st, got_tok, got_lp, got_lg = jax.jit(
        lambda *a: packed_prefill(lm.builder, *a, chunk_rows=pk.chunk_rows, **kw))(
        hoisted, lm.builder.init_stores(rows, cap), pk.tokens, pk.positions, pk.rows, pk.slots,
        pk.last, pk.copies, row_ids, seed)

    n = len(lens)  # filler rows' outputs are never read
    np.testing.assert_array_equal(np.asarray(got_tok)[:n], np.asarray(want_tok)[:n])
    np.testing.assert_allclose(np.asarray(got_lp)[:n], np.asarray(want_lp)[:n], atol=1e-5)
    np.testing.assert_allclose(np.asarray(got_lg)[:n], np.asarray(want_lg)[:n], atol=1e-5)
    for key, want in want_st.items():
        got = got_st[key]
        if "pos" in want:  # key/value stores: same positions everywhere, same entries where set
            wp, gp = np.asarray(want["pos"])[:n], np.asarray(got["pos"])[:n]
            np.testing.assert_array_equal(gp, wp)
            for a in ("k", "v"):  # heads-major [B, Hkv, C, D]: slots next to the rows
                w, g = (np.swapaxes(np.asarray(x[a])[:n], 1, 2) for x in (want, got))
                np.testing.assert_allclose(g[wp >= 0], w[wp >= 0], atol=1e-5)
        elif "S" in want:
            for a in ("S", "z"):
                np.testing.assert_allclose(np.asarray(got[a])[:n], np.asarray(want[a])[:n],
                                           atol=1e-4, rtol=1e-5)
        else:  # the feedback slot: token 0 of every real row
            np.testing.assert_array_equal(np.asarray(got["tok"])[:n], np.asarray(want["tok"])[:n])


def test_engine_packed_and_block_prefill_generate_the_same_and_log_their_waste() -> None:
    import pytest

    from jaxrl_sym.errors import InputError
    from jaxrl_sym.generation import GenerationConfig

    lm = engine("window")
    model = DecoderLM(replace(preset("tiny"), patterns=PATTERNS["window"]), rngs=nnx.Rngs(1))
    block = SymbolicLM(model, EngineOptions(min_capacity=4, prefill="block"))
    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, 60, n).astype(np.int32) for n in (2, 9, 5, 7, 3)]
    cfg = GenerationConfig(max_new_tokens=(6, 3, 9, 4, 7), return_logits=True)
    a, b = lm.generate(prompts, cfg), block.generate(prompts, cfg)
    for x, y, lx, ly in zip(a.tokens, b.tokens, a.logits, b.logits, strict=True):
        np.testing.assert_array_equal(x, y)
        np.testing.assert_allclose(lx, ly, atol=1e-5)
    assert a.stats["waste_by_cause"]["prompt_alignment"] == 0
    assert b.stats["waste_by_cause"]["prompt_alignment"] > 0
    assert a.stats["needed_positions"] == b.stats["needed_positions"]
    assert a.stats["token_positions"] < b.stats["token_positions"]
    with pytest.raises(InputError, match="prefill='rect'"):
        SymbolicLM(model, EngineOptions(prefill="rect"))
