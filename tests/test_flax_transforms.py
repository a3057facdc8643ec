"""Models built with Flax's own transforms (issue 29): ``nnx.remat`` per layer, layers created
with ``nnx.vmap`` and applied with ``nnx.scan`` (Flax's scan-over-layers recipe), and heads
mapped with ``nnx.vmap``. The contract check used to close over the model inside
``jax.eval_shape`` and died with Flax's "different trace level" error; now each passes the
check and generates exactly what re-running the plain model greedily gives (``naive_generate``,
no shared interpreter) and what the padded baseline gives."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from zoo import GPTBlock, GPTConfig, naive_generate

from jaxrl_sym import Causal, GenerationConfig, SymbolicLM, attend, check_model, padded_generate

C = GPTConfig(n_layer=3)


class _Embed(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.wte = nnx.Embed(C.vocab, C.n_embd, rngs=rngs)
        self.wpe = nnx.Embed(C.block_size, C.n_embd, rngs=rngs)
        self.lm_head = nnx.Linear(C.n_embd, C.vocab, use_bias=False, rngs=rngs)

    def embed(self, tokens: jax.Array, positions: jax.Array) -> jax.Array:
        return self.wte(tokens) + self.wpe(jnp.maximum(positions, 0))


class RematLM(_Embed):
    """Every layer under ``nnx.remat`` (activation checkpointing)."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        super().__init__(rngs)
        self.h = nnx.List([GPTBlock(C, rngs) for _ in range(C.n_layer)])

    def __call__(self, tokens, positions, segment_ids):
        x = self.embed(tokens, positions)
        for blk in self.h:
            x = nnx.remat(lambda b, x, p, s: b(x, p, s))(blk, x, positions, segment_ids)
        return self.lm_head(x)


class ScanLM(_Embed):
    """Layers created by ``nnx.vmap`` (stacked parameters) and applied by ``nnx.scan``."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        super().__init__(rngs)

        @nnx.split_rngs(splits=C.n_layer)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create(r: nnx.Rngs) -> GPTBlock:
            return GPTBlock(C, r)

        self.blocks = create(rngs)

    def __call__(self, tokens, positions, segment_ids):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def body(x, blk):
            return blk(x, positions, segment_ids)

        return self.lm_head(body(self.embed(tokens, positions), self.blocks))


class VmapHeadsLM(_Embed):
    """Per-head query/key/value projections mapped over the heads with ``nnx.vmap``."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        super().__init__(rngs)
        h, d = C.n_head, C.n_embd // C.n_head

        @nnx.split_rngs(splits=h)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create(r: nnx.Rngs) -> nnx.Linear:
            return nnx.Linear(C.n_embd, 3 * d, rngs=r)

        self.qkv = create(rngs)
        self.out = nnx.Linear(C.n_embd, C.n_embd, rngs=rngs)

    def __call__(self, tokens, positions, segment_ids):
        x = self.embed(tokens, positions)

        @nnx.vmap(in_axes=(0, None), out_axes=2)
        def project(lin, x):
            return lin(x)

        qkv = project(self.qkv, x)  # [B, T, H, 3d]
        q, k, v = jnp.split(qkv, 3, axis=-1)
        y = attend(q, k, v, Causal(), q_positions=positions, kv_positions=positions,
                   q_segment_ids=segment_ids, kv_segment_ids=segment_ids)
        b, t = tokens.shape
        return self.lm_head(x + self.out(y.reshape(b, t, C.n_embd)))


MODELS = {"remat": RematLM, "scan": ScanLM, "vmap": VmapHeadsLM}


@pytest.mark.parametrize("name", MODELS)
def test_flax_transform_models_check_and_generate_like_the_plain_model(name: str) -> None:
    model = MODELS[name](nnx.Rngs(0))
    assert check_model(model).vocab_size == C.vocab
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, C.vocab, n).astype(np.int32) for n in (3, 7, 1)]
    cfg = GenerationConfig(max_new_tokens=(6, 4, 9))
    sym = SymbolicLM(model).generate(prompts, cfg)
    pad = padded_generate(model, prompts, cfg)
    for i, p in enumerate(prompts):
        want, _ = naive_generate(model, p, cfg.max_new_tokens[i])
        np.testing.assert_array_equal(sym.tokens[i], want, err_msg=f"{name} row {i}")
        np.testing.assert_array_equal(pad.tokens[i], want, err_msg=f"{name} padded row {i}")
