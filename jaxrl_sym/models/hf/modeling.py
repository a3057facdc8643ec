"""Qwen2/Qwen2.5 and Llama 3.x decoders in Flax NNX, following the model contract.

Why these modules are not :class:`jaxrl_sym.models.lm.DecoderLM`: a checkpoint fixes details
that ``DecoderLM`` is free to choose, and logits only match transformers to 1e-4 if each is
reproduced — q/k/v biases (Qwen2), RMSNorm that normalises in float32 and multiplies the weight
*after* casting back (``weight * x.to(dtype)``), RoPE frequencies from the config (Llama 3.1
scaling), untied heads, a sliding window on some layers. The structure is the same pre-norm stack.

Module and attribute names mirror transformers' (``model.layers.0.self_attn.q_proj``), so a
checkpoint tensor name maps to a parameter path by a rule, not a table (:mod:`.loader`).

Contract: ``model(tokens, positions, segment_ids) -> logits`` (float32 ``[B, T, vocab]``); the
only sequence-mixing op is :func:`jaxrl_sym.attend`. RoPE angles come from ``positions``
(negative = padding, clamped to 0), never from the sequence index, so the same forward serves
left-padded batches, packed rows, one decode step and the tracer's symbolic-length program.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl_sym.models.hf.config import HFConfig
from jaxrl_sym.ops.attention import Pattern, attend


class RMSNorm(nnx.Module):
    """transformers' Llama/Qwen2 RMSNorm: normalise in float32, cast back, then scale.

    The order matters in bf16: ``weight * x.to(dtype)`` rounds before the multiply, which
    ``nnx.RMSNorm`` does not.
    """

    def __init__(self, dim: int, eps: float, dtype: jnp.dtype) -> None:
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        var = jnp.mean(xf * xf, axis=-1, keepdims=True)
        w = self.weight[...]
        return w * (xf * jax.lax.rsqrt(var + self.eps)).astype(w.dtype)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: tuple[float, ...]) -> jax.Array:
    """Rotate-half RoPE of x ``[B, T, H, D]`` at ``positions`` ``[B, T]``.

    Angles in float32 (transformers: ``inv_freq @ position_ids`` in float32); cos/sin are cast
    to x's dtype and the rotation done in that dtype, as transformers does, so bf16 matches too.
    """
    freqs = jnp.asarray(np.asarray(inv_freq, np.float32))
    pos = jnp.maximum(positions, 0).astype(jnp.float32)
    ang = pos[..., None, None] * freqs  # [B, T, 1, D/2]
    ang = jnp.concatenate([ang, ang], axis=-1)
    cos, sin = jnp.cos(ang).astype(x.dtype), jnp.sin(ang).astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def _linear(cfg: HFConfig, n_in: int, n_out: int, bias: bool) -> nnx.Linear:
    """A Linear in the checkpoint's dtype. Initial values never matter: loading replaces them
    (the loader builds the model under ``nnx.eval_shape``, so nothing is even allocated)."""
    return nnx.Linear(n_in, n_out, use_bias=bias, dtype=cfg.dtype, param_dtype=cfg.dtype,
                      rngs=nnx.Rngs(0))


class Attention(nnx.Module):
    """GQA self-attention; all sequence mixing is inside ``attend``."""

    def __init__(self, cfg: HFConfig, pattern: Pattern) -> None:
        self.cfg = cfg
        self.pattern = pattern
        d, hd = cfg.hidden_size, cfg.head_dim
        self.q_proj = _linear(cfg, d, cfg.num_heads * hd, cfg.qkv_bias)
        self.k_proj = _linear(cfg, d, cfg.num_kv_heads * hd, cfg.qkv_bias)
        self.v_proj = _linear(cfg, d, cfg.num_kv_heads * hd, cfg.qkv_bias)
        self.o_proj = _linear(cfg, cfg.num_heads * hd, d, cfg.o_bias)

    def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array) -> jax.Array:
        cfg = self.cfg
        q = self.q_proj(x).reshape(*x.shape[:2], cfg.num_heads, cfg.head_dim)
        k = self.k_proj(x).reshape(*x.shape[:2], cfg.num_kv_heads, cfg.head_dim)
        v = self.v_proj(x).reshape(*x.shape[:2], cfg.num_kv_heads, cfg.head_dim)
        q = apply_rope(q, positions, cfg.inv_freq)
        k = apply_rope(k, positions, cfg.inv_freq)
        out = attend(q, k, v, self.pattern, q_positions=positions, kv_positions=positions,
                     q_segment_ids=segment_ids, kv_segment_ids=segment_ids,
                     scale=cfg.head_dim ** -0.5)
        return self.o_proj(out.reshape(*out.shape[:2], cfg.num_heads * cfg.head_dim))


class MLP(nnx.Module):
    """SwiGLU: ``down_proj(silu(gate_proj(x)) * up_proj(x))``."""

    def __init__(self, cfg: HFConfig) -> None:
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = _linear(cfg, d, f, cfg.mlp_bias)
        self.up_proj = _linear(cfg, d, f, cfg.mlp_bias)
        self.down_proj = _linear(cfg, f, d, cfg.mlp_bias)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
    """Pre-norm block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, cfg: HFConfig, pattern: Pattern) -> None:
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype)
        self.self_attn = Attention(cfg, pattern)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype)
        self.mlp = MLP(cfg)

    def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array) -> jax.Array:
        x = x + self.self_attn(self.input_layernorm(x), positions, segment_ids)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nnx.Module):
    """transformers' ``model.*`` part: embedding, layers, final norm (hidden states out)."""

    def __init__(self, cfg: HFConfig) -> None:
        self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.hidden_size, dtype=cfg.dtype,
                                      param_dtype=cfg.dtype, rngs=nnx.Rngs(0))
        self.layers = nnx.List([DecoderLayer(cfg, p) for p in cfg.patterns])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype)

    def __call__(self, tokens: jax.Array, positions: jax.Array,
                 segment_ids: jax.Array) -> jax.Array:
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x, positions, segment_ids)
        return self.norm(x)


