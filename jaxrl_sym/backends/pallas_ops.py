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

jax 0.11 marks Pallas' Triton lowering deprecated (a warning at lowering; its successor, Mosaic
GPU, targets Hopper and newer only). The pinned jax 0.11.2 has it; a jax that drops it makes
``backend="pallas"`` fail at lowering, and ``xla`` remains.

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
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxrl_sym.backends.operands import check_decode_operands
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


def _scores(q: jax.Array, k: jax.Array, scale: float, softcap: float) -> jax.Array:
    s = plgpu.dot(q, k, trans_b=True, allow_tf32=False) * scale
    return softcap * jnp.tanh(s / softcap) if softcap else s


def _online(carry: tuple[jax.Array, ...], s: jax.Array, ok: jax.Array, v: jax.Array
            ) -> tuple[jax.Array, ...]:
    """One block of scores ``s [H, N]`` (visible where ``ok [1|H, N]``) and values ``v [N, Dv]``
    folded into the running (output, max, sum) — flash attention's online softmax."""
    acc, m_prev, l_prev = carry
    s = jnp.where(ok, s, NEG)
    m_next = jnp.maximum(m_prev, s.max(axis=-1))
    p = jnp.where(ok, jnp.exp(s - m_next[:, None]), 0.0)
    corr = jnp.exp(m_prev - m_next)
    acc = corr[:, None] * acc + plgpu.dot(p, v, allow_tf32=False)
    return acc, m_next, corr * l_prev + p.sum(axis=-1)


def _attend(q, k_ref, v_ref, kpos_ref, q_pos, n_live, *, mask: KernelMask, scale: float,
            softcap: float, skip: jax.Array | None = None) -> tuple[jax.Array, ...]:
    """The running (output, max, sum) of ``q [H, D]`` over the store's live slots, blocks of
    :data:`BLOCK_N`; slot ``skip`` is left out (the step's own entry, written by this kernel:
    its memory is not read back)."""
    lanes = jnp.arange(BLOCK_N)

    def body(i, carry):
        slots = i * BLOCK_N + lanes
        inside = slots < n_live if skip is None else (slots < n_live) & (slots != skip)
        block = pl.ds(i * BLOCK_N, BLOCK_N)
        k_pos = plgpu.load(kpos_ref.at[block], mask=inside, other=-1)
        k = plgpu.load(k_ref.at[block, :], mask=inside[:, None], other=0.0)
        v = plgpu.load(v_ref.at[block, :], mask=inside[:, None], other=0.0)
        ok = (inside & _visible(mask, k_pos, q_pos))[None, :]
        return _online(carry, _scores(q, k.astype(jnp.float32), scale, softcap), ok,
                       v.astype(jnp.float32))

    h = q.shape[0]
    init = (jnp.zeros((h, v_ref.shape[1]), jnp.float32), jnp.full((h,), NEG, jnp.float32),
            jnp.zeros((h,), jnp.float32))
    return lax.fori_loop(0, pl.cdiv(n_live, BLOCK_N), body, init)


def _finish(o_ref, carry: tuple[jax.Array, ...], heads: jax.Array) -> None:
    acc, _, den = carry
    out = jnp.where(den[:, None] > 0, acc / jnp.where(den > 0, den, 1.0)[:, None], 0.0)
    plgpu.store(o_ref, out.astype(o_ref.dtype), mask=heads)


def _kernel(q_ref, k_ref, v_ref, kpos_ref, qpos_ref, live_ref, o_ref, *, group: int,
            **scoring) -> None:
    """One (row, kv head): its ``group`` query heads against the live slots, online softmax
    over blocks of :data:`BLOCK_N` slots (flash-decoding without the split: a decode step's
    rows × kv heads already fill the GPU at RL batch sizes)."""
    heads = (jnp.arange(q_ref.shape[0]) < group)[:, None]
    q = plgpu.load(q_ref, mask=heads, other=0.0).astype(jnp.float32)
    n_live = jnp.minimum(live_ref[()], k_ref.shape[0])
    _finish(o_ref, _attend(q, k_ref, v_ref, kpos_ref, qpos_ref[()], n_live, **scoring), heads)


