"""The Triton kernels against the XLA reference, under Triton's CPU interpreter (or a GPU).

Every kernel in ``kernels/`` runs through :mod:`jaxrl_sym.backends.triton_ops` — on a machine
without a GPU that is Triton's interpreter inside ``jax.pure_callback``, the *same kernel source*
the GPU compiles — and is compared with :func:`jaxrl_sym.ops.attention.reference_attention` (or a
direct jnp recurrence for linear decode). Shapes are tiny and block sizes are forced down to 16 so
that multi-block loops, split-K with empty splits and sequence-straddling tiles are all exercised.

Outputs the kernel does not write come back as NaN (see ``launch._poison``), and garbage (NaN) is
planted in store slots the kernel must not read, so "forgot to write" / "read past n_live" fail.

``@pytest.mark.gpu`` tests run the real jax-triton path and are skipped without a GPU. One test
compiles every kernel variant for sm_90 with Triton's bundled ptxas (no GPU needed), which catches
what the interpreter cannot: compile errors and shared-memory overflows.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import subprocess
import sys
import textwrap
import zlib
from unittest import mock

import numpy as np
import pytest

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed (pip install '.[interp]')", allow_module_level=True)

import jax
import jax.numpy as jnp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxrl_sym.backends import backend_name, launch, triton_available, triton_ops
from jaxrl_sym.errors import InputError, PatternError
from jaxrl_sym.ops.attention import (
    Block,
    Causal,
    Linear,
    Window,
    attention_mask,
    phi,
    reference_attention,
)

MODE = backend_name()
# Import the kernel modules now: on a CPU machine this sets TRITON_INTERPRET=1 before anything
# else in the session imports triton (Triton fixes the mode at its first import).
for _name in ("decode_attention", "packed_attention", "linear_attention"):
    launch.import_kernels(_name)

# Triton 3.6's interpreter turns 1-element arrays into loop bounds with int(); numpy 2.x warns
# (and numpy >= 2.4 errors: hence the numpy < 2.4 pin).
pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning"
)
gpu_only = pytest.mark.skipif(MODE != "gpu", reason="needs a GPU with jax-triton")
FAST = settings(
    max_examples=8,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}
TOL = {"f32": dict(atol=1e-4, rtol=1e-4), "bf16": dict(atol=3e-2, rtol=3e-2)}
GRAD_TOL = {"f32": dict(atol=2e-4, rtol=2e-4), "bf16": dict(atol=6e-2, rtol=6e-2)}


def _close(actual: jax.Array, expected: jax.Array, dt: str, tol: dict | None = None) -> None:
    a = np.asarray(jnp.asarray(actual, jnp.float32))
    e = np.asarray(jnp.asarray(expected, jnp.float32))
    assert not np.isnan(a).any(), "kernel output holds NaN (unwritten output or garbage read)"
    np.testing.assert_allclose(a, e, **(tol or TOL[dt]))


def _pattern(kind: str, size: int):
    return {"causal": Causal(), "window": Window(size), "block": Block(size)}[kind]


_ref = jax.jit(reference_attention, static_argnames=("pattern", "scale"))


# --------------------------------------------------------------------------- decode attention


@functools.partial(jax.jit, static_argnums=(6, 7))
def _ref_decode(q, k, v, kv_pos, q_pos, n_live, pattern, scale):
    """reference_attention with Tq = 1 over slots [0, n_live); garbage slots zeroed for it.
    The stores arrive heads-major ``[B, Hkv, C, D]`` (the kernel's contract); the reference
    reads the model's ``[B, C, Hkv, D]``."""
    b, cap = kv_pos.shape
    k, v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
    live = (jnp.arange(cap)[None] < n_live[:, None]) & (kv_pos >= 0)
    kp = jnp.where(live, kv_pos, -1)
    kz = jnp.where(live[..., None, None], k, 0)
    vz = jnp.where(live[..., None, None], v, 0)
    zq, zk = jnp.zeros((b, 1), jnp.int32), jnp.zeros((b, cap), jnp.int32)
    out = _ref(q[:, None], kz, vz, q_pos[:, None], kp, zq, zk, pattern=pattern, scale=scale)
    return out[:, 0]


def _decode_case(rng, *, b, cap, hkv, g, d, dt, n_live, layout, q_offset=0):
    """Random store. layout 'append': slot i holds position i; 'ring': positions of the last
    n_live tokens in rotated slot order; 'holes': append with some empty (-1) slots. Slots past
    n_live and empty slots hold NaN with a plausible position, which must never be read.
    Built slot-major per row, returned heads-major ``[B, Hkv, C, D]`` as the kernel takes it."""
    dtype = DTYPES[dt]
    hq = hkv * g
    q = rng.standard_normal((b, hq, d)).astype(np.float32)
    k = rng.standard_normal((b, cap, hkv, d)).astype(np.float32)
    v = rng.standard_normal((b, cap, hkv, d)).astype(np.float32)
    kv_pos = np.tile(np.arange(cap, dtype=np.int32), (b, 1))
    q_pos = np.zeros(b, np.int32)
    for r in range(b):
        n = int(n_live[r])
        if layout == "ring" and n > 0:
            total = n + int(rng.integers(0, 3 * cap + 1))  # tokens written so far
            toks = np.arange(total - n, total)
            kv_pos[r, toks % n] = toks  # ring of n slots, rotated
            q_pos[r] = total - 1 + q_offset
        else:
            q_pos[r] = max(n - 1, 0) + q_offset
        if layout == "holes" and n > 1:
            kv_pos[r, rng.choice(n, size=max(1, n // 3), replace=False)] = -1
        # Past n_live: garbage at a position every pattern would show the query.
        k[r, n:] = np.nan
        v[r, n:] = np.nan
        kv_pos[r, n:] = q_pos[r]
        empty = kv_pos[r] < 0
        k[r, empty] = np.nan
        v[r, empty] = np.nan
    heads = lambda x: jnp.asarray(np.swapaxes(x, 1, 2), dtype)
    return (jnp.asarray(q, dtype), heads(k), heads(v),
            jnp.asarray(kv_pos), jnp.asarray(q_pos), jnp.asarray(np.asarray(n_live, np.int32)))


@FAST
@given(
    data=st.data(),
    dt=st.sampled_from(["f32", "bf16"]),
    g=st.sampled_from([1, 2, 4]),
    hkv=st.sampled_from([1, 2]),
    cap=st.sampled_from([1, 16, 37, 64]),
    pattern=st.sampled_from([("causal", 1), ("window", 1), ("window", 5), ("window", 100),
                             ("block", 4), ("block", 16)]),
    layout=st.sampled_from(["append", "ring", "holes"]),
    splits=st.sampled_from([1, 2, 4]),
    combine=st.sampled_from(["in_split", "launch"]),
    live_loads=st.sampled_from([None, True, False]),
)
def test_decode_attention_matches_reference(data, dt, g, hkv, cap, pattern, layout, splits,
                                            combine, live_loads):
    """Every kernel variant against the reference; live loads forced on any pattern read the
    NaN garbage of empty and out-of-window slots, which must still not leak."""
    n_live = data.draw(
        st.lists(st.sampled_from(sorted({0, 1, cap // 2, cap - 1, cap})), min_size=2, max_size=2)
    )
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    args = _decode_case(rng, b=2, cap=cap, hkv=hkv, g=g, d=16, dt=dt, n_live=n_live,
                        layout=layout)
    pat = _pattern(*pattern)
    out = triton_ops.decode_attention(*args, pattern=pat, num_splits=splits, block_n=16,
                                      combine=combine, live_loads=live_loads)
    assert out.shape == args[0].shape and out.dtype == args[0].dtype
    _close(out, _ref_decode(*args, pat, 0.25), dt)


@pytest.mark.parametrize(
    ("name", "cap", "n_live", "pattern", "layout", "q_offset"),
    [
        ("length 1", 16, [1, 1], Causal(), "append", 0),
        ("length == capacity", 48, [48, 48], Causal(), "append", 0),
        ("nothing live", 16, [0, 3], Causal(), "append", 0),
        ("window > length", 32, [5, 20], Window(64), "append", 0),
        ("window cuts inside a block", 64, [64, 40], Window(21), "append", 0),
        ("block boundary: query first of its block", 64, [33, 17], Block(16), "append", 0),
        ("block boundary: query last of its block", 64, [32, 16], Block(16), "append", 0),
        ("ring out of order, window = slots", 24, [24, 24], Window(24), "ring", 0),
        ("ring, not yet full", 24, [7, 1], Window(24), "ring", 0),
        ("query ahead of every key", 16, [16, 9], Window(4), "append", 10),
        ("holes in live range", 40, [40, 23], Causal(), "holes", 0),
    ],
)
@pytest.mark.parametrize("dt", ["f32", "bf16"])
def test_decode_attention_edges(name, cap, n_live, pattern, layout, q_offset, dt):
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    args = _decode_case(rng, b=2, cap=cap, hkv=2, g=2, d=32, dt=dt, n_live=n_live,
                        layout=layout, q_offset=q_offset)
    out = triton_ops.decode_attention(*args, pattern=pattern, block_n=16, num_splits=2)
    _close(out, _ref_decode(*args, pattern, 1 / np.sqrt(32)), dt)


def test_decode_empty_query_is_zero():
    rng = np.random.default_rng(0)
    q, k, v, kv_pos, _, n_live = _decode_case(rng, b=2, cap=16, hkv=1, g=2, d=16, dt="f32",
                                              n_live=[16, 16], layout="append")
    q_pos = jnp.array([-1, 5], jnp.int32)
    out = triton_ops.decode_attention(q, k, v, kv_pos, q_pos, n_live, pattern=Causal(),
                                      block_n=16, num_splits=2)
    assert np.all(np.asarray(out[0]) == 0)
    assert np.abs(np.asarray(out[1])).sum() > 0


def test_ring_buffer_equals_full_window_attention():
    """A window ring buffer (C = w slots, slot = t mod w) gives the full-sequence window result."""
    rng = np.random.default_rng(1)
    w, hkv, g, d = 12, 2, 2, 16
    for total in (5, 12, 29):  # shorter than, equal to, longer than the window
        k_full = rng.standard_normal((1, total, hkv, d)).astype(np.float32)
        v_full = rng.standard_normal((1, total, hkv, d)).astype(np.float32)
        q = jnp.asarray(rng.standard_normal((1, hkv * g, d)), jnp.float32)
        ring_k = np.zeros((1, w, hkv, d), np.float32)
        ring_v = np.zeros((1, w, hkv, d), np.float32)
        ring_pos = np.full((1, w), -1, np.int32)
        for t in range(total):
            ring_k[0, t % w], ring_v[0, t % w], ring_pos[0, t % w] = k_full[0, t], v_full[0, t], t
        q_pos = jnp.array([total - 1], jnp.int32)
        heads = lambda x: jnp.asarray(np.swapaxes(x, 1, 2))  # the kernel's [B, Hkv, C, D]
        out = triton_ops.decode_attention(
            q, heads(ring_k), heads(ring_v), jnp.asarray(ring_pos), q_pos,
            jnp.array([min(total, w)], jnp.int32), pattern=Window(w), block_n=16, num_splits=2,
        )
        full_pos = jnp.arange(total, dtype=jnp.int32)[None]
        ref = _ref(q[:, None], jnp.asarray(k_full), jnp.asarray(v_full), q_pos[:, None], full_pos,
                   jnp.zeros((1, 1), jnp.int32), jnp.zeros((1, total), jnp.int32),
                   pattern=Window(w), scale=0.25)[:, 0]
        _close(out, ref, "f32")


def test_decode_splits_agree_and_jit_reuses_one_compile():
    rng = np.random.default_rng(2)
    args = _decode_case(rng, b=2, cap=64, hkv=2, g=4, d=16, dt="f32", n_live=[64, 3],
                        layout="append")
    outs = [triton_ops.decode_attention(*args, pattern=Causal(), block_n=16, num_splits=s,
                                        combine=c)
            for s in (1, 2, 4, 8) for c in ("in_split", "launch")]
    for o in outs[1:]:
        _close(o, outs[0], "f32")
    f = jax.jit(lambda *a: triton_ops.decode_attention(*a, pattern=Causal(), block_n=16))
    q, k, v, kv_pos, _, _ = _decode_case(rng, b=2, cap=64, hkv=2, g=4, d=16, dt="f32",
                                         n_live=[64, 64], layout="append")
    for n in (1, 30, 64):  # a new length is new data, not a new program
        out = f(q, k, v, kv_pos, jnp.full((2,), n - 1, jnp.int32), jnp.full((2,), n, jnp.int32))
        _close(out, _ref_decode(q, k, v, kv_pos, jnp.full((2,), n - 1, jnp.int32),
                                jnp.full((2,), n, jnp.int32), Causal(), 0.25), "f32")
    assert f._cache_size() == 1


def test_num_splits_heuristic():
    assert triton_ops._num_splits(1, 2, 16384, 64) == 64  # B=1: split hard
    assert triton_ops._num_splits(32, 16, 16384, 64) == 1  # enough programs already
    assert triton_ops._num_splits(1, 2, 64, 64) == 1  # tiny capacity: no split
    # batch 1, GPT-2's 12 kv heads, 1k slots: 8 splits of 2 blocks (96 programs), not 4 of 4
    assert triton_ops._num_splits(1, 12, 1024, 64) == 8
    assert triton_ops._num_splits(1, 12, 1024, 64, min_blocks=4) == 4
    for args in [(1, 1, 1, 64), (3, 5, 1000, 64), (7, 2, 100000, 16)]:
        n = triton_ops._num_splits(*args)
        assert n >= 1 and n & (n - 1) == 0


def test_live_loads_rule():
    """K/V loads skip the position wait only where no live slot can be out of reach."""
    from jaxrl_sym.ops.attention import KernelMask

    assert triton_ops._live_loads(KernelMask(), 1 << 20)  # causal: every live slot visible
    assert triton_ops._live_loads(KernelMask(lookback=63), 64)  # a ring of the window's length
    assert not triton_ops._live_loads(KernelMask(lookback=63), 65)  # window over longer store
    assert triton_ops._live_loads(KernelMask(period=16), 16)
    assert not triton_ops._live_loads(KernelMask(period=16), 32)
    assert not triton_ops._live_loads(KernelMask(lookback=7, period=16), 16)


def test_decode_combine_in_split_many_splits_one_launch():
    """Batch 1 with 32 splits, combined by the last program of each (row, kv head): equal to the
    two-launch combine and the reference, and one kernel launch where the other has two."""
    rng = np.random.default_rng(21)
    args = _decode_case(rng, b=1, cap=512, hkv=2, g=3, d=16, dt="f32", n_live=[509],
                        layout="holes")
    calls = []
    real = launch.launch

    def counted(kernel, **kw):
        calls.append(kernel.__name__ if hasattr(kernel, "__name__") else str(kernel))
        return real(kernel, **kw)

    outs = {}
    for combine in ("in_split", "launch"):
        calls.clear()
        with mock.patch.object(launch, "launch", counted):
            outs[combine] = triton_ops.decode_attention(*args, pattern=Causal(), block_n=16,
                                                        num_splits=32, combine=combine)
        outs[combine + "_launches"] = len(calls)
    assert outs["in_split_launches"] == 1 and outs["launch_launches"] == 2
    _close(outs["in_split"], outs["launch"], "f32")
    _close(outs["in_split"], _ref_decode(*args, Causal(), 0.25), "f32")


def test_decode_kernel_bench_variants_equal_the_reference():
    """Each layout the GPU plan's kernel item times (``bench decode_kernel --variants``), as the
    benchmark calls it, gives the reference's output: a variant's keywords are checked here
    before a device minute is spent on them."""
    from bench.experiments.decode_kernel import VARIANTS, variant_op

    rng = np.random.default_rng(23)
    args = _decode_case(rng, b=1, cap=512, hkv=2, g=4, d=16, dt="f32", n_live=[512],
                        layout="holes")
    expected = _ref_decode(*args, Causal(), 0.25)
    splits = {}
    for variant in VARIANTS:
        op, splits[variant] = variant_op(variant, 1, 2, 512)
        _close(op(*args), expected, "f32")
    assert splits["now"] > splits["wide"] > 1  # the split policy and the first run's differ


# --------------------------------------------------------------------------- linear attention


@FAST
@given(
    seed=st.integers(0, 2**16),
    dt=st.sampled_from(["f32", "bf16"]),
    g=st.sampled_from([1, 2, 4]),
    dims=st.sampled_from([(16, 16), (16, 32), (32, 16), (8, 80)]),
)
def test_linear_decode_matches_jnp(seed, dt, g, dims):
    rng = np.random.default_rng(seed)
    b, hkv = 2, 2
    d, dv = dims
    dtype = DTYPES[dt]
    q = jnp.asarray(rng.standard_normal((b, hkv * g, d)), dtype)
    k = jnp.asarray(rng.standard_normal((b, hkv, d)), dtype)
    v = jnp.asarray(rng.standard_normal((b, hkv, dv)), dtype)
    s = jnp.asarray(rng.random((b, hkv, d, dv)), jnp.float32)
    z = jnp.asarray(rng.random((b, hkv, d)), jnp.float32)
    out, s_new, z_new = jax.jit(triton_ops.linear_decode)(q, k, v, s, z)
    pk = phi(k.astype(jnp.float32))
    s_ref = s + pk[..., :, None] * v.astype(jnp.float32)[..., None, :]
    z_ref = z + pk
    pq = phi(q.astype(jnp.float32)).reshape(b, hkv, g, d)
    num = jnp.einsum("bhgd,bhde->bhge", pq, s_ref)
    den = jnp.einsum("bhgd,bhd->bhg", pq, z_ref)[..., None]
    _close(out, (num / den).reshape(b, hkv * g, dv), dt)
    _close(s_new, s_ref, "f32")
    _close(z_new, z_ref, "f32")


def test_linear_decode_steps_equal_reference_attention():
    """T recurrent steps from an empty state reproduce reference_attention(Linear) row by row."""
    rng = np.random.default_rng(3)
    t_len, hkv, g, d = 9, 2, 2, 16
    q = jnp.asarray(rng.standard_normal((1, t_len, hkv * g, d)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((1, t_len, hkv, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((1, t_len, hkv, d)), jnp.float32)
    pos = jnp.arange(t_len, dtype=jnp.int32)[None]
    seg = jnp.zeros_like(pos)
    ref = _ref(q, k, v, pos, pos, seg, seg, pattern=Linear(), scale=1.0)
    s = jnp.zeros((1, hkv, d, d), jnp.float32)
    z = jnp.zeros((1, hkv, d), jnp.float32)
    step = jax.jit(triton_ops.linear_decode, donate_argnums=(3,))
    for t in range(t_len):
        out, s, z = step(q[:, t], k[:, t], v[:, t], s, z)
        _close(out, ref[:, t], "f32")


def _packed_meta(cu: np.ndarray, n: int) -> tuple[jax.Array, jax.Array]:
    """Segment ids / positions computed independently of the code under test."""
    seg = np.full(n, len(cu) - 1, np.int32)
    pos = np.full(n, -1, np.int32)
    for s in range(len(cu) - 1):
        seg[cu[s]:cu[s + 1]] = s
        pos[cu[s]:cu[s + 1]] = np.arange(cu[s + 1] - cu[s])
    return jnp.asarray(seg)[None], jnp.asarray(pos)[None]


def _packed_case(rng, lengths, pad, hkv, g, d, dt, dv=None):
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    n = int(cu[-1]) + pad
    dtype = DTYPES[dt]
    q = jnp.asarray(rng.standard_normal((n, hkv * g, d)), dtype)
    k = jnp.asarray(rng.standard_normal((n, hkv, d)), dtype)
    v = jnp.asarray(rng.standard_normal((n, hkv, dv or d)), dtype)
    return q, k, v, cu


lengths_st = st.lists(st.sampled_from([0, 1, 2, 15, 16, 17, 40]), min_size=1, max_size=4).filter(
    lambda xs: sum(xs) > 0
)


@FAST
@given(
    seed=st.integers(0, 2**16),
    lengths=lengths_st,
    pad=st.sampled_from([0, 3]),
    dt=st.sampled_from(["f32", "bf16"]),
    g=st.sampled_from([1, 2, 4]),
)
def test_linear_packed_matches_reference(seed, lengths, pad, dt, g):
    rng = np.random.default_rng(seed)
    q, k, v, cu = _packed_case(rng, lengths, pad, 2, g, 16, dt, dv=32)
    out = jax.jit(functools.partial(triton_ops.linear_packed, block_t=16))(q, k, v, jnp.asarray(cu))
    seg, pos = _packed_meta(cu, q.shape[0])
    ref = _ref(q[None], k[None], v[None], pos, pos, seg, seg, pattern=Linear(), scale=1.0)[0]
    _close(out, ref, dt)


# --------------------------------------------------------------------------- packed attention


def _ref_packed(q, k, v, cu, pattern, scale):
    seg, pos = _packed_meta(cu, q.shape[0])
    return _ref_packed_meta(q, k, v, seg, pos, pattern, scale)


@functools.partial(jax.jit, static_argnums=(5, 6))
def _ref_packed_meta(q, k, v, seg, pos, pattern, scale):
    return reference_attention(q[None], k[None], v[None], pos, pos, seg, seg, pattern=pattern,
                               scale=scale)[0]


def _ref_lse(q, k, cu, pattern, scale):
    seg, pos = _packed_meta(cu, q.shape[0])
    return _ref_lse_meta(q, k, seg, pos, pattern, scale)


@functools.partial(jax.jit, static_argnums=(4, 5))
def _ref_lse_meta(q, k, seg, pos, pattern, scale):
    g = q.shape[1] // k.shape[1]
    kf = jnp.repeat(k.astype(jnp.float32), g, axis=1)
    s = jnp.einsum("qhd,khd->hqk", q.astype(jnp.float32), kf) * scale
    mask = attention_mask(pattern, pos, pos, seg, seg)[0][None]
    # Masked with a finite floor so the reference gradient stays finite; empty rows -> -inf.
    lse = jax.nn.logsumexp(jnp.where(mask, s, -1e30), axis=-1)
    return jnp.where(mask.any(-1), lse, -jnp.inf).T  # [N, Hq]


PATTERNS = [("causal", 1), ("window", 1), ("window", 7), ("window", 100), ("block", 4),
            ("block", 16)]


@FAST
@given(
    seed=st.integers(0, 2**16),
    lengths=lengths_st,
    pad=st.sampled_from([0, 5]),
    dt=st.sampled_from(["f32", "bf16"]),
    g=st.sampled_from([1, 2, 4]),
    pattern=st.sampled_from(PATTERNS),
)
def test_packed_attention_forward(seed, lengths, pad, dt, g, pattern):
    rng = np.random.default_rng(seed)
    q, k, v, cu = _packed_case(rng, lengths, pad, 2, g, 16, dt)
    pat = _pattern(*pattern)
    op = functools.partial(triton_ops.packed_attention, pattern=pat, return_lse=True,
                           block_m=16, block_n=16)
    out, lse = jax.jit(op)(q, k, v, jnp.asarray(cu))
    assert out.dtype == q.dtype and lse.shape == q.shape[:2]
    _close(out, _ref_packed(q, k, v, cu, pat, 0.25), dt)
    ref_lse = np.asarray(_ref_lse(q, k, cu, pat, 0.25))
    lse = np.asarray(lse)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    fin = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[fin], ref_lse[fin], **TOL[dt])


@settings(max_examples=6, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**16),
    lengths=lengths_st,
    pad=st.sampled_from([0, 5]),
    dt=st.sampled_from(["f32", "bf16"]),
    g=st.sampled_from([1, 2, 4]),
    pattern=st.sampled_from(PATTERNS),
)
def test_packed_attention_grads(seed, lengths, pad, dt, g, pattern):
    rng = np.random.default_rng(seed)
    q, k, v, cu = _packed_case(rng, lengths, pad, 2, g, 16, dt)
    pat = _pattern(*pattern)
    w = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    cu_j = jnp.asarray(cu)

    def loss_kernel(q, k, v):
        o = triton_ops.packed_attention(q, k, v, cu_j, pattern=pat, block_m=16, block_n=16)
        return jnp.sum(o.astype(jnp.float32) * w)

    def loss_ref(q, k, v):
        return jnp.sum(_ref_packed(q, k, v, cu, pat, 0.25).astype(jnp.float32) * w)

    got = jax.jit(jax.grad(loss_kernel, argnums=(0, 1, 2)))(q, k, v)
    want = jax.jit(jax.grad(loss_ref, argnums=(0, 1, 2)))(q, k, v)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype
        _close(a, b, dt, GRAD_TOL[dt])


@pytest.mark.parametrize(
    ("lengths", "pattern"),
    [
        ([1], Causal()),  # length 1
        ([16, 16], Block(16)),  # tiles aligned with sequences and blocks
        ([17, 0, 15], Window(3)),  # straddling tiles, an empty sequence
        ([40], Window(100)),  # window > length
        ([33, 7], Block(8)),
        ([50], Window(7)),  # window binds inside the sequence: key block -> query range cut
        ([45, 9], Block(4)),  # blocks binding inside the sequence
    ],
)
def test_packed_attention_edges_fwd_and_grad_with_lse(lengths, pattern):
    """Edge layouts, with the logsumexp output in the loss so its cotangent path is checked."""
    rng = np.random.default_rng(len(lengths))
    q, k, v, cu = _packed_case(rng, lengths, 2, 2, 2, 32, "f32")
    scale = 1 / np.sqrt(32)
    cu_j = jnp.asarray(cu)
    wl = jnp.asarray(rng.standard_normal(q.shape[:2]), jnp.float32)
    fin = jnp.isfinite(_ref_lse(q, k, cu, pattern, scale))

    def loss_kernel(q, k, v):
        o, lse = triton_ops.packed_attention(q, k, v, cu_j, pattern=pattern, return_lse=True,
                                             block_m=16, block_n=16)
        return jnp.sum(o) + jnp.sum(jnp.where(fin, lse, 0.0) * wl)

    def loss_ref(q, k, v):
        lse = _ref_lse(q, k, cu, pattern, scale)
        return jnp.sum(_ref_packed(q, k, v, cu, pattern, scale)) + jnp.sum(
            jnp.where(fin, lse, 0.0) * wl)

    l1, g1 = jax.jit(jax.value_and_grad(loss_kernel, argnums=(0, 1, 2)))(q, k, v)
    l2, g2 = jax.jit(jax.value_and_grad(loss_ref, argnums=(0, 1, 2)))(q, k, v)
    np.testing.assert_allclose(float(l1), float(l2), rtol=1e-4)
    for a, b in zip(g1, g2, strict=True):
        _close(a, b, "f32", GRAD_TOL["f32"])


def test_packed_attention_jit_one_compile_for_all_lengths():
    rng = np.random.default_rng(4)
    q, k, v, _ = _packed_case(rng, [48], 0, 1, 2, 16, "f32")
    f = jax.jit(jax.value_and_grad(
        lambda q, cu: jnp.sum(triton_ops.packed_attention(q, k, v, cu, pattern=Causal(),
                                                          block_m=16, block_n=16))))
    for lengths in ([48], [10, 30, 8], [1, 1, 20]):
        cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        cu = np.pad(cu, (0, 4 - len(cu)), mode="edge")  # static S: pad with empty sequences
        val, dq = f(q, jnp.asarray(cu))
        ref = jnp.sum(_ref_packed(q, k, v, cu, Causal(), 0.25))
        np.testing.assert_allclose(float(val), float(ref), rtol=1e-4, atol=1e-4)
        assert not np.isnan(np.asarray(dq)).any()
    assert f._cache_size() == 1


# --------------------------------------------------------------------------- API / launcher


def test_backend_detection():
    assert triton_available()
    assert MODE in ("gpu", "interpreter")
    expected = "gpu" if any(d.platform == "gpu" for d in jax.devices()) else "interpreter"
    assert backend_name() == expected


def test_launch_rejects_python_scalars():
    kmod = launch.import_kernels("decode_attention")
    with pytest.raises(TypeError, match="device arrays"):
        launch.launch(kmod.decode_reduce_kernel, grid=(1,), inputs=(3,), out_shapes=[],
                      constexprs={})


def test_input_validation():
    q = jnp.zeros((1, 2, 16))
    k = jnp.zeros((1, 1, 8, 16))  # [B, Hkv, C, D]
    i32 = jnp.zeros((1,), jnp.int32)
    pos = jnp.zeros((1, 8), jnp.int32)
    with pytest.raises(PatternError):
        triton_ops.decode_attention(q, k, k, pos, i32, i32, pattern=Linear())
    with pytest.raises(InputError, match="int32"):
        triton_ops.decode_attention(q, k, k, pos, i32, i32.astype(jnp.float32), pattern=Causal())
    with pytest.raises(InputError, match="power of two"):
        triton_ops.decode_attention(q, k, k, pos, i32, i32, pattern=Causal(), num_splits=3)
    with pytest.raises(InputError, match="share one dtype"):
        triton_ops.packed_attention(jnp.zeros((4, 2, 16), jnp.bfloat16), jnp.zeros((4, 1, 16)),
                                    jnp.zeros((4, 1, 16)), jnp.zeros(2, jnp.int32),
                                    pattern=Causal())


_COMPILE_SCRIPT = textwrap.dedent(
    """
    import importlib, sys
    from unittest import mock
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    import jax, jax.numpy as jnp
    from jaxrl_sym.backends import launch as L, triton_ops as T
    from jaxrl_sym.ops.attention import Block, Causal, Window

    calls = []
    def record(kernel, *, grid, inputs, out_shapes, constexprs, num_warps=4, num_stages=2, **kw):
        dts = [x.dtype for x in inputs] + [s.dtype for s in out_shapes]
        calls.append((kernel, dts, dict(constexprs), num_warps, num_stages))
        return tuple(jnp.zeros(s.shape, s.dtype) for s in out_shapes)

    TY = {"float32": "fp32", "bfloat16": "bf16", "int32": "i32"}
    with mock.patch.object(L, "launch", record), \\
         mock.patch.object(L, "backend_name", lambda: "gpu"), \\
         mock.patch.object(L, "import_kernels",
                           lambda n: importlib.import_module("kernels." + n)):
        for dt in (jnp.bfloat16, jnp.float32):
            b, cap, hkv, g, d = 2, 4096, 2, 7, 128
            z = lambda *s, t=dt: jnp.zeros(s, t)
            i = lambda *s: jnp.zeros(s, jnp.int32)
            for ns, comb, pat in ((None, "in_split", Window(100)), (None, "launch", Causal()),
                                  (1, "in_split", Window(100))):
                jax.eval_shape(lambda: T.decode_attention(
                    z(b, hkv * g, d), z(b, hkv, cap, d), z(b, hkv, cap, d), i(b, cap), i(b),
                    i(b), pattern=pat, num_splits=ns, combine=comb))
            n = 512
            q, k, cu = z(n, hkv * g, d), z(n, hkv, d), i(5)
            loss = lambda q, k, v: T.packed_attention(q, k, v, cu, pattern=Block(16)).astype(
                jnp.float32).sum()
            jax.eval_shape(jax.grad(loss, argnums=(0, 1, 2)), q, k, k)
            if dt == jnp.float32:
                continue  # the linear kernels compute in fp32 whatever the input dtype
            jax.eval_shape(lambda: T.linear_packed(q, k, k, cu))
            jax.eval_shape(lambda: T.linear_decode(
                z(b, hkv * g, d), z(b, hkv, d), z(b, hkv, d), z(b, hkv, d, d, t=jnp.float32),
                z(b, hkv, d, t=jnp.float32)))
    for kernel, dts, consts, nw, ns in calls:
        ptrs = [a for a in kernel.arg_names if a not in consts]
        assert len(ptrs) == len(dts), (kernel.__name__, ptrs, dts)
        sig = {a: "constexpr" if a in consts else "*" + TY[jnp.dtype(dts[ptrs.index(a)]).name]
               for a in kernel.arg_names}
        c = triton.compile(ASTSource(kernel, sig, consts), target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": nw, "num_stages": ns})
        print(kernel.__name__, consts.get("F32_DOT"), c.metadata.shared, flush=True)
        assert c.metadata.shared <= 232448, (kernel.__name__, c.metadata.shared)
    print("compiled", len(calls))
    """
)


def test_kernels_compile_for_sm90():
    """Every kernel variant the ops launch compiles to a cubin for an H100 (sm_90, with Triton's
    bundled ptxas, no GPU needed) and fits its 227 KiB of shared memory. Runs in a subprocess
    because this process imported triton in interpreter mode."""
    if importlib.util.find_spec("triton.backends.nvidia") is None:
        pytest.skip("triton's NVIDIA backend is not installed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["JAX_PLATFORMS"] = "cpu"
    res = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], env=env, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    assert "compiled 16" in res.stdout, res.stdout


# --------------------------------------------------------------------------- real GPU path


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("pattern", [Causal(), Window(256), Block(128)])
def test_gpu_decode_attention(pattern):
    rng = np.random.default_rng(5)
    args = _decode_case(rng, b=4, cap=2048, hkv=2, g=7, d=64, dt="bf16",
                        n_live=[2048, 1, 700, 1500], layout="ring")
    out = jax.jit(lambda *a: triton_ops.decode_attention(*a, pattern=pattern))(*args)
    _close(out, _ref_decode(*args, pattern, 0.125), "bf16")


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("combine", ["in_split", "launch"])
def test_gpu_decode_attention_batch1_many_splits(combine):
    """Batch 1, 64 splits: the in-split combine's tickets and memory ordering on real hardware
    (the interpreter runs programs one after another and cannot race), 20 calls in a row."""
    rng = np.random.default_rng(8)
    args = _decode_case(rng, b=1, cap=8192, hkv=2, g=7, d=64, dt="bf16", n_live=[8191],
                        layout="holes")
    f = jax.jit(lambda *a: triton_ops.decode_attention(*a, pattern=Causal(), combine=combine))
    want = _ref_decode(*args, Causal(), 0.125)
    for _ in range(20):
        _close(f(*args), want, "bf16")


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("dt", ["f32", "bf16"])
def test_gpu_packed_attention_fwd_bwd(dt):
    rng = np.random.default_rng(6)
    q, k, v, cu = _packed_case(rng, [300, 1, 129, 64], 30, 2, 7, 64, dt)
    cu_j = jnp.asarray(cu)
    w = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    lk = lambda q, k, v: jnp.sum(triton_ops.packed_attention(q, k, v, cu_j, pattern=Window(100))
                                 .astype(jnp.float32) * w)
    lr = lambda q, k, v: jnp.sum(_ref_packed(q, k, v, cu, Window(100), 0.125)
                                 .astype(jnp.float32) * w)
    g1 = jax.jit(jax.grad(lk, argnums=(0, 1, 2)))(q, k, v)
    g2 = jax.jit(jax.grad(lr, argnums=(0, 1, 2)))(q, k, v)
    for a, b in zip(g1, g2, strict=True):
        _close(a, b, dt, GRAD_TOL[dt])


@pytest.mark.gpu
@gpu_only
def test_gpu_linear():
    rng = np.random.default_rng(7)
    q, k, v, cu = _packed_case(rng, [300, 1, 129], 5, 2, 4, 64, "bf16")
    out = jax.jit(triton_ops.linear_packed)(q, k, v, jnp.asarray(cu))
    seg, pos = _packed_meta(cu, q.shape[0])
    ref = _ref(q[None], k[None], v[None], pos, pos, seg, seg, pattern=Linear(), scale=1.0)[0]
    _close(out, ref, "bf16")
    s = jnp.zeros((4, 2, 64, 64), jnp.float32)
    zz = jnp.zeros((4, 2, 64), jnp.float32)
    o, s, zz = jax.jit(triton_ops.linear_decode, donate_argnums=(3,))(q[:4], k[:4], v[:4], s, zz)
    assert np.isfinite(np.asarray(o, np.float32)).all()


def test_decode_size_guard_is_per_row():
    """Rows are offset in int64 in the kernel: a batch whose whole store exceeds int32 elements
    (64 x 32k slots x 16 heads x 64) is accepted; one row over int32 is refused by name."""
    from jaxrl_sym.errors import InputError

    def spec(b, cap, h, d):
        return (jax.ShapeDtypeStruct((b, h * 1, d), jnp.bfloat16),
                jax.ShapeDtypeStruct((b, h, cap, d), jnp.bfloat16),  # [B, Hkv, C, D]
                jax.ShapeDtypeStruct((b, h, cap, d), jnp.bfloat16),
                jax.ShapeDtypeStruct((b, cap), jnp.int32),
                jax.ShapeDtypeStruct((b,), jnp.int32), jax.ShapeDtypeStruct((b,), jnp.int32))

    f = lambda *a: triton_ops.decode_attention(*a, pattern=Causal(), num_splits=1)
    out = jax.eval_shape(f, *spec(64, 32768, 16, 64))
    assert out.shape == (64, 16, 64)
    with pytest.raises(InputError, match="exceeds the kernels' int32 indexing"):
        jax.eval_shape(f, *spec(1, 1 << 22, 16, 64))


# --------------------------------------------------------------------------- soft-capping


def _softcap_case(rng, b, t, hq, hkv, d):
    q = rng.standard_normal((b, t, hq, d)) * 2  # large logits, so the cap bites
    k = rng.standard_normal((b, t, hkv, d)) * 2
    v = rng.standard_normal((b, t, hkv, d))
    pos = np.tile(np.arange(t, dtype=np.int32), (b, 1))
    pos[0, :2] = -1  # padding
    seg = np.zeros((b, t), np.int32)
    return q, k, v, pos, seg


@pytest.mark.parametrize("kind, size", [("causal", 1), ("window", 3), ("block", 4)])
def test_reference_with_softcap_equals_naive(kind, size):
    from naive import naive_attention

    from jaxrl_sym.ops.attention import reference_attention

    rng = np.random.default_rng(11)
    q, k, v, pos, seg = _softcap_case(rng, 2, 9, 4, 2, 8)
    pattern = _pattern(kind, size)
    for cap in (0.0, 5.0):
        got = reference_attention(*(jnp.asarray(x, jnp.float32) for x in (q, k, v)), pos, pos,
                                  seg, seg, pattern=pattern, scale=0.5, softcap=cap)
        want = naive_attention(q, k, v, pos, pos, seg, seg, pattern=kind, size=size, scale=0.5,
                               softcap=cap)
        np.testing.assert_allclose(np.asarray(got), want, atol=2e-5)
    capped = reference_attention(*(jnp.asarray(x, jnp.float32) for x in (q, k, v)), pos, pos,
                                 seg, seg, pattern=pattern, scale=0.5, softcap=5.0)
    plain = reference_attention(*(jnp.asarray(x, jnp.float32) for x in (q, k, v)), pos, pos,
                                seg, seg, pattern=pattern, scale=0.5)
    assert float(jnp.abs(capped - plain).max()) > 1e-2  # the cap changes the result


def test_decode_kernel_with_softcap_equals_naive():
    from naive import naive_attention

    rng = np.random.default_rng(12)
    b, cap, hkv, g, d = 2, 32, 2, 2, 16
    q = rng.standard_normal((b, hkv * g, d)) * 2
    k = rng.standard_normal((b, cap, hkv, d)) * 2
    v = rng.standard_normal((b, cap, hkv, d))
    n_live = np.array([32, 13], np.int32)
    kv_pos = np.where(np.arange(cap)[None] < n_live[:, None], np.arange(cap)[None], -1)
    kv_pos = kv_pos.astype(np.int32)
    q_pos = n_live - 1
    heads = lambda x: np.swapaxes(x, 1, 2)  # the kernel's stores: [B, Hkv, C, D]
    out = triton_ops.decode_attention(
        *(jnp.asarray(x, jnp.float32) for x in (q, heads(k), heads(v))), jnp.asarray(kv_pos),
        jnp.asarray(q_pos), jnp.asarray(n_live), pattern=Window(9), scale=0.4, softcap=3.0,
        num_splits=2, block_n=16)
    want = naive_attention(q[:, None], k, v, q_pos[:, None], kv_pos,
                           np.zeros((b, 1), np.int32), np.zeros((b, cap), np.int32),
                           pattern="window", size=9, scale=0.4, softcap=3.0)[:, 0]
    np.testing.assert_allclose(np.asarray(out), want, atol=1e-4)


def test_packed_kernels_with_softcap_equal_naive_and_autodiff():
    from naive import naive_attention

    from jaxrl_sym.ops.attention import reference_attention

    rng = np.random.default_rng(13)
    q, k, v, cu = _packed_case(rng, [20, 1, 13], 3, 2, 2, 16, "f32")
    q, k = q * 2, k * 2
    cu_j = jnp.asarray(cu)
    seg, pos = _packed_meta(cu, q.shape[0])  # [1, N] each
    f = lambda q, k, v: triton_ops.packed_attention(q, k, v, cu_j, pattern=Causal(), scale=0.4,
                                                    softcap=2.0, block_m=16, block_n=16)
    out = f(q, k, v)
    want = naive_attention(np.asarray(q)[None], np.asarray(k)[None], np.asarray(v)[None],
                           np.asarray(pos), np.asarray(pos), np.asarray(seg), np.asarray(seg),
                           scale=0.4, softcap=2.0)[0]
    np.testing.assert_allclose(np.asarray(out), want, atol=1e-4)
    w = jnp.asarray(rng.standard_normal(out.shape), jnp.float32)
    ref = lambda q, k, v: reference_attention(q[None], k[None], v[None], pos, pos, seg, seg,
                                              pattern=Causal(), scale=0.4, softcap=2.0)[0]
    g1 = jax.grad(lambda *a: jnp.sum(f(*a) * w), argnums=(0, 1, 2))(q, k, v)
    g2 = jax.grad(lambda *a: jnp.sum(ref(*a) * w), argnums=(0, 1, 2))(q, k, v)
    for a, b_ in zip(g1, g2, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b_), atol=2e-4)
