"""The LM head's product: fp32 logits from bf16 operands, and a backward that stays in bf16.

Why a custom VJP: ``einsum(features, embedding, preferred_element_type=float32)`` gives exact
fp32 logits from bf16 operands (a bf16 × bf16 product is exact in fp32), but its automatic
transpose multiplies the *fp32* logits cotangent by the bf16 embedding: the operands' dtypes
differ, so XLA converts the ``[V, d]`` embedding to fp32 first — 0.54 GB at Qwen2.5's
151,936-word vocabulary, alive through the update's gradient program (found in XLA's buffer
assignment of the projected RL step, ``bench/results/projection.md``). Mixed-precision training
elsewhere does what :func:`head_logits` does: PyTorch's autocast computes the head in bf16 and
casts its output to fp32 for the loss, so the cotangent reaching the head's matmul is rounded to
bf16 by the cast's own backward. Here the cotangent is rounded to the operands' dtype and both
products accumulate in fp32; in fp32 nothing is rounded and the result equals the automatic
transpose.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

__all__ = ["head_logits"]


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def head_logits(features: jax.Array, weight: jax.Array, vocab_first: bool = True) -> jax.Array:
    """``features [..., d]`` times the head ``weight`` (``[V, d]``, a tied embedding, when
    ``vocab_first``; else ``[d, V]``, a separate ``lm_head`` kernel) -> ``[..., V]`` in fp32, the
    operands promoted to a common dtype first (bf16 stays bf16). Position-wise; differentiable
    in both operands."""
    f, w = _common(features, weight)
    return jnp.einsum(_spec(vocab_first), f, w, preferred_element_type=jnp.float32)


def _spec(vocab_first: bool) -> str:
    return "...d,vd->...v" if vocab_first else "...d,dv->...v"


def _common(features: jax.Array, weight: jax.Array) -> tuple[jax.Array, jax.Array]:
    dt = jnp.promote_types(features.dtype, weight.dtype)
    return features.astype(dt), weight.astype(dt)


def _fwd(features: jax.Array, weight: jax.Array, vocab_first: bool
         ) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    return head_logits(features, weight, vocab_first), (features, weight)


def _bwd(vocab_first: bool, res: tuple[jax.Array, ...], g: jax.Array
         ) -> tuple[jax.Array, jax.Array]:
    features, weight = res
    f, w = _common(features, weight)
    g = g.astype(w.dtype)  # the operands' dtype: no [V, d] fp32 copy of the weight
    wd = "vd" if vocab_first else "dv"
    df = jnp.einsum(f"...v,{wd}->...d", g, w, preferred_element_type=jnp.float32)
    dw = jnp.einsum(f"...v,...d->{wd}", g, f, preferred_element_type=jnp.float32)
    return df.astype(features.dtype), dw.astype(weight.dtype)


head_logits.defvjp(_fwd, _bwd)
