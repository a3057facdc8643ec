"""The lowered attention in blocks of queries past a scores budget (issue 47: a 16k-token
training row held 23.5 GB of ``[heads, T, T]`` scores per layer in the update's backward).

Oracles: numpy's masked softmax attention (written here) for the values, and
``jax.grad`` of the unblocked reference for the gradients; memory from XLA's own
``memory_analysis`` of the compiled gradient program, at two row lengths.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl_sym.ops.attention import (
    Causal,
    Window,
    bounded_reference,
    query_block,
    reference_attention,
)


def _numpy_attention(q, k, v, q_pos, k_pos, q_seg, k_seg, window=None):
    b, tq, hq, d = q.shape
    g = hq // k.shape[2]
    out = np.zeros((b, tq, hq, v.shape[-1]))
    for r in range(b):
        for t in range(tq):
            for h in range(hq):
                ok = ((k_pos[r] >= 0) & (q_pos[r, t] >= 0) & (k_pos[r] <= q_pos[r, t])
                      & (k_seg[r] == q_seg[r, t]))
                if window is not None:
                    ok &= k_pos[r] > q_pos[r, t] - window
                if not ok.any():
                    continue
                s = k[r][:, h // g] @ q[r, t, h] / np.sqrt(d)
                s = np.where(ok, s, -np.inf)
                p = np.exp(s - s.max())
                out[r, t, h] = (p / p.sum()) @ v[r][:, h // g]
    return out


def _inputs(seed: int, b: int, t: int, hq: int = 4, hkv: int = 2, d: int = 8):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(b, t, hq, d)).astype(np.float32)
    k = rng.normal(size=(b, t, hkv, d)).astype(np.float32)
    v = rng.normal(size=(b, t, hkv, d)).astype(np.float32)
    cut = rng.integers(1, t + 1, b)  # two packed segments a row, the rest padding
    pos = np.stack([np.where(np.arange(t) < c, np.arange(t) % max(1, c // 2), -1)
                    for c in cut]).astype(np.int32)
    seg = np.stack([(np.arange(t) >= c // 2).astype(np.int32) for c in cut])
    return q, k, v, pos, seg


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), b=st.integers(1, 2), t=st.integers(17, 70),
       queries=st.integers(1, 40), window=st.sampled_from([None, 5]))
def test_blocks_give_numpys_attention(seed: int, b: int, t: int, queries: int,
                                      window: int | None) -> None:
    q, k, v, pos, seg = _inputs(seed, b, t)
    pattern = Causal() if window is None else Window(window)
    budget = 4 * b * 4 * t * queries  # ``queries`` queries' scores fit: several blocks
    got = bounded_reference(q, k, v, pos, pos, seg, seg, pattern=pattern, scale=8 ** -0.5,
                            softcap=0.0, budget=budget)
    want = _numpy_attention(q, k, v, pos, pos, seg, seg, window)
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-6)


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 10_000), t=st.integers(20, 60), queries=st.integers(1, 20))
def test_blocks_give_the_references_gradients(seed: int, t: int, queries: int) -> None:
    q, k, v, pos, seg = _inputs(seed, 2, t)
    w = np.random.default_rng(seed + 1).normal(size=q.shape).astype(np.float32)

    def loss(fn, q_, k_, v_):
        return jnp.sum(fn(q_, k_, v_, pos, pos, seg, seg, pattern=Causal(), scale=0.3,
                          softcap=0.0) * w)

    blocked = lambda *a, **kw: bounded_reference(*a, **kw, budget=4 * 2 * 4 * t * queries)
    got = jax.jit(jax.grad(lambda *a: loss(blocked, *a), argnums=(0, 1, 2)))(q, k, v)
    want = jax.jit(jax.grad(lambda *a: loss(reference_attention, *a), argnums=(0, 1, 2)))(
        q, k, v)
    for g_, w_ in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g_), np.asarray(w_), rtol=1e-4, atol=1e-5)


def _grad_temporaries(t: int, budget: int) -> int:
    q, k, v, pos, seg = _inputs(0, 1, t, hq=4, hkv=4, d=16)

    def loss(q_, k_, v_):
        out = bounded_reference(q_, k_, v_, pos, pos, seg, seg, pattern=Causal(), scale=0.25,
                                softcap=0.0, budget=budget)
        return jnp.sum(out)

    exe = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile()
    return int(exe.memory_analysis().temp_size_in_bytes)


def test_gradient_temporaries_grow_linearly_past_the_budget() -> None:
    """Doubling a row's length doubles the blocked gradient's temporaries (keys x a block),
    where one call's would quadruple: the whole ``[H, T, T]`` scores alone at 2,048 tokens are
    64 MiB, at 4,096 256 MiB."""
    budget = 4 << 20
    assert query_block(1, 4, 4096, 4096, budget) < 4096  # blocked
    short, long = _grad_temporaries(2048, budget), _grad_temporaries(4096, budget)
    assert long < 2.6 * short, (short, long)
    assert long < 4 * 4 * 4096 * 4096 // 4  # under a quarter of one call's fp32 scores
    whole = _grad_temporaries(1024, 1 << 40)  # one call, for scale: quadratic
    assert whole > 4 * 4 * 1024 * 1024  # it holds at least the [H, T, T] scores
