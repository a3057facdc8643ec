"""Models that are not ``DecoderLM`` through the symbolic runtime, against oracles that share no
code with it: ``naive_generate`` (re-run the whole sequence each step) and the plain forward.

The zoo (``tests/zoo.py``) covers learned positions + LayerNorm/bias + fused QKV unstacked
(GPT-2), stacked layers under ``lax.scan``, one shared block under ``fori_loop``, and interleaved
window/full GQA with parallel blocks and logit soft-capping (Gemma-2-like).
"""

from __future__ import annotations

from functools import cache

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax
from zoo import naive_generate, zoo

from jaxrl_sym import Causal, attend
from jaxrl_sym.baselines.padded import padded_generate
from jaxrl_sym.errors import InputError, UnsupportedPrimitiveError
from jaxrl_sym.generation import GenerationConfig
from jaxrl_sym.models.contract import check_model
from jaxrl_sym.runtime.engine import SymbolicLM
from jaxrl_sym.runtime.options import EngineOptions
from jaxrl_sym.runtime.programs import DecodeRows

# engines and trainers here rebuild the same programs (no test counts compiles): compile once
pytestmark = pytest.mark.share_compiles
NAMES = ("gpt2", "scan", "shared", "gemmaish")


@cache
def engine(name: str) -> tuple[nnx.Module, SymbolicLM]:
    model = zoo()[name]
    # compact_min_rows=1: these batches are small, and compaction must still be exercised
    return model, SymbolicLM(model, EngineOptions(min_capacity=4, compact_min_rows=1))


@pytest.mark.parametrize("name", NAMES)
def test_greedy_generation_equals_rerunning_the_model(name: str) -> None:
    model, eng = engine(name)
    prompts = [np.array([1, 2, 3], np.int32), np.array([4, 5, 6, 7, 8, 9], np.int32),
               np.array([7], np.int32)]
    limits = (11, 5, 8)  # growth past min_capacity, windows wrapping, rows ending apart
    res = eng.generate(prompts, GenerationConfig(max_new_tokens=limits, return_logits=True))
    for p, toks, logits, n in zip(prompts, res.tokens, res.logits, limits, strict=True):
        want, want_logits = naive_generate(model, p, n)
        np.testing.assert_array_equal(toks, want)
        np.testing.assert_allclose(np.asarray(logits), want_logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", NAMES)
def test_repeated_prompts_are_computed_once_and_sampled_per_row(name: str) -> None:
    """A GRPO batch (each prompt G times): the prefill computes each distinct prompt once and
    copies its store rows; greedy rows equal the naive re-run, sampled rows the padded
    baseline's (same per-row random streams), so copies of one prompt sample apart."""
    model, eng = engine(name)
    distinct = [np.array([3, 1, 4, 1, 5], np.int32), np.array([9, 2], np.int32)]
    prompts = [distinct[i] for i in (0, 1, 0, 0, 1, 0)]
    limits = (7, 9, 7, 5, 9, 8)
    res = eng.generate(prompts, GenerationConfig(max_new_tokens=limits))
    for p, toks, n in zip(prompts, res.tokens, limits, strict=True):
        np.testing.assert_array_equal(toks, naive_generate(model, p, n)[0])
    assert res.stats["needed_positions"] == 5 + 2 + sum(n - 1 for n in limits)
    cfg = GenerationConfig(max_new_tokens=limits, temperature=1.0, seed=11)
    sym, pad = eng.generate(prompts, cfg), padded_generate(model, prompts, cfg)
    for a, b in zip(sym.tokens, pad.tokens, strict=True):
        np.testing.assert_array_equal(a, b)
    assert any(not np.array_equal(sym.tokens[0], sym.tokens[i]) for i in (2, 3, 5))


def _nll(logits: jax.Array, tokens: jax.Array, valid: jax.Array) -> jax.Array:
    lp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    tgt = jnp.take_along_axis(lp, tokens[:, 1:, None], axis=-1)[..., 0]
    return -jnp.sum(jnp.where(valid[:, 1:], tgt, 0.0))


@pytest.mark.parametrize("name", NAMES)
def test_packed_forward_logits_and_grads_equal_the_plain_model(name: str) -> None:
    """Two sequences packed end to end in one row (segments 0 and 1) vs each run alone."""
    model, eng = engine(name)
    rng = np.random.default_rng(1)
    vocab = check_model(model).vocab_size
    seqs = [rng.integers(0, vocab, n).astype(np.int32) for n in (5, 7)]
    tokens = jnp.asarray(np.concatenate(seqs))[None]
    positions = jnp.asarray(np.concatenate([np.arange(len(s)) for s in seqs]), jnp.int32)[None]
    segs = jnp.asarray(np.repeat([0, 1], [len(s) for s in seqs]), jnp.int32)[None]
    graphdef, state = nnx.split(model)
    leaves, treedef = jax.tree_util.tree_flatten(state)
    fwd = eng.forward_fn()

    # a target counts when it continues its predecessor's sequence (same segment)
    same = jnp.concatenate([jnp.ones((1, 1), bool), segs[:, 1:] == segs[:, :-1]], axis=1)

    def packed_loss(lv):
        return _nll(fwd(lv, tokens, positions, segs), tokens, same)

    def plain_loss(lv):
        m = nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, lv))
        total = 0.0
        for s in seqs:
            t = jnp.asarray(s)[None]
            pos = jnp.arange(len(s), dtype=jnp.int32)[None]
            total = total + _nll(m(t, pos, jnp.zeros_like(pos)), t, jnp.ones_like(t, bool))
        return total

    packed_logits = np.asarray(fwd(leaves, tokens, positions, segs))[0]
    plain = nnx.jit(lambda m, t, p: m(t, p, jnp.zeros_like(p)))  # not one compile an operation
    start = 0
    for s in seqs:
        pos = jnp.arange(len(s), dtype=jnp.int32)[None]
        alone = np.asarray(plain(model, jnp.asarray(s)[None], pos))[0]
        np.testing.assert_allclose(packed_logits[start:start + len(s)], alone, atol=1e-5)
        start += len(s)
    # jitted (one compile each; eager differentiation compiled every operation, ~20 s a model)
    v1, g1 = jax.jit(jax.value_and_grad(packed_loss))(leaves)
    v2, g2 = jax.jit(jax.value_and_grad(plain_loss))(leaves)
    np.testing.assert_allclose(v1, v2, rtol=1e-5)
    assert max(float(jnp.abs(g).max()) for g in g2) > 1e-3  # not vacuous
    for a, b in zip(g1, g2, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)