def _write_kernel(q_ref, kn_ref, vn_ref, pn_ref, k_ref, v_ref, kpos_ref, slot_ref, qpos_ref,
                  live_ref, o_ref, ko_ref, vo_ref, po_ref, *, group: int, **scoring) -> None:
    """:func:`_kernel` that first writes the step's entry (``kn, vn, pn``) to slot ``slot`` of
    the store (aliased in and out) and attends to it from registers: the store writes that
    were three XLA kernels a layer (keys, values, positions) are this one."""
    heads = (jnp.arange(q_ref.shape[0]) < group)[:, None]
    q = plgpu.load(q_ref, mask=heads, other=0.0).astype(jnp.float32)
    slot, q_pos = slot_ref[()], qpos_ref[()]
    kn, vn, pn = kn_ref[...], vn_ref[...], pn_ref[()]
    at = pl.ds(slot, 1)
    plgpu.store(ko_ref.at[at, :], kn[None, :].astype(ko_ref.dtype))
    plgpu.store(vo_ref.at[at, :], vn[None, :].astype(vo_ref.dtype))
    plgpu.store(po_ref.at[at], jnp.full((1,), pn, po_ref.dtype))  # every kv head: same value
    n_live = jnp.minimum(live_ref[()], k_ref.shape[0])
    carry = _attend(q, k_ref, v_ref, kpos_ref, q_pos, n_live, skip=slot, **scoring)
    # the entry itself, a block of one key (zero-padded to Triton's smallest dot)
    one = (jnp.arange(16) == 0)[:, None]
    k1 = jnp.where(one, kn.astype(jnp.float32)[None, :], 0.0)
    v1 = jnp.where(one, vn.astype(jnp.float32)[None, :], 0.0)
    ok = (one[:, 0] & _visible(scoring["mask"], pn, q_pos) & (slot < n_live))[None, :]
    s = _scores(q, k1, scoring["scale"], scoring["softcap"])
    _finish(o_ref, _online(carry, s, ok, v1), heads)


def _check(q: jax.Array, k_store: jax.Array, v_store: jax.Array, kv_pos: jax.Array,
           q_pos: jax.Array, n_live: jax.Array) -> None:
    """The operands refused by name when the kernel cannot take them: the decode kernels' one
    check, then the head dims Triton's dot tiles."""
    op = "pallas decode_attention"
    check_decode_operands(op, q, k_store, v_store, kv_pos, q_pos, n_live)
    d = q.shape[2]
    if not supports(d, v_store.shape[3]):
        raise InputError(f"{op}(): head dims {d}/{v_store.shape[3]} are not powers of two "
                         ">= 16 (Triton's dot tiles); use backend='xla' for this model")


def supports(d: int, dv: int) -> bool:
    """Head dims the kernel tiles: powers of two >= 16 (Triton's dot); the stores of other
    models run the XLA backend's masked attention (same result)."""
    return all(n >= 16 and not n & (n - 1) for n in (d, dv))


def here(fn: Any) -> Any:
    """``fn`` (:func:`decode_attention` or :func:`decode_attention_write`) compiled where the
    program is lowered for a GPU, interpreted where it is lowered for the CPU: the choice is
    the lowering platform's (``lax.platform_dependent``), so one traced step program serves
    both, and a program compiled for an H100 on a machine without one (the dispatch ledger)
    gets the kernel."""
    def run(*args: jax.Array, **kw: Any) -> Any:
        call = functools.partial(fn, **kw)
        return lax.platform_dependent(*args, cpu=functools.partial(call, interpret=True),
                                      default=call)
    return run


def _setup(q: jax.Array, k_store: jax.Array, v_store: jax.Array, kv_pos: jax.Array,
           q_pos: jax.Array, n_live: jax.Array, pattern: Pattern, scale: float | None,
           softcap: float) -> dict[str, Any]:
    """The operands checked, and what both kernels take: the per-(row, kv head) block specs
    of q, the stores and the positions, and the kernel's static arguments."""
    mask = pattern.kernel_mask()
    if mask is None:
        raise InputError(f"pallas decode_attention(): pattern {pattern!r} has no kernel mask; "
                         "use backend='xla'")
    _check(q, k_store, v_store, kv_pos, q_pos, n_live)
    b, hq, d = q.shape
    _, hkv, cap, dv = v_store.shape
    group = hq // hkv
    block_h = max(16, _pow2(group))
    spec = lambda *shape: pl.BlockSpec((None, None, *shape), lambda i, h: (i, h) + (0,) * len(
        shape))
    return dict(
        b=b, hkv=hkv, group=group, dv=dv, q=q.reshape(b, hkv, group, d),
        q_spec=spec(block_h, d), k_spec=spec(cap, d), v_spec=spec(cap, dv),
        pos_spec=pl.BlockSpec((None, cap), lambda i, h: (i, 0)),
        row_spec=pl.BlockSpec((None,), lambda i, h: (i,)), out_spec=spec(block_h, dv),
        static=dict(mask=mask, group=group, softcap=float(softcap),
                    scale=1.0 / math.sqrt(d) if scale is None else float(scale)))


_PARAMS = plgpu.CompilerParams(num_warps=4, num_stages=2)


