"""A small decoder-only LM (Llama/Qwen-style) in Flax NNX: one model that follows the contract.

``DecoderLM`` is called as ``model(tokens, positions, segment_ids) -> logits`` like any other
contract model (``tests/zoo.py``, ``jaxrl_sym.models.hf``); nothing in the library reads its config
or calls it any other way. Why it looks the way it does:

* Positions are an *input*. RoPE angles come from ``positions`` (never from ``jnp.arange`` over the
  sequence axis), so the same forward serves a left-padded prompt batch, a packed batch of several
  sequences, a single decode step and the tracer's symbolic-length program. Positions < 0 mark
  padding; they are clamped to 0 for the angles (their outputs are masked by ``attend`` anyway).
* The forward is position-wise except for :func:`attend`: no reduction, cumsum, slice or pad over
  the sequence axis and no reshape that merges batch and sequence. The tracer relies on this to
  treat ``attend`` as the only op that mixes positions. Reshapes are written
  ``x.reshape(*x.shape[:2], heads, head_dim)`` so symbolic ``B, T`` dimensions pass through.
* It takes no KV caches. The baselines keep caches *outside* the model
  (:mod:`jaxrl_sym.models.traced` gives each ``attend`` call its own), so this model decodes
  through exactly the same path as a model the library has never seen.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl_sym.errors import InputError
from jaxrl_sym.ops.attention import Causal, Pattern, Window, attend
from jaxrl_sym.ops.head import head_logits

# --------------------------------------------------------------------------- config


@dataclass(frozen=True)
class LMConfig:
    """Architecture hyper-parameters. Frozen (hashable) so it can be a static jit argument."""

    vocab_size: int = 256
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 16
    ffn_dim: int = 128
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    patterns: tuple[Pattern, ...] = ()
    dtype: Any = jnp.float32

    def __post_init__(self) -> None:
        # Fail at construction with the offending field named, not deep inside a matmul.
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                     "ffn_dim"):
            val = getattr(self, name)
            if not isinstance(val, int) or isinstance(val, bool) or val < 1:
                raise InputError(f"LMConfig.{name}={val!r}: must be an int >= 1")
        if self.n_heads % self.n_kv_heads != 0:
            raise InputError(
                f"LMConfig: n_heads={self.n_heads} is not a multiple of n_kv_heads="
                f"{self.n_kv_heads} (grouped-query attention shares each kv head among "
                "n_heads // n_kv_heads query heads)"
            )
        if self.head_dim % 2 != 0:
            raise InputError(
                f"LMConfig.head_dim={self.head_dim}: RoPE rotates pairs of features, so head_dim "
                "must be even"
            )
        if self.patterns and len(self.patterns) != self.n_layers:
            raise InputError(
                f"LMConfig.patterns has {len(self.patterns)} entries for n_layers={self.n_layers}; "
                "give one pattern per layer, or () for Causal() everywhere"
            )

    def layer_patterns(self) -> tuple[Pattern, ...]:
        """One attention pattern per layer (default: full causal everywhere)."""
        return self.patterns if self.patterns else tuple(Causal() for _ in range(self.n_layers))

    @staticmethod
    def mixed(window: int, **kw: Any) -> LMConfig:
        """Gemma-2 style stack: even layers Window(window), odd layers full causal."""
        n_layers = kw.pop("n_layers", LMConfig.n_layers)
        pats = tuple(Window(window) if i % 2 == 0 else Causal() for i in range(n_layers))
        return LMConfig(n_layers=n_layers, patterns=pats, **kw)


_PRESETS: dict[str, dict[str, Any]] = {
    # Unit tests: small enough that a CPU compile + run takes well under a second.
    "tiny": dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                 ffn_dim=64),
    # CLI default on CPU.
    "small": dict(vocab_size=512, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32,
                  ffn_dim=384),
    # GPT-2 small's sizes (with this file's RoPE/RMSNorm/SwiGLU blocks).
    "gpt2-small": dict(vocab_size=50257, d_model=768, n_layers=12, n_heads=12, n_kv_heads=12,
                       head_dim=64, ffn_dim=3072),
    # Qwen2.5-0.5B's sizes.
    "qwen2.5-0.5b": dict(vocab_size=151936, d_model=896, n_layers=24, n_heads=14, n_kv_heads=2,
                         head_dim=64, ffn_dim=4864, rope_theta=1e6),
}


def preset_names() -> tuple[str, ...]:
    """Names accepted by :func:`preset`."""
    return tuple(_PRESETS)


def preset(name: str, **overrides: Any) -> LMConfig:
    """A named configuration; ``overrides`` replace fields (e.g. ``patterns=``, ``dtype=``)."""
    try:
        base = _PRESETS[name]
    except KeyError:
        raise InputError(
            f"unknown model preset {name!r}; choose one of {', '.join(_PRESETS)}"
        ) from None
    return LMConfig(**{**base, **overrides})


# --------------------------------------------------------------------------- building blocks


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding of x [B, T, H, D] at ``positions`` [B, T] (rotate-half convention).

    Negative positions (padding) are clamped to 0: their values are never read by a valid query,
    and clamping keeps the angles finite. Computed in fp32 and cast back.
    """
    d = x.shape[-1]
    inv_freq = jnp.asarray(1.0 / theta ** (np.arange(0, d, 2, dtype=np.float64) / d), jnp.float32)
    pos = jnp.maximum(positions, 0).astype(jnp.float32)
    ang = pos[..., None, None] * inv_freq  # [B, T, 1, D/2]
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., : d // 2], xf[..., d // 2 :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


