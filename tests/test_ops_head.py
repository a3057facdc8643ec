"""The head's product (:func:`jaxrl_sym.ops.head.head_logits`) against numpy: fp32 logits and
gradients exact in fp32, within bf16 rounding in bf16 — and no fp32 copy of a bf16 head weight
in the gradient program (the reason it has its own backward)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl_sym.ops.head import head_logits


def _numpy_grads(f: np.ndarray, w: np.ndarray, t: np.ndarray) -> tuple[np.ndarray, ...]:
    """d/df and d/dw of sum(f @ w.T * t), by hand in float64."""
    f2 = f.reshape(-1, f.shape[-1]).astype(np.float64)
    t2 = t.reshape(-1, t.shape[-1]).astype(np.float64)
    return (t2 @ w.astype(np.float64)).reshape(f.shape), t2.T @ f2


@settings(max_examples=15, deadline=None)
@given(rows=st.integers(1, 3), length=st.integers(1, 5), d=st.integers(1, 12),
       vocab=st.integers(1, 40), vocab_first=st.booleans(), seed=st.integers(0, 2**16))
def test_head_logits_and_grads_equal_numpy_in_fp32(rows: int, length: int, d: int, vocab: int,
                                                   vocab_first: bool, seed: int) -> None:
    rng = np.random.default_rng(seed)
    f = rng.standard_normal((rows, length, d)).astype(np.float32)
    w = rng.standard_normal((vocab, d)).astype(np.float32)
    t = rng.standard_normal((rows, length, vocab)).astype(np.float32)
    wt = w if vocab_first else w.T.copy()
    logits = head_logits(jnp.asarray(f), jnp.asarray(wt), vocab_first)
    assert logits.dtype == jnp.float32
    np.testing.assert_allclose(logits, f @ w.T, rtol=1e-5, atol=1e-5)
    df, dw = jax.grad(lambda f, w: jnp.sum(head_logits(f, w, vocab_first) * t), (0, 1))(
        jnp.asarray(f), jnp.asarray(wt))
    want_f, want_w = _numpy_grads(f, w, t)
    np.testing.assert_allclose(df, want_f, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(dw, want_w if vocab_first else want_w.T, rtol=1e-4, atol=1e-4)


def test_bf16_backward_keeps_the_weight_in_bf16() -> None:
    rng = np.random.default_rng(0)
    f = jnp.asarray(rng.standard_normal((2, 7, 16)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((96, 16)), jnp.bfloat16)
    t = rng.standard_normal((2, 7, 96)).astype(np.float32)
    grad = jax.grad(lambda f, w: jnp.sum(head_logits(f, w) * t), (0, 1))
    df, dw = grad(f, w)
    assert (df.dtype, dw.dtype) == (jnp.bfloat16, jnp.bfloat16)
    want_f, want_w = _numpy_grads(np.asarray(f, np.float32), np.asarray(w, np.float32), t)
    # the cotangent is rounded to bf16 (2^-8 relative), the products accumulate in fp32
    for got, want in ((df, want_f), (dw, want_w)):
        err = np.max(np.abs(np.asarray(got, np.float64) - want)) / np.max(np.abs(want))
        assert err < 2e-2
    # a frozen head (LoRA): the gradient w.r.t. the features alone holds no fp32 [V, d] buffer
    # (jnp.einsum's automatic transpose converts w to fp32 first: "f32[96,16]" is in its HLO)
    grad_f = jax.grad(lambda f, w: jnp.sum(head_logits(f, w) * t))
    assert "f32[96,16]" not in jax.jit(grad_f).lower(f, w).compile().as_text()
