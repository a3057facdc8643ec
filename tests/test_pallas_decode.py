"""The pallas backend: single-token decode attention as one Pallas kernel (interpreted here).

Oracles: attention written out in numpy in this file, slot by slot (no library code); the
plain model re-run on the whole sequence per token (``test_oracle_plain_model``'s independent
twin, whose attention is written in that test, not the library's) for the engine's tokens,
with refill on and off. The GPU side (the kernel compiled for an H100 and kept inside XLA's
CUDA graphs) is ``test_dispatch.py``'s.
"""

from __future__ import annotations

from functools import cache

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_oracle_plain_model import PlainConfig, PlainLM, plain_attention

from jaxrl_sym import Block, Causal, GenerationConfig, Window
from jaxrl_sym.backends import decode, pallas_ops
from jaxrl_sym.errors import InputError
from jaxrl_sym.runtime.engine import SymbolicLM
from jaxrl_sym.runtime.options import EngineOptions


def numpy_decode(q, k, v, kpos, qpos, nlive, *, lookback, period, scale, softcap):
    """One query per row, each slot tested by hand: float64 softmax over the visible slots."""
    b, hq, _ = q.shape
    hkv, cap = k.shape[1], k.shape[2]
    g = hq // hkv
    out = np.zeros((b, hq, v.shape[-1]))
    for r in range(b):
        for h in range(hq):
            seen = []
            for j in range(min(int(nlive[r]), cap)):
                kp, qp = int(kpos[r, j]), int(qpos[r])
                ok = 0 <= kp <= qp
                ok &= lookback is None or kp >= qp - lookback
                ok &= period is None or kp >= qp - qp % period
                if ok:
                    seen.append(j)
            if not seen:
                continue
            s = np.array([q[r, h].astype(np.float64) @ k[r, h // g, j] for j in seen]) * scale
            if softcap:
                s = softcap * np.tanh(s / softcap)
            p = np.exp(s - s.max())
            out[r, h] = (p / p.sum()) @ v[r, h // g, seen].astype(np.float64)
    return out


@st.composite
def cases(draw: st.DrawFn):
    b, hkv = draw(st.integers(1, 3)), draw(st.integers(1, 2))
    g, cap, d = draw(st.integers(1, 7)), draw(st.integers(1, 150)), draw(st.sampled_from([16,
                                                                                         32]))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    kpos = np.stack([rng.permutation(cap) for _ in range(b)]).astype(np.int32)  # ring order
    kpos[rng.random((b, cap)) < draw(st.sampled_from([0.0, 0.3]))] = -1  # empty slots
    qpos = rng.integers(-1, cap + 2, b).astype(np.int32)
    nlive = rng.integers(0, cap + 3, b).astype(np.int32)
    pattern = draw(st.sampled_from([Causal(), Window(5), Block(16), Window(100)]))
    arrays = [rng.standard_normal(s).astype(np.float32)
              for s in ((b, hkv * g, d), (b, hkv, cap, d), (b, hkv, cap, d))]
    return (*arrays, kpos, qpos, nlive), pattern, draw(st.sampled_from([0.0, 1.5]))


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases(), bf16=st.booleans())
def test_kernel_matches_numpy(case, bf16: bool) -> None:
    """Ragged live counts (past the capacity too), ring-ordered and empty slots, queries at -1,
    GQA groups that are not powers of two, window/block masks and soft-capping."""
    (q, k, v, kpos, qpos, nlive), pattern, softcap = case
    dt = jnp.bfloat16 if bf16 else jnp.float32
    q, k, v = (np.asarray(jnp.asarray(x, dt).astype(jnp.float32)) for x in (q, k, v))
    got = pallas_ops.decode_attention(
        *(jnp.asarray(x, dt) for x in (q, k, v)), jnp.asarray(kpos), jnp.asarray(qpos),
        jnp.asarray(nlive), pattern=pattern, scale=0.3, softcap=softcap, interpret=True)
    mask = pattern.kernel_mask()
    want = numpy_decode(q, k, v, kpos, qpos, nlive, lookback=mask.lookback,
                        period=mask.period, scale=0.3, softcap=softcap)
    assert got.dtype == dt
    np.testing.assert_allclose(np.asarray(got, np.float64), want,
                               atol=2e-2 if bf16 else 1e-5, rtol=2e-2 if bf16 else 1e-5)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases(), at=st.integers(0, 10**6))
def test_writing_kernel_writes_the_entry_then_attends(case, at: int) -> None:
    """The kernel that writes the step's entry first: its stores are numpy's stores with the
    entry written at the slot (every other slot untouched), and its output is attention over
    those stores — the entry read from registers, not memory, so a stale slot never leaks."""
    (q, k, v, kpos, qpos, nlive), pattern, softcap = case
    b, hkv, cap, d = k.shape
    rng = np.random.default_rng(at)
    slot = at % cap
    kn, vn = (rng.standard_normal((b, hkv, d)).astype(np.float32) for _ in range(2))
    pn = qpos.copy()
    nlive = np.maximum(nlive, slot + 1).astype(np.int32)  # the entry is live
    got, k2, v2, p2 = pallas_ops.decode_attention_write(
        *(jnp.asarray(x) for x in (q, kn, vn, pn, k, v, kpos)), jnp.int32(slot),
        jnp.asarray(qpos), jnp.asarray(nlive), pattern=pattern, scale=0.3, softcap=softcap,
        interpret=True)
    kw, vw, pw = k.copy(), v.copy(), kpos.copy()
    kw[:, :, slot], vw[:, :, slot], pw[:, slot] = kn, vn, pn
    np.testing.assert_array_equal(np.asarray(k2), kw)
    np.testing.assert_array_equal(np.asarray(v2), vw)
    np.testing.assert_array_equal(np.asarray(p2), pw)
    mask = pattern.kernel_mask()
    want = numpy_decode(q, kw, vw, pw, qpos, nlive, lookback=mask.lookback,
                        period=mask.period, scale=0.3, softcap=softcap)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=1e-5, rtol=1e-5)


def test_bad_operands_are_refused_by_name() -> None:
    z = jnp.zeros
    args = (z((2, 4, 12)), z((2, 2, 8, 12)), z((2, 2, 8, 12)), z((2, 8), jnp.int32),
            z((2,), jnp.int32), z((2,), jnp.int32))
    with pytest.raises(InputError, match="head dims 12/12"):
        pallas_ops.decode_attention(*args, pattern=Causal(), interpret=True)
    args = (z((2, 3, 16)), z((2, 2, 8, 16)), z((2, 2, 8, 16)), *args[3:])
    with pytest.raises(InputError, match="3 query heads is not a multiple of 2"):
        pallas_ops.decode_attention(*args, pattern=Causal(), interpret=True)


# --------------------------------------------------------------------------- the engine

CONFIG = PlainConfig(("window", "full"), dim=64, heads=4, kv_heads=2, softcap=2.0)
"""Head dim 16 (the kernel's smallest tile); a window ring and a growing store; soft-capped."""


@cache
def _models() -> tuple[PlainLM, PlainLM]:
    return (PlainLM(CONFIG, independent=False, rngs=nnx.Rngs(3)),
            PlainLM(CONFIG, independent=True, rngs=nnx.Rngs(3)))


def _twin_greedy(prompt: np.ndarray, n: int) -> np.ndarray:
    """The independent twin re-run on the whole sequence for every token."""
    twin = _models()[1]
    seq = list(prompt)
    for _ in range(n):
        t = jnp.asarray([seq], jnp.int32)
        pos = jnp.arange(len(seq), dtype=jnp.int32)[None]
        seq.append(int(jnp.argmax(twin(t, pos, jnp.zeros_like(pos))[0, -1])))
    return np.array(seq[len(prompt):], np.int32)


@pytest.mark.parametrize("refill", [False, True])
def test_engine_on_the_kernel_generates_the_plain_models_tokens(refill: bool) -> None:
    """Every softmax store of the plan runs the kernel, and greedy rows (ragged prompts and
    limits; refill through 2 resident rows) are the plain model's."""
    assert plain_attention is not None  # the twin's attention: the oracle's own code
    opts = EngineOptions(backend="pallas", min_capacity=4, compact_min_rows=1,
                         **({"refill": True, "microbatch_rows": 2} if refill else {}))
    lm = SymbolicLM(_models()[0], opts)
    kernels = [s.decode_kernel for s in lm.plan.specs.values() if s.pattern.softmax]
    assert kernels and all(k is decode.KERNELS["pallas"] for k in kernels)
    assert all(decode.writes_entry(s) for s in lm.plan.specs.values() if s.pattern.softmax)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, CONFIG.vocab, n).astype(np.int32) for n in (3, 9, 5)]
    limits = (7, 4, 11)
    res = lm.generate(prompts, GenerationConfig(max_new_tokens=limits, temperature=0.0))
    for p, n, got in zip(prompts, limits, res.tokens, strict=True):
        np.testing.assert_array_equal(got, _twin_greedy(p, n))