class CausalLM(nnx.Module):
    """A Qwen2 or Llama causal LM (``cfg.model_type``): hidden states → head → float32 logits.

    The head is the embedding matrix when ``tie_word_embeddings`` (no ``lm_head`` parameter
    exists then), else its own ``lm_head``. Logits are accumulated and returned in float32
    (``preferred_element_type``) without upcasting a bf16 head matrix, which at a 150k
    vocabulary would be a second, 4-byte copy of the largest weight.
    """

    def __init__(self, cfg: HFConfig) -> None:
        self.cfg = cfg
        self.model = DecoderModel(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = _linear(cfg, cfg.hidden_size, cfg.vocab_size, False)

    def __call__(self, tokens: jax.Array, positions: jax.Array,
                 segment_ids: jax.Array | None = None) -> jax.Array:
        """Logits ``[B, T, vocab]`` (float32) for int32 ``[B, T]`` tokens/positions/segments."""
        if segment_ids is None:
            segment_ids = jnp.zeros_like(positions)
        h = self.model(tokens, positions, segment_ids)
        if self.cfg.tie_word_embeddings:
            w = self.model.embed_tokens.embedding[...]
            return jnp.einsum("btd,vd->btv", h, w, preferred_element_type=jnp.float32)
        w = self.lm_head.kernel[...]
        return jnp.einsum("btd,dv->btv", h, w, preferred_element_type=jnp.float32)


def build_model(cfg: HFConfig) -> CausalLM:
    """A model with freshly initialised weights (tests, random-weight benchmarks)."""
    return CausalLM(cfg)


def abstract_model(cfg: HFConfig) -> CausalLM:
    """A model whose parameters are shapes only (``nnx.eval_shape``): nothing is allocated, so
    the loader can fill it one checkpoint tensor at a time."""
    return nnx.eval_shape(lambda: CausalLM(cfg))
