"""Single-token decode attention as one Pallas kernel: the decode step's attention in one launch
that XLA:GPU keeps inside its CUDA graph.

Why: on the H100 a decode step is ~500 small GPU operations at ~5.5 µs each beyond their bytes
(``bench/results/projection/dispatch/README.md``); the XLA backend's masked attention is five
of them a layer (scores, max, sum, divide, P·V) and reads every slot of the store. The Triton
kernel of :mod:`jaxrl_sym.backends.triton_ops` does it in one, but jax-triton 0.3.x lowers to
the legacy ``triton_kernel_call``, which XLA never captures: a body holding one is launched op
by op from the host (``bench/results/projection/dispatch/triton_capture.md``). A Pallas kernel
lowers to XLA's own Triton custom call (``__gpu$xla.gpu.triton``), which XLA compiles with its
bundled Triton into an ordinary kernel — captured like a fusion, with no jax-triton or triton
wheel on the GPU machine.

On a CPU the same kernel runs under Pallas' interpreter (``interpret=True``): slow, for
correctness tests. Compiling for a GPU from a machine without one (the dispatch ledger) needs
the target's device kind in scope: :func:`jaxrl_sym.backends.pallas_ops.decode_attention`'s
lowering reads it from the abstract mesh the caller enters.

Semantics: :func:`jaxrl_sym.backends.triton_ops.decode_attention`'s — one query token per row
over a slot store, masked by stored position (ring slots may be in any order), slots
``>= n_live`` never read, a query without a visible key gets 0 — with every product and sum in
fp32, as the XLA backend's reference attention computes them.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxrl_sym.errors import InputError
from jaxrl_sym.ops.attention import KernelMask, Pattern

NEG = -1.0e30
"""A masked score: finite, so a block with no visible key leaves the running max finite and
its correction factor exp(0) = 1 (−inf would give NaN); its probabilities are zeroed by mask."""

BLOCK_N = 64
"""Slots per step of the kernel's loop over the store (a power of two ≥ 16: Triton's dot)."""


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _visible(mask: KernelMask, k_pos: jax.Array, q_pos: jax.Array) -> jax.Array:
    """The kernels' mask family (:class:`~jaxrl_sym.ops.attention.KernelMask`) by positions."""
    ok = (k_pos >= 0) & (k_pos <= q_pos)
    if mask.lookback is not None:
        ok &= k_pos >= q_pos - mask.lookback
    if mask.period is not None:
        ok &= k_pos >= q_pos - q_pos % mask.period
    return ok


def _kernel(q_ref, k_ref, v_ref, kpos_ref, qpos_ref, live_ref, o_ref, *, mask: KernelMask,
            group: int, scale: float, softcap: float) -> None:
    """One (row, kv head): its ``group`` query heads against the live slots, online softmax
    over blocks of :data:`BLOCK_N` slots (flash-decoding without the split: a decode step's
    rows × kv heads already fill the GPU at RL batch sizes)."""
    block_h = q_ref.shape[0]
    cap = k_ref.shape[0]
    heads = (jnp.arange(block_h) < group)[:, None]
    q = plgpu.load(q_ref, mask=heads, other=0.0).astype(jnp.float32)
    q_pos = qpos_ref[()]
    n_live = jnp.minimum(live_ref[()], cap)
    lanes = jnp.arange(BLOCK_N)

    def body(i, carry):
        acc, m_prev, l_prev = carry
        slots = i * BLOCK_N + lanes
        inside = slots < n_live
        block = pl.ds(i * BLOCK_N, BLOCK_N)
        k_pos = plgpu.load(kpos_ref.at[block], mask=inside, other=-1)
        k = plgpu.load(k_ref.at[block, :], mask=inside[:, None], other=0.0).astype(jnp.float32)
        s = plgpu.dot(q, k, trans_b=True, allow_tf32=False) * scale
        if softcap:
            s = softcap * jnp.tanh(s / softcap)
        ok = (inside & _visible(mask, k_pos, q_pos))[None, :]
        s = jnp.where(ok, s, NEG)
        m_next = jnp.maximum(m_prev, s.max(axis=-1))
        p = jnp.where(ok, jnp.exp(s - m_next[:, None]), 0.0)
        corr = jnp.exp(m_prev - m_next)
        v = plgpu.load(v_ref.at[block, :], mask=inside[:, None], other=0.0).astype(jnp.float32)
        acc = corr[:, None] * acc + plgpu.dot(p, v, allow_tf32=False)
        return acc, m_next, corr * l_prev + p.sum(axis=-1)

    init = (jnp.zeros((block_h, v_ref.shape[1]), jnp.float32),
            jnp.full((block_h,), NEG, jnp.float32), jnp.zeros((block_h,), jnp.float32))
    acc, _, den = lax.fori_loop(0, pl.cdiv(n_live, BLOCK_N), body, init)
    out = jnp.where(den[:, None] > 0, acc / jnp.where(den > 0, den, 1.0)[:, None], 0.0)
    plgpu.store(o_ref, out.astype(o_ref.dtype), mask=heads)