def test_head_dims_off_the_tiles_fall_back_to_xla() -> None:
    """A model whose head dim is not a Triton tile (8) keeps the masked XLA attention."""
    small = PlainLM(PlainConfig(("full",)), independent=False, rngs=nnx.Rngs(0))
    lm = SymbolicLM(small, EngineOptions(backend="pallas"))
    assert all(s.decode_kernel is None for s in lm.plan.specs.values())


def _has_gpu() -> bool:
    import jax

    return any(d.platform == "gpu" for d in jax.devices())


@pytest.mark.gpu
@pytest.mark.skipif(not _has_gpu(), reason="needs a GPU (the compiled Pallas kernel)")
@pytest.mark.parametrize("pattern", [Causal(), Window(100)])
def test_gpu_compiled_kernel_matches_numpy(pattern) -> None:
    """The kernel compiled by XLA's Triton on the GPU, at Qwen2.5-0.5B's heads (14 query heads
    over 2 kv heads, head dim 64), bf16 stores of 3,000 slots, ragged live counts."""
    rng = np.random.default_rng(1)
    b, hkv, g, cap, d = 5, 2, 7, 3000, 64
    q, k, v = (np.asarray(jnp.asarray(rng.standard_normal(s), jnp.bfloat16).astype(jnp.float32))
               for s in ((b, hkv * g, d), (b, hkv, cap, d), (b, hkv, cap, d)))
    kpos = np.tile(np.arange(cap, dtype=np.int32), (b, 1))
    nlive = np.array([1, 64, 65, 2999, 3000], np.int32)
    qpos = nlive - 1
    got = pallas_ops.decode_attention(
        *(jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)), jnp.asarray(kpos),
        jnp.asarray(qpos), jnp.asarray(nlive), pattern=pattern, scale=0.125)
    mask = pattern.kernel_mask()
    want = numpy_decode(q, k, v, kpos, qpos, nlive, lookback=mask.lookback,
                        period=mask.period, scale=0.125, softcap=0.0)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=2e-2, rtol=2e-2)