def decode_attention(q: jax.Array, k_store: jax.Array, v_store: jax.Array, kv_pos: jax.Array,
                     q_pos: jax.Array, n_live: jax.Array, *, pattern: Pattern,
                     scale: float | None = None, softcap: float = 0.0,
                     interpret: bool = False) -> jax.Array:
    """Attention of one query token per row over a slot store; ``[B, Hq, Dv]`` in q.dtype.

    Shapes and meaning as :func:`jaxrl_sym.backends.triton_ops.decode_attention`: q
    ``[B, Hq, D]``; stores ``[B, Hkv, C, D|Dv]`` heads-major; ``kv_pos [B, C]`` (-1 empty),
    ``q_pos [B]``, ``n_live [B]`` int32 device arrays (one compile for every length up to C).
    ``interpret``: run under Pallas' interpreter (a CPU), else lower for the GPU."""
    c = _setup(q, k_store, v_store, kv_pos, q_pos, n_live, pattern, scale, softcap)
    out = pl.pallas_call(
        functools.partial(_kernel, **c["static"]), grid=(c["b"], c["hkv"]),
        interpret=interpret, name="decode_attention", compiler_params=_PARAMS,
        out_shape=jax.ShapeDtypeStruct((c["b"], c["hkv"], c["group"], c["dv"]), q.dtype),
        in_specs=[c["q_spec"], c["k_spec"], c["v_spec"], c["pos_spec"], c["row_spec"],
                  c["row_spec"]],
        out_specs=c["out_spec"],
    )(c["q"], k_store, v_store, kv_pos, q_pos, n_live)
    return out.reshape(q.shape[0], q.shape[1], c["dv"])


def decode_attention_write(q: jax.Array, k_new: jax.Array, v_new: jax.Array,
                           pos_new: jax.Array, k_store: jax.Array, v_store: jax.Array,
                           kv_pos: jax.Array, slot: jax.Array, q_pos: jax.Array,
                           n_live: jax.Array, *, pattern: Pattern, scale: float | None = None,
                           softcap: float = 0.0, interpret: bool = False
                           ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Write the step's entry to slot ``slot`` of every row, then :func:`decode_attention` over
    the store with it — one kernel, the stores updated in place (aliased in and out). Returns
    ``(out [B, Hq, Dv], k_store, v_store, kv_pos)``.

    ``k_new [B, Hkv, D]``, ``v_new [B, Hkv, Dv]``, ``pos_new [B]``: the step's keys, values
    and positions; ``slot``: an int32 scalar (the step's write slot, the same for every row);
    ``n_live`` counts the entry (slots ``< n_live`` after the write are read)."""
    c = _setup(q, k_store, v_store, kv_pos, q_pos, n_live, pattern, scale, softcap)
    b, hkv = c["b"], c["hkv"]
    if k_new.shape != (b, hkv, k_store.shape[3]) or v_new.shape != (b, hkv, c["dv"]) \
            or pos_new.shape != (b,) or jnp.shape(slot) != ():
        raise InputError(f"pallas decode_attention_write(): want k_new [B,Hkv,D], v_new "
                         f"[B,Hkv,Dv], pos_new [B], slot []; got {k_new.shape}, "
                         f"{v_new.shape}, {pos_new.shape}, {jnp.shape(slot)}")
    entry = lambda n: pl.BlockSpec((None, None, n), lambda i, h: (i, h, 0))
    out, k2, v2, p2 = pl.pallas_call(
        functools.partial(_write_kernel, **c["static"]), grid=(b, hkv),
        interpret=interpret, name="decode_attention", compiler_params=_PARAMS,
        out_shape=(jax.ShapeDtypeStruct((b, hkv, c["group"], c["dv"]), q.dtype),
                   jax.ShapeDtypeStruct(k_store.shape, k_store.dtype),
                   jax.ShapeDtypeStruct(v_store.shape, v_store.dtype),
                   jax.ShapeDtypeStruct(kv_pos.shape, kv_pos.dtype)),
        in_specs=[c["q_spec"], entry(k_new.shape[2]), entry(c["dv"]), c["row_spec"],
                  c["k_spec"], c["v_spec"], c["pos_spec"], c["row_spec"], c["row_spec"],
                  c["row_spec"]],
        out_specs=(c["out_spec"], c["k_spec"], c["v_spec"], c["pos_spec"]),
        input_output_aliases={4: 1, 5: 2, 6: 3},
    )(c["q"], k_new, v_new, pos_new.astype(jnp.int32), k_store, v_store, kv_pos,
      jnp.full((b,), slot, jnp.int32), q_pos, n_live)
    return out.reshape(q.shape[0], q.shape[1], c["dv"]), k2, v2, p2