class Attention(nnx.Module):
    """Grouped-query attention with RoPE; the sequence mixing is entirely inside ``attend``."""

    def __init__(self, cfg: LMConfig, pattern: Pattern, *, rngs: nnx.Rngs) -> None:
        self.cfg = cfg
        self.pattern = pattern
        lin = dict(use_bias=False, dtype=cfg.dtype, param_dtype=cfg.dtype, rngs=rngs)
        self.q_proj = nnx.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, **lin)
        self.k_proj = nnx.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, **lin)
        self.v_proj = nnx.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, **lin)
        self.o_proj = nnx.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, **lin)

    def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array) -> jax.Array:
        """x [B, T, d_model] -> [B, T, d_model]; keys are attended at their own positions."""
        cfg = self.cfg
        q = self.q_proj(x).reshape(*x.shape[:2], cfg.n_heads, cfg.head_dim)
        k = self.k_proj(x).reshape(*x.shape[:2], cfg.n_kv_heads, cfg.head_dim)
        v = self.v_proj(x).reshape(*x.shape[:2], cfg.n_kv_heads, cfg.head_dim)
        q = rope(q, positions, cfg.rope_theta)
        k = rope(k, positions, cfg.rope_theta)
        out = attend(
            q, k, v, self.pattern,
            q_positions=positions, kv_positions=positions,
            q_segment_ids=segment_ids, kv_segment_ids=segment_ids,
        )
        out = out.reshape(*out.shape[:2], cfg.n_heads * cfg.head_dim)
        return self.o_proj(out)


class MLP(nnx.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: LMConfig, *, rngs: nnx.Rngs) -> None:
        lin = dict(use_bias=False, dtype=cfg.dtype, param_dtype=cfg.dtype, rngs=rngs)
        self.gate = nnx.Linear(cfg.d_model, cfg.ffn_dim, **lin)
        self.up = nnx.Linear(cfg.d_model, cfg.ffn_dim, **lin)
        self.down = nnx.Linear(cfg.ffn_dim, cfg.d_model, **lin)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class DecoderBlock(nnx.Module):
    """Pre-norm transformer block: x + attn(norm(x)); x + mlp(norm(x))."""

    def __init__(self, cfg: LMConfig, pattern: Pattern, *, rngs: nnx.Rngs) -> None:
        norm = dict(epsilon=cfg.norm_eps, dtype=cfg.dtype, param_dtype=cfg.dtype, rngs=rngs)
        self.attn_norm = nnx.RMSNorm(cfg.d_model, **norm)
        self.attn = Attention(cfg, pattern, rngs=rngs)
        self.mlp_norm = nnx.RMSNorm(cfg.d_model, **norm)
        self.mlp = MLP(cfg, rngs=rngs)

    def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array) -> jax.Array:
        """x [B, T, d_model] -> [B, T, d_model]."""
        x = x + self.attn(self.attn_norm(x), positions, segment_ids)
        return x + self.mlp(self.mlp_norm(x))


# --------------------------------------------------------------------------- model


class DecoderLM(nnx.Module):
    """Token embedding → blocks → final RMSNorm → tied head (fp32 logits)."""

    def __init__(self, cfg: LMConfig, *, rngs: nnx.Rngs) -> None:
        self.cfg = cfg
        self.embed = nnx.Embed(
            cfg.vocab_size, cfg.d_model, dtype=cfg.dtype, param_dtype=cfg.dtype, rngs=rngs
        )
        self.layers = nnx.List([DecoderBlock(cfg, p, rngs=rngs) for p in cfg.layer_patterns()])
        self.final_norm = nnx.RMSNorm(
            cfg.d_model, epsilon=cfg.norm_eps, dtype=cfg.dtype, param_dtype=cfg.dtype, rngs=rngs
        )

    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        segment_ids: jax.Array | None = None,
    ) -> jax.Array:
        """Logits [B, T, V] in fp32 (the tied head runs in fp32 even for bf16 weights).

        tokens / positions / segment_ids: [B, T] int32; positions < 0 are padding. segment_ids
        may be left out for a batch of one sequence per row (all zeros), a convenience for
        direct calls; the library always passes all three, as the contract says.
        """
        return self.head(self.features(tokens, positions, segment_ids))

    def features(self, tokens: jax.Array, positions: jax.Array,
                 segment_ids: jax.Array | None = None) -> jax.Array:
        """Final hidden states [B, T, d_model] (after the final norm, in the model dtype).

        The optional ``features``/``head`` split of the contract
        (:func:`jaxrl_sym.models.contract.check_features`): the RL step applies :meth:`head` to
        a chunk of tokens at a time, so no ``[tokens x vocab]`` array exists at once.
        """
        if segment_ids is None:
            segment_ids = jnp.zeros_like(positions)
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, positions, segment_ids)
        return self.final_norm(x)

    def head(self, features: jax.Array) -> jax.Array:
        """Tied head with fp32 logits: ``features [..., d_model] -> logits [..., V]``;
        position-wise. The product accumulates in fp32 from the weights' own dtype, and its
        backward multiplies in that dtype too (:func:`jaxrl_sym.ops.head.head_logits`):
        upcasting a bf16 embedding would materialise a ``[V, d_model]`` fp32 copy (0.54 GB
        at Qwen's vocabulary) for the same logits."""
        return head_logits(features, self.embed.embedding[...])


def init_model(cfg: LMConfig, seed: int = 0) -> DecoderLM:
    """A freshly initialised model (convenience for tests and the CLI)."""
    return DecoderLM(cfg, rngs=nnx.Rngs(seed))