# --------------------------------------------------------------------------- refused, by line


class _WhileLM(nnx.Module):
    def __init__(self) -> None:
        self.emb = nnx.Embed(11, 8, rngs=nnx.Rngs(0))

    def __call__(self, tokens, positions, segment_ids):
        x = self.emb(tokens)
        b, t, d = x.shape

        def body(carry):
            i, h = carry
            q = h.reshape(b, t, 2, d // 2)
            o = attend(q, q, q, Causal(), q_positions=positions, kv_positions=positions)
            return i + 1, h + o.reshape(b, t, d)

        n = jnp.sum(tokens[0, :1])  # a trip count only known at run time
        _, x = lax.while_loop(lambda c: c[0] < n, body, (0, x))
        return x @ self.emb.embedding[...].T


class _CondLM(_WhileLM):
    def __call__(self, tokens, positions, segment_ids):
        x = self.emb(tokens)
        b, t, d = x.shape
        q = x.reshape(b, t, 2, d // 2)
        o = lax.cond(tokens[0, 0] > 3,
                     lambda: attend(q, q, q, Causal(), q_positions=positions,
                                    kv_positions=positions), lambda: q)
        return o.reshape(b, t, d) @ self.emb.embedding[...].T


@pytest.mark.parametrize("model, what", [(_WhileLM, "while_loop"), (_CondLM, "lax.cond")])
def test_dynamic_control_flow_around_attend_is_refused_with_the_users_line(model, what) -> None:
    with pytest.raises(UnsupportedPrimitiveError, match=what) as err:
        SymbolicLM(model())
    assert "test_contract.py" in str(err.value)


class _TwoArgs(nnx.Module):
    def __call__(self, tokens, positions):
        return jnp.zeros((*tokens.shape, 5))


class _ReturnsTuple(nnx.Module):
    def __call__(self, tokens, positions, segment_ids):
        return jnp.zeros((*tokens.shape, 5)), None


@pytest.mark.parametrize("model, msg", [(_TwoArgs, "cannot be called as model"),
                                        (_ReturnsTuple, "not one logits array")])
def test_a_model_breaking_the_contract_gets_a_sentence_about_it(model, msg) -> None:
    with pytest.raises(InputError, match=msg) as err:
        check_model(model())
    assert "_TwoArgs" in str(err.value) or "_ReturnsTuple" in str(err.value)


def test_soft_capped_model_on_the_triton_backend_equals_rerunning_it() -> None:
    """The Gemma-2-like model caps attention logits: the runtime's Triton decode kernel (the
    interpreter on CPU) must apply the cap exactly as the model's own forward does."""
    model = zoo()["gemmaish"]
    eng = SymbolicLM(model, EngineOptions(min_capacity=4, backend="triton", compact_min_rows=1))
    assert {s.softcap for s in eng.specs.values()} == {0.5}
    prompt = np.array([3, 1, 4, 1, 5], np.int32)
    res = eng.generate([prompt], GenerationConfig(max_new_tokens=6, return_logits=True))
    want, want_logits = naive_generate(model, prompt, 6)
    np.testing.assert_array_equal(res.tokens[0], want)
    np.testing.assert_allclose(np.asarray(res.logits[0]), want_logits, atol=1e-4, rtol=0)


class _ScannedMLPs(nnx.Module):
    """Attention in a Python loop, but the MLPs stacked and applied by lax.scan with no attend
    inside: read as a call, the scan's body would apply one MLP instead of three."""

    def __init__(self) -> None:
        r = nnx.Rngs(4)
        self.emb = nnx.Embed(29, 16, rngs=r)
        self.mlps = nnx.Param(nnx.initializers.normal(0.3)(r.params(), (3, 16, 16)))

    def __call__(self, tokens, positions, segment_ids):
        x = self.emb(tokens)
        b, t, d = x.shape
        q = x.reshape(b, t, 2, d // 2)
        x = x + attend(q, q, q, Causal(), q_positions=positions, kv_positions=positions,
                       q_segment_ids=segment_ids, kv_segment_ids=segment_ids).reshape(b, t, d)
        x, _ = lax.scan(lambda h, w: (h + jnp.tanh(h @ w), None), x, self.mlps[...])
        return x @ self.emb.embedding[...].T


def test_a_static_scan_without_attend_applies_every_iteration() -> None:
    model = _ScannedMLPs()
    res = SymbolicLM(model, EngineOptions(min_capacity=4, compact_min_rows=1)).generate(
        [np.array([1, 2, 3], np.int32)], GenerationConfig(max_new_tokens=6, return_logits=True))
    want, want_logits = naive_generate(model, np.array([1, 2, 3], np.int32), 6)
    np.testing.assert_array_equal(res.tokens[0], want)
    np.testing.assert_allclose(np.asarray(res.logits[0]), want_logits, atol=1e-4, rtol=0)


class _VmappedRows(nnx.Module):
    """Attention written per row and vmapped over the batch (a common JAX style)."""

    def __init__(self) -> None:
        r = nnx.Rngs(6)
        self.emb = nnx.Embed(31, 16, rngs=r)
        self.qkv = nnx.Linear(16, 48, rngs=r)

    def __call__(self, tokens, positions, segment_ids):
        x = self.emb(tokens)
        b, t, d = x.shape

        def one_row(h, pos, seg):  # h [T, D]
            q, k, v = (z.reshape(1, t, 2, d // 2) for z in jnp.split(self.qkv(h), 3, -1))
            return attend(q, k, v, Causal(), q_positions=pos[None], kv_positions=pos[None],
                          q_segment_ids=seg[None], kv_segment_ids=seg[None])[0]

        o = jax.vmap(one_row)(x, positions, segment_ids)
        return (x + o.reshape(b, t, d)) @ self.emb.embedding[...].T


def test_vmap_over_attend_keeps_the_primitive_and_generates_exactly() -> None:
    model = _VmappedRows()
    prompts = [np.array([1, 2, 3], np.int32), np.array([5, 9], np.int32)]
    res = SymbolicLM(model, EngineOptions(min_capacity=4, compact_min_rows=1)).generate(
        prompts, GenerationConfig(max_new_tokens=(7, 4), return_logits=True))
    for p, toks, logits, n in zip(prompts, res.tokens, res.logits, (7, 4), strict=True):
        want, want_logits = naive_generate(model, p, n)
        np.testing.assert_array_equal(toks, want)
        np.testing.assert_allclose(np.asarray(logits), want_logits, atol=1e-4, rtol=0)


def test_vmap_of_attend_with_unmapped_operands_equals_a_loop() -> None:
    rng = np.random.default_rng(3)
    q = jnp.asarray(rng.standard_normal((3, 1, 5, 2, 4)), jnp.float32)  # mapped on axis 0
    kv = jnp.asarray(rng.standard_normal((1, 5, 1, 4)), jnp.float32)  # shared by every call
    pos = jnp.arange(5, dtype=jnp.int32)[None]
    f = lambda q1, k1: attend(q1, k1, k1, Causal(), q_positions=pos, kv_positions=pos)
    got = jax.vmap(f, in_axes=(0, None))(q, kv)
    want = jnp.stack([f(q[i], kv) for i in range(3)])
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6)
    jaxpr = jax.make_jaxpr(jax.vmap(f, in_axes=(0, None)))(q, kv)
    assert "sym_attention" in str(jaxpr)  # still the primitive: the runtime can plan a store


def test_the_feedback_edge_is_a_slot_store_the_step_program_reads() -> None:
    """``tok[t] = sample(logits[t-1])`` is planned as a slot store and *that* store is what the
    decode program reads: plant a token in it and the step's logits are the model's on the
    prompt followed by that token (not on the token the prefill sampled); the step's own sample
    is written back to it for the next step."""
    from jaxrl_sym.passes.stores import SLOT, SlotStore

    model = zoo()["gpt2"]
    lm = SymbolicLM(model, EngineOptions(min_capacity=8, compact_min_rows=1))
    (tokens_id,) = lm.builder.slots
    assert tokens_id == lm.pdg.input_id("tokens")
    assert [s.kind for s in lm.plan.stores].count(SLOT) == 1
    slot = lm.builder.slots[tokens_id]
    assert isinstance(slot.kind, SlotStore) and slot.lag == 1
    assert lm.pdg.node(slot.source).op == "sample"

    prompt = np.array([[5, 9, 2]], np.int32)
    pos = np.arange(3, dtype=np.int32)[None]
    hoisted, seed, rows = lm._hoist(), jnp.uint32(0), jnp.zeros((1,), jnp.int32)
    kw = dict(temperature=0.0, want_logits=True)
    stores = lm.builder.init_stores(1, 8)
    assert stores[str(tokens_id)]["tok"].shape == (1, 1)
    stores, tok0, _, _ = lm.builder.prefill(hoisted, stores, jnp.asarray(prompt),
                                            jnp.asarray(pos), rows, seed, chunk=3, **kw)
    assert int(stores[str(tokens_id)]["tok"][0, 0]) == int(tok0[0])
    planted = (int(tok0[0]) + 7) % 47
    stores[str(tokens_id)] = {"tok": jnp.full((1, 1), planted, jnp.int32)}
    one = DecodeRows(pos0=jnp.asarray([3], jnp.int32), row_id=rows, off=rows, last=rows)
    stores, tok1, _, logits = lm.builder.decode(hoisted, stores, one, jnp.int32(1), jnp.int32(3),
                                                seed, **kw)
    seq = jnp.asarray([[5, 9, 2, planted]], jnp.int32)
    want = model(seq, jnp.arange(4, dtype=jnp.int32)[None], jnp.zeros_like(seq))[0, -1]
    np.testing.assert_allclose(np.asarray(logits[0]), np.asarray(want), atol=1e-4, rtol=0)
    assert int(stores[str(tokens_id)]["tok"][0, 0]) == int(tok1[0]) == int(np.argmax(want))
