"""Qwen2/2.5, Qwen3, Llama 3.x, Mistral, Gemma 2 and Gemma 3 (text) decoders in Flax NNX.

Why these modules are not :class:`jaxrl_sym.models.lm.DecoderLM`: a checkpoint fixes details
that ``DecoderLM`` is free to choose, and logits only match transformers to 1e-4 if each is
reproduced — q/k/v biases (Qwen2), RMSNorm that normalises in float32 and multiplies the weight
*after* casting back (``weight * x.to(dtype)``; Gemma instead scales by ``1 + weight`` in float32
and casts last), q/k norms before RoPE (Qwen3, Gemma 3), RoPE frequencies from the config (Llama
3.1 and linear scaling, a second base for Gemma 3's local layers), untied heads, sliding windows
on some layers, Gemma's sandwich norms, GeGLU, scaled embedding and soft-caps. Every difference
is a field of :class:`HFConfig`, so there is one stack and no per-family class.

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
from jaxrl_sym.ops.attention import Pattern, Window, attend
from jaxrl_sym.ops.head import head_logits

_ACT = {
    "silu": jax.nn.silu,
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),  # torch gelu(approximate="tanh")
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
}


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


class GemmaRMSNorm(nnx.Module):
    """transformers' Gemma 2/3 RMSNorm: ``(norm(x.float()) * (1 + weight.float())).to(dtype)``.

    Two differences from :class:`RMSNorm`, both visible in bf16 and the first always: the
    stored weight is an offset from 1 (a zero weight is the identity scale), and the multiply
    happens in float32 before the single cast back.
    """

    def __init__(self, dim: int, eps: float, dtype: jnp.dtype) -> None:
        self.weight = nnx.Param(jnp.zeros((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        var = jnp.mean(xf * xf, axis=-1, keepdims=True)
        scale = 1.0 + self.weight[...].astype(jnp.float32)
        return (xf * jax.lax.rsqrt(var + self.eps) * scale).astype(x.dtype)


def make_norm(cfg: HFConfig, dim: int) -> RMSNorm | GemmaRMSNorm:
    """The family's RMSNorm over ``dim`` features."""
    cls = GemmaRMSNorm if cfg.gemma_norm else RMSNorm
    return cls(dim, cfg.rms_norm_eps, cfg.dtype)


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


class HFAttention(nnx.Module):
    """GQA self-attention; all sequence mixing is inside ``attend``.

    With ``cfg.qk_norm`` (Qwen3, Gemma 3), q and k are RMS-normalised per head over head_dim
    before RoPE, as ``Qwen3Attention``/``Gemma3Attention`` do. ``inv_freq`` is this layer's RoPE
    (Gemma 3's local layers use another base than its global ones).
    """

    def __init__(self, cfg: HFConfig, pattern: Pattern, inv_freq: tuple[float, ...]) -> None:
        self.cfg = cfg
        self.pattern = pattern
        self.inv_freq = inv_freq
        d, hd = cfg.hidden_size, cfg.head_dim
        self.q_proj = _linear(cfg, d, cfg.num_heads * hd, cfg.qkv_bias)
        self.k_proj = _linear(cfg, d, cfg.num_kv_heads * hd, cfg.qkv_bias)
        self.v_proj = _linear(cfg, d, cfg.num_kv_heads * hd, cfg.qkv_bias)
        self.o_proj = _linear(cfg, cfg.num_heads * hd, d, cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = make_norm(cfg, hd)
            self.k_norm = make_norm(cfg, hd)

    def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array) -> jax.Array:
        cfg = self.cfg
        q = self.q_proj(x).reshape(*x.shape[:2], cfg.num_heads, cfg.head_dim)
        k = self.k_proj(x).reshape(*x.shape[:2], cfg.num_kv_heads, cfg.head_dim)
        v = self.v_proj(x).reshape(*x.shape[:2], cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q, positions, self.inv_freq)
        k = apply_rope(k, positions, self.inv_freq)
        out = attend(q, k, v, self.pattern, q_positions=positions, kv_positions=positions,
                     q_segment_ids=segment_ids, kv_segment_ids=segment_ids,
                     scale=cfg.attn_scale or cfg.head_dim ** -0.5,
                     logit_softcap=cfg.attn_softcap)
        return self.o_proj(out.reshape(*out.shape[:2], cfg.num_heads * cfg.head_dim))


class GatedMLP(nnx.Module):
    """Gated MLP: ``down_proj(act(gate_proj(x)) * up_proj(x))``; SwiGLU (silu) or GeGLU
    (Gemma's tanh-approximated gelu), per ``cfg.hidden_act``."""

    def __init__(self, cfg: HFConfig) -> None:
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.hidden_act = cfg.hidden_act
        self.gate_proj = _linear(cfg, d, f, cfg.mlp_bias)
        self.up_proj = _linear(cfg, d, f, cfg.mlp_bias)
        self.down_proj = _linear(cfg, f, d, cfg.mlp_bias)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(_ACT[self.hidden_act](self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
    """Pre-norm block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))`` (Llama, Qwen, Mistral).

    ``post_attention_layernorm`` is the norm *before* the MLP here; the name is transformers'.
    """

    def __init__(self, cfg: HFConfig, pattern: Pattern, inv_freq: tuple[float, ...]) -> None:
        self.input_layernorm = make_norm(cfg, cfg.hidden_size)
        self.self_attn = HFAttention(cfg, pattern, inv_freq)
        self.post_attention_layernorm = make_norm(cfg, cfg.hidden_size)
        self.mlp = GatedMLP(cfg)

    def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array) -> jax.Array:
        x = x + self.self_attn(self.input_layernorm(x), positions, segment_ids)
        return x + self.mlp(self.post_attention_layernorm(x))


class SandwichDecoderLayer(nnx.Module):
    """Gemma 2/3 block: each sublayer is normed on the way in *and* out, before the residual.

    ``x + post_attention_layernorm(attn(input_layernorm(x)))``, then
    ``x + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x)))`` — as
    ``Gemma2DecoderLayer.forward``; here ``post_attention_layernorm`` norms the attention output.
    """

    def __init__(self, cfg: HFConfig, pattern: Pattern, inv_freq: tuple[float, ...]) -> None:
        d = cfg.hidden_size
        self.input_layernorm = make_norm(cfg, d)
        self.self_attn = HFAttention(cfg, pattern, inv_freq)
        self.post_attention_layernorm = make_norm(cfg, d)
        self.pre_feedforward_layernorm = make_norm(cfg, d)
        self.mlp = GatedMLP(cfg)
        self.post_feedforward_layernorm = make_norm(cfg, d)

    def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array) -> jax.Array:
        h = self.self_attn(self.input_layernorm(x), positions, segment_ids)
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(h)