def _check(q: jax.Array, k_store: jax.Array, v_store: jax.Array, kv_pos: jax.Array,
           q_pos: jax.Array, n_live: jax.Array) -> None:
    """The operands refused by name when the kernel cannot take them."""
    op = "pallas decode_attention"
    if q.ndim != 3 or k_store.ndim != 4 or v_store.ndim != 4:
        raise InputError(f"{op}(): want q [B,Hq,D], stores [B,Hkv,C,D]; got {q.shape}, "
                         f"{k_store.shape}, {v_store.shape}")
    b, hq, d = q.shape
    _, hkv, cap, _ = k_store.shape
    if k_store.shape[:3] != v_store.shape[:3] or k_store.shape[3] != d or k_store.shape[0] != b:
        raise InputError(f"{op}(): shapes q{q.shape} k{k_store.shape} v{v_store.shape} disagree")
    if hq % hkv:
        raise InputError(f"{op}(): {hq} query heads is not a multiple of {hkv} kv heads")
    if kv_pos.shape != (b, cap) or q_pos.shape != (b,) or n_live.shape != (b,):
        raise InputError(f"{op}(): want kv_pos [B,C], q_pos [B], n_live [B]; got "
                         f"{kv_pos.shape}, {q_pos.shape}, {n_live.shape}")
    for name, x in (("kv_pos", kv_pos), ("q_pos", q_pos), ("n_live", n_live)):
        if x.dtype != jnp.int32:
            raise InputError(f"{op}(): {name} must be int32, got {x.dtype}")
    if not supports(d, v_store.shape[3]):
        raise InputError(f"{op}(): head dims {d}/{v_store.shape[3]} are not powers of two "
                         ">= 16 (Triton's dot tiles); use backend='xla' for this model")


def supports(d: int, dv: int) -> bool:
    """Head dims the kernel tiles: powers of two >= 16 (Triton's dot); the stores of other
    models run the XLA backend's masked attention (same result)."""
    return all(n >= 16 and not n & (n - 1) for n in (d, dv))


def decode_attention_here(*args: jax.Array, **kw: object) -> jax.Array:
    """:func:`decode_attention` compiled where the program is lowered for a GPU, interpreted
    where it is lowered for the CPU: the choice is the lowering platform's
    (``lax.platform_dependent``), so one traced step program serves both, and a program
    compiled for an H100 on a machine without one (the dispatch ledger) gets the kernel."""
    run = functools.partial(decode_attention, **kw)
    return lax.platform_dependent(*args, cpu=functools.partial(run, interpret=True),
                                  default=run)


def decode_attention(q: jax.Array, k_store: jax.Array, v_store: jax.Array, kv_pos: jax.Array,
                     q_pos: jax.Array, n_live: jax.Array, *, pattern: Pattern,
                     scale: float | None = None, softcap: float = 0.0,
                     interpret: bool = False) -> jax.Array:
    """Attention of one query token per row over a slot store; ``[B, Hq, Dv]`` in q.dtype.

    Shapes and meaning as :func:`jaxrl_sym.backends.triton_ops.decode_attention`: q
    ``[B, Hq, D]``; stores ``[B, Hkv, C, D|Dv]`` heads-major; ``kv_pos [B, C]`` (-1 empty),
    ``q_pos [B]``, ``n_live [B]`` int32 device arrays (one compile for every length up to C).
    ``interpret``: run under Pallas' interpreter (a CPU), else lower for the GPU."""
    mask = pattern.kernel_mask()
    if mask is None:
        raise InputError(f"pallas decode_attention(): pattern {pattern!r} has no kernel mask; "
                         "use backend='xla'")
    _check(q, k_store, v_store, kv_pos, q_pos, n_live)
    b, hq, d = q.shape
    _, hkv, cap, dv = v_store.shape
    group = hq // hkv
    block_h = max(16, _pow2(group))
    kernel = functools.partial(
        _kernel, mask=mask, group=group, softcap=float(softcap),
        scale=1.0 / math.sqrt(d) if scale is None else float(scale))
    row = lambda i, h: (i,)
    out = pl.pallas_call(
        kernel, grid=(b, hkv), interpret=interpret, name="decode_attention",
        out_shape=jax.ShapeDtypeStruct((b, hkv, group, dv), q.dtype),
        in_specs=[pl.BlockSpec((None, None, block_h, d), lambda i, h: (i, h, 0, 0)),
                  pl.BlockSpec((None, None, cap, d), lambda i, h: (i, h, 0, 0)),
                  pl.BlockSpec((None, None, cap, dv), lambda i, h: (i, h, 0, 0)),
                  pl.BlockSpec((None, cap), lambda i, h: (i, 0)),
                  pl.BlockSpec((None,), row), pl.BlockSpec((None,), row)],
        out_specs=pl.BlockSpec((None, None, block_h, dv), lambda i, h: (i, h, 0, 0)),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
    )(q.reshape(b, hkv, group, d), k_store, v_store, kv_pos, q_pos, n_live)
    return out.reshape(b, hq, dv)
