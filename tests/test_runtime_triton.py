"""The runtime's Triton backend (kernels for single-token decode) against the padded baseline.

On CPU the same kernel source runs under Triton's interpreter (slow, so sizes are tiny); on a
GPU it runs through jax-triton.
"""

from __future__ import annotations

import importlib.util
from dataclasses import replace

import numpy as np
import pytest
from flax import nnx

# find_spec, not importorskip: importing triton here would fix it in compiled mode before the
# backend can switch it to the interpreter (see jaxrl_sym.backends.launch).
if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

from jaxrl_sym.baselines.padded import padded_generate
from jaxrl_sym.errors import InputError
from jaxrl_sym.generation import GenerationConfig
from jaxrl_sym.models.lm import DecoderLM, preset
from jaxrl_sym.ops.attention import Block, Causal, Linear, Window
from jaxrl_sym.runtime.engine import SymbolicLM, resolve_backend
from jaxrl_sym.runtime.options import EngineOptions


def test_triton_backend_matches_padded_on_every_store_kind() -> None:
    cfg = replace(preset("tiny"), n_layers=4, patterns=(Causal(), Window(3), Block(4), Linear()))
    model = DecoderLM(cfg, rngs=nnx.Rngs(5))
    engine = SymbolicLM(model, EngineOptions(min_capacity=4, backend="triton", compact_min_rows=1))
    assert {s.backend for s in engine.specs.values()} == {"triton"}
    prompts = [np.arange(n, dtype=np.int32) * 5 % 64 for n in (2, 6, 3)]
    gcfg = GenerationConfig(max_new_tokens=(12, 4, 6), return_logits=True)
    sym = engine.generate(prompts, gcfg)
    pad = padded_generate(model, prompts, gcfg)
    for a, b, la, lb in zip(sym.tokens, pad.tokens, sym.logits, pad.logits, strict=True):
        assert np.array_equal(a, b)
        np.testing.assert_allclose(la, lb, atol=1e-4, rtol=0)
    # the growing store outgrew its first capacity (16 slots for an 8-token prompt bucket)
    assert any(k[0] == "grow" for k in engine.cache.compiled)


def test_triton_backend_refills_rows_on_every_store_kind() -> None:
    """Seven ragged prompts through 2 resident rows (refill: the growing store wraps over the
    finished sample's slots) on the Triton decode kernels, greedy, against the plain model
    re-run on the whole sequence. The kernel must read every slot of a wrapped store: its live
    count comes from the unwrapped write index (it once came from the wrapped one, and refilled
    rows attended to a few slots only)."""
    from zoo import naive_generate

    cfg = replace(preset("tiny"), n_layers=4, patterns=(Causal(), Window(3), Block(4), Linear()))
    model = DecoderLM(cfg, rngs=nnx.Rngs(7))
    engine = SymbolicLM(model, EngineOptions(min_capacity=4, backend="triton", compact_min_rows=1,
                                             microbatch_rows=2, refill=True))
    rng = np.random.default_rng(11)
    prompts = [rng.integers(1, 60, int(k)).astype(np.int32) for k in (5, 13, 1, 8, 3, 11, 6)]
    limits = (7, 2, 8, 5, 8, 1, 6)
    got = engine.generate(prompts, GenerationConfig(max_new_tokens=limits, return_logits=True))
    assert got.stats["groups"] == 1 and got.stats["key_slots"] > 0
    for i, (p, n) in enumerate(zip(prompts, limits, strict=True)):
        toks, rows = naive_generate(model, p, n)
        assert np.array_equal(got.tokens[i], toks), f"sample {i}: {got.tokens[i]} vs {toks}"
        np.testing.assert_allclose(got.logits[i], rows, atol=1e-4, rtol=0)


def test_backend_names() -> None:
    assert resolve_backend("xla") == "xla"
    assert resolve_backend("auto") in ("xla", "triton")
    with pytest.raises(InputError, match="choose 'xla', 'triton', 'pallas' or 'auto'"):
        resolve_backend("cuda")


def test_triton_packed_forward_logits_and_gradients_match_padded() -> None:
    import jax
    import jax.numpy as jnp

    from jaxrl_sym.baselines.padded import padded_forward
    from jaxrl_sym.runtime.engine import PackedBatch

    cfg = replace(preset("tiny"), patterns=(Window(3), Causal()))
    model = DecoderLM(cfg, rngs=nnx.Rngs(2))
    engine = SymbolicLM(model, EngineOptions(backend="triton", compact_min_rows=1))
    seqs = [np.arange(n, dtype=np.int32) * 3 % 64 for n in (5, 2, 7)]
    packed = engine.packed_logits(seqs)
    lens = np.array([len(s) for s in seqs])
    toks = np.zeros((3, lens.max()), np.int32)
    for i, s in enumerate(seqs):
        toks[i, : len(s)] = s
    ref = np.asarray(padded_forward(model, jnp.asarray(toks), jnp.asarray(lens)))
    for i, s in enumerate(seqs):
        np.testing.assert_allclose(packed[i], ref[i, : len(s)], atol=1e-4, rtol=0)
    # gradients through the kernels' custom_vjp equal those through the masked primitive
    pb = PackedBatch.build(seqs)
    fwd = engine.forward_fn()
    leaves = jax.tree_util.tree_leaves(nnx.split(model)[1])
    valid = jnp.asarray(pb.positions >= 0)

    def loss(lv, cu):
        out = fwd(lv, pb.tokens, pb.positions, pb.segment_ids, cu)
        return jnp.sum(jnp.where(valid[..., None], jax.nn.log_softmax(out), 0.0)[..., 1])

    g_kernel = jax.jit(jax.grad(loss))(leaves, jnp.asarray(pb.cu_seqlens))
    g_ref = jax.jit(jax.grad(loss), static_argnums=1)(leaves, None)
    for a, b in zip(g_kernel, g_ref, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4, rtol=0)