def _layer_rope(cfg: HFConfig, pattern: Pattern) -> tuple[float, ...]:
    """A layer's RoPE: Gemma 3's sliding (local) layers have their own base; the config
    refuses a Gemma sliding layer without a window, so Window ⇔ local there."""
    if cfg.inv_freq_local is not None and isinstance(pattern, Window):
        return cfg.inv_freq_local
    return cfg.inv_freq


class DecoderModel(nnx.Module):
    """transformers' ``model.*`` part: embedding, layers, final norm (hidden states out).

    Gemma scales the embedding by ``sqrt(hidden_size)`` *cast to the model dtype first*
    (``Gemma2TextScaledWordEmbedding``: in bf16, sqrt(2304) = 48 becomes 48.0 but sqrt(3072)
    becomes 55.5), and multiplies in that dtype; so does this.
    """

    def __init__(self, cfg: HFConfig) -> None:
        self.cfg = cfg
        self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.hidden_size, dtype=cfg.dtype,
                                      param_dtype=cfg.dtype, rngs=nnx.Rngs(0))
        layer = SandwichDecoderLayer if cfg.sandwich_norms else DecoderLayer
        self.layers = nnx.List([layer(cfg, p, _layer_rope(cfg, p)) for p in cfg.patterns])
        self.norm = make_norm(cfg, cfg.hidden_size)

    def __call__(self, tokens: jax.Array, positions: jax.Array,
                 segment_ids: jax.Array) -> jax.Array:
        x = self.embed_tokens(tokens)
        if self.cfg.embed_scale is not None:
            x = x * jnp.asarray(self.cfg.embed_scale, x.dtype)
        for layer in self.layers:
            x = layer(x, positions, segment_ids)
        return self.norm(x)


class CausalLM(nnx.Module):
    """A causal LM of any supported family (``cfg.model_type``): hidden states → head → float32
    logits.

    The head is the embedding matrix when ``tie_word_embeddings`` (no ``lm_head`` parameter
    exists then), else its own ``lm_head``. Logits are accumulated and returned in float32
    (:func:`~jaxrl_sym.ops.head.head_logits`) without upcasting a bf16 head matrix, forward or
    backward, which at a 150k vocabulary would be a second, 4-byte copy of the largest weight.
    Gemma's final soft-cap ``c * tanh(z / c)`` is applied to those float32 logits
    (transformers applies it in the model dtype, so in bf16 the two differ by bf16 rounding
    only).
    """

    def __init__(self, cfg: HFConfig) -> None:
        self.cfg = cfg
        self.model = DecoderModel(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = _linear(cfg, cfg.hidden_size, cfg.vocab_size, False)

    def __call__(self, tokens: jax.Array, positions: jax.Array,
                 segment_ids: jax.Array | None = None) -> jax.Array:
        """Logits ``[B, T, vocab]`` (float32) for int32 ``[B, T]`` tokens/positions/segments."""
        return self.head(self.features(tokens, positions, segment_ids))

    def features(self, tokens: jax.Array, positions: jax.Array,
                 segment_ids: jax.Array | None = None) -> jax.Array:
        """Final hidden states ``[B, T, hidden]`` (after the final norm, in the model dtype):
        the optional ``features``/``head`` split of the contract, which lets the RL step apply
        the head to a chunk of tokens at a time (:mod:`jaxrl_sym.rl.step.logprobs`)."""
        if segment_ids is None:
            segment_ids = jnp.zeros_like(positions)
        return self.model(tokens, positions, segment_ids)

    def head(self, features: jax.Array) -> jax.Array:
        """``features [..., hidden] -> float32 logits [..., vocab]``, soft-capped for Gemma;
        position-wise, so applying it chunk by chunk gives the same logits."""
        if self.cfg.tie_word_embeddings:
            logits = head_logits(features, self.model.embed_tokens.embedding[...])
        else:
            logits = head_logits(features, self.lm_head.kernel[...], False)
        cap = self.cfg.final_softcap
        return logits if cap is None else cap * jnp.tanh(logits / cap)


def build_model(cfg: HFConfig) -> CausalLM:
    """A model with freshly initialised weights (tests, random-weight benchmarks)."""
    return CausalLM(cfg)


def abstract_model(cfg: HFConfig) -> CausalLM:
    """A model whose parameters are shapes only (``nnx.eval_shape``): nothing is allocated, so
    the loader can fill it one checkpoint tensor at a time."""
    return nnx.eval_shape(lambda: CausalLM(cfg))
