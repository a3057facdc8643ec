"""JAX-facing Triton attention ops: what the runtime's backend seam calls.

* :func:`decode_attention` — one query token per row over a slot store (split-K flash-decoding);
  also the ring-buffer window and block stores (masking is by position, slots may be in any order).
* :func:`packed_attention` — packed varlen attention for prefill / scoring / training, forward and
  backward kernels joined by ``jax.custom_vjp``.
* :func:`linear_decode` / :func:`linear_packed` — linear attention (phi = elu + 1), recurrent step
  and chunked packed forward.

All run under ``jax.jit`` (lengths are device arrays: one compile for every length up to the
capacity), on a GPU via jax-triton or on the CPU in Triton's interpreter (:mod:`.launch`), with
:func:`jaxrl_sym.ops.attention.reference_attention`'s semantics (the tests check them against it).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Literal

import jax
import jax.numpy as jnp

from jaxrl_sym.backends import launch as _launch
from jaxrl_sym.backends.operands import check_decode_operands, check_float, check_int32
from jaxrl_sym.errors import InputError, PatternError
from jaxrl_sym.ops.attention import KernelMask, Linear, Pattern
from kernels import LOG2E

_TARGET_PROGRAMS = 512
"""Split-K aims for ~4 programs per SM of an H100 (132 SMs): enough to hide memory latency."""
_MAX_SPLITS = 64


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _block(n: int) -> int:
    """Tile width for a head dim: a power of two >= 16 (tl.dot's minimum), masked in-kernel."""
    return max(16, _pow2(n))


def _kernel_mask(pattern: Pattern, op: str) -> KernelMask:
    """The pattern's mask in the kernels' family (the pattern owns it; the kernels know none)."""
    if isinstance(pattern, Linear):
        raise PatternError(
            f"{op}(): Linear() is not a softmax pattern; use linear_decode / linear_packed"
        )
    mask = pattern.kernel_mask()
    if mask is None:
        raise PatternError(
            f"{op}(): pattern {pattern!r} has no kernel mask (its kernel_mask() returns None: its "
            "mask is not 'k >= q - lookback and k >= q - q mod period'); run it with the xla "
            "backend"
        )
    return mask


def _f32_dot(dtype: Any) -> bool:
    """fp32 (tf32x3) dot operands for fp32 inputs (TF32 would miss 1e-4) and for the interpreter
    (its tl.dot multiplies bf16 bit patterns as integers); bf16 tensor cores otherwise."""
    return jnp.dtype(dtype) == jnp.float32 or _launch.backend_name() == "interpreter"


def _check_size(op: str, *shapes: tuple[int, ...]) -> None:
    for s in shapes:
        if math.prod(s) >= 2**31:  # int32 element offsets
            raise InputError(f"{op}(): an array of shape {s} exceeds the kernels' int32 indexing")


# --------------------------------------------------------------------------- decode attention


_MIN_SPLIT_BLOCKS = 2
"""Blocks per split at least (was 4: at batch 1, GPT-2's 12 kv heads x 4 splits = 48 programs on
132 SMs at 1k slots); 2 doubles the programs while each writes ~1/8 of what it reads."""


def _num_splits(batch: int, kv_heads: int, capacity: int, block_n: int,
                min_blocks: int = _MIN_SPLIT_BLOCKS) -> int:
    """Static number of split-K chunks from the capacity and the grid's other dimensions.

    Enough (row, kv head, split) programs to fill the GPU (~4 per SM), never more splits than
    there are ``min_blocks``-block chunks in the capacity, a power of two (the combine's
    tl.arange).
    """
    want = max(1, -(-_TARGET_PROGRAMS // max(1, batch * kv_heads)))
    cap = max(1, capacity // (min_blocks * block_n))
    n = min(want, cap, _MAX_SPLITS)
    return 1 << (n.bit_length() - 1)


def _live_loads(mask: KernelMask, capacity: int) -> bool:
    """Every live slot of a store this long may be visible (causal; a ring no longer than its
    window or block): K/V loads need not wait for positions, and skip no byte by waiting."""
    reach = [x for x in ((mask.lookback + 1) if mask.lookback is not None else None, mask.period)
             if x is not None]
    return all(capacity <= r for r in reach)


def _check_decode_args(q: jax.Array, k_store: jax.Array, v_store: jax.Array, kv_pos: jax.Array,
                       q_pos: jax.Array, n_live: jax.Array, block_n: int,
                       num_splits: int | None) -> int:
    """:func:`decode_attention`'s operands, refused by name when they cannot be; returns the
    split count (``num_splits``, or the default for these shapes)."""
    op = "decode_attention"
    check_decode_operands(op, q, k_store, v_store, kv_pos, q_pos, n_live)
    b, _, _ = q.shape
    _, hkv, cap, _ = k_store.shape
    if block_n < 16 or block_n & (block_n - 1):
        raise InputError(f"{op}(): block_n must be a power of two >= 16, got {block_n}")
    # Per row: the kernel offsets rows in int64 (b64), so only one row's slots must fit int32.
    _check_size(op, k_store.shape[1:], v_store.shape[1:])
    if num_splits is None:
        num_splits = _num_splits(b, hkv, cap, block_n)
    if num_splits < 1 or num_splits & (num_splits - 1):
        raise InputError(f"{op}(): num_splits must be a power of two >= 1, got {num_splits}")
    return num_splits


def decode_attention(
    q: jax.Array,
    k_store: jax.Array,
    v_store: jax.Array,
    kv_pos: jax.Array,
    q_pos: jax.Array,
    n_live: jax.Array,
    *,
    pattern: Pattern,
    scale: float | None = None,
    softcap: float = 0.0,
    num_splits: int | None = None,
    block_n: int = 64,
    combine: Literal["in_split", "launch"] = "in_split",
    live_loads: bool | None = None,
) -> jax.Array:
    """Attention of one query token per row over a slot store; returns ``[B, Hq, Dv]`` in q.dtype.

    Args:
      q: ``[B, Hq, D]``. k_store / v_store: ``[B, Hkv, C, D]`` / ``[B, Hkv, C, Dv]`` (heads-major).
      kv_pos: ``[B, C]`` int32 positions of the slots (-1 = empty). q_pos: ``[B]`` int32.
      n_live: ``[B]`` int32, slots ``>= n_live`` are never read (a device array: one compile for
        every length up to C).
      pattern: Causal(), Window(w) or Block(b); masking by position, so ring-buffer slots may be in
        any order and a window may exceed the live length.
      scale: softmax scale, default 1/sqrt(D).
      softcap: attention-logit soft-capping ``c * tanh(s / c)`` (0 = none), as ``attend``.
      num_splits: split-K chunks (a power of two); default from the capacity and B * Hkv.
      block_n: slots per inner step (power of two >= 16).
      combine: ``"in_split"``: the last split program of each row and kv head combines (one
        launch); ``"launch"``: a second kernel does (the old layout, kept for GPU A/B runs).
      live_loads: K/V loads of every live slot not waiting for positions (True), or of visible
        slots only (False); default :func:`_live_loads`. Same results; bytes and latency differ.

    Semantics: ``reference_attention`` with Tq = 1 and one segment over slots ``[0, n_live)``; a
    query with position < 0 or without any visible key gets 0.
    """
    op = "decode_attention"
    mask = _kernel_mask(pattern, op)
    _, hq, d = q.shape
    _, hkv, cap, _ = k_store.shape
    dv = v_store.shape[-1]
    num_splits = _check_decode_args(q, k_store, v_store, kv_pos, q_pos, n_live, block_n,
                                    num_splits)
    if combine not in ("in_split", "launch"):
        raise InputError(f"{op}(): combine must be 'in_split' or 'launch', got {combine!r}")
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    consts = dict(
        CAP=cap, HQ=hq, HKV=hkv, D=d, DV=dv, NUM_SPLITS=num_splits, **mask.constexprs(),
        QK_SCALE=scale * LOG2E, SCALE=scale, SOFTCAP=float(softcap),
        BLOCK_H=max(16, _pow2(hq // hkv)), BLOCK_N=block_n, BLOCK_D=_block(d),
        BLOCK_DV=_block(dv), F32_DOT=_f32_dot(q.dtype),
        LIVE_LOADS=_live_loads(mask, cap) if live_loads is None else bool(live_loads),
    )
    return _launch_decode((q, k_store, v_store, kv_pos, q_pos, n_live), consts, combine)


def _launch_decode(inputs: tuple[jax.Array, ...], consts: dict[str, Any], combine: str
                   ) -> jax.Array:
    """One launch (one split, or the combine in the split launch) or two (split, then combine)."""
    kmod = _launch.import_kernels("decode_attention")
    q = inputs[0]
    b, hq, hkv, dv, num_splits = (q.shape[0], consts["HQ"], consts["HKV"], consts["DV"],
                                  consts["NUM_SPLITS"])
    fused = num_splits > 1 and combine == "in_split"
    combined = ((b, hq, dv), q.dtype) if fused else ((1,), q.dtype)  # else a placeholder
    m_part, l_part, acc, out, _tickets = _launch.launch(
        kmod.decode_split_kernel, grid=(b, hkv, num_splits), inputs=inputs,
        out_shapes=[*_split_outputs(b, hq, dv, num_splits, q.dtype),
                    jax.ShapeDtypeStruct(*combined),
                    jax.ShapeDtypeStruct((b * hkv,) if fused else (1,), jnp.int32)],
        constexprs={**consts, "COMBINE": fused}, num_warps=4, num_stages=2,
        zeroed_outputs=(4,) if fused else ())
    if fused:
        return out
    if num_splits == 1:
        return acc.reshape(b, hq, dv)
    (out,) = _launch.launch(
        kmod.decode_reduce_kernel, grid=(b, hq), inputs=(m_part, l_part, acc),
        out_shapes=[jax.ShapeDtypeStruct((b, hq, dv), q.dtype)],
        constexprs=dict(HQ=hq, DV=dv, NUM_SPLITS=num_splits, BLOCK_DV=consts["BLOCK_DV"]),
        num_warps=4, num_stages=1)
    return out


def _split_outputs(b: int, hq: int, dv: int, num_splits: int, dtype: Any
                   ) -> list[jax.ShapeDtypeStruct]:
    """The split kernel's outputs: per split the running max, sum and partial output (fp32),
    or with one split placeholders and the output itself (in q's dtype)."""
    f32 = jnp.float32
    if num_splits == 1:
        return [jax.ShapeDtypeStruct((1,), f32), jax.ShapeDtypeStruct((1,), f32),
                jax.ShapeDtypeStruct((b, hq, 1, dv), dtype)]
    return [jax.ShapeDtypeStruct((b, hq, num_splits), f32),
            jax.ShapeDtypeStruct((b, hq, num_splits), f32),
            jax.ShapeDtypeStruct((b, hq, num_splits, dv), f32)]


def linear_decode(
    q: jax.Array, k: jax.Array, v: jax.Array, S: jax.Array, z: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One recurrent linear-attention step; returns ``(out [B,Hq,Dv], S_new, z_new)``.

    ``S_new = S + phi(k) v^T``, ``z_new = z + phi(k)``, ``out = phi(q)·S_new / phi(q)·z_new``
    (0 where the normaliser is 0). Shapes: q ``[B,Hq,D]``, k ``[B,Hkv,D]``, v ``[B,Hkv,Dv]``,
    S ``[B,Hkv,D,Dv]``, z ``[B,Hkv,D]``; S and z keep their dtype (keep them fp32: they are long
    sums). S is updated in place by the kernel (input/output alias): donate it under ``jax.jit``
    and the step does not copy the state.
    """
    op = "linear_decode"
    check_float(op, q=q, k=k, v=v)
    check_float(op, S=S, z=z)
    b, hq, d = q.shape
    _, hkv, dv = v.shape
    if k.shape != (b, hkv, d) or S.shape != (b, hkv, d, dv) or z.shape != (b, hkv, d):
        raise InputError(f"{op}(): shapes q{q.shape} k{k.shape} v{v.shape} S{S.shape} z{z.shape} "
                         "disagree")
    if hq % hkv:
        raise InputError(f"{op}(): {hq} query heads is not a multiple of {hkv} kv heads")
    kmod = _launch.import_kernels("linear_attention")
    block_dv = min(_block(dv), 64)
    out, s_new, z_new = _launch.launch(
        kmod.linear_decode_kernel,
        grid=(b, hkv, -(-dv // block_dv)),
        inputs=(q, k, v, S, z),
        out_shapes=[
            jax.ShapeDtypeStruct((b, hq, dv), q.dtype),
            jax.ShapeDtypeStruct(S.shape, S.dtype),
            jax.ShapeDtypeStruct(z.shape, z.dtype),
        ],
        constexprs=dict(HQ=hq, HKV=hkv, D=d, DV=dv, BLOCK_D=_block(d), BLOCK_DV=block_dv),
        num_warps=4,
        num_stages=1,
        input_output_aliases={3: 1},
    )
    return out, s_new, z_new


def linear_packed(
    q: jax.Array, k: jax.Array, v: jax.Array, cu_seqlens: jax.Array, *, block_t: int = 32
) -> jax.Array:
    """Chunked causal linear attention over packed sequences (forward only).

    q ``[N,Hq,D]``, k ``[N,Hkv,D]``, v ``[N,Hkv,Dv]``, ``cu_seqlens [S+1]`` int32 (a device array;
    ``cu_seqlens[0] == 0``, non-decreasing). Each sequence starts from an empty state; tokens past
    ``cu_seqlens[S]`` get 0. Returns ``[N, Hq, Dv]`` in q.dtype.
    """
    op = "linear_packed"
    check_float(op, q=q, k=k, v=v)
    check_int32(op, cu_seqlens=cu_seqlens)
    n, hq, d = q.shape
    hkv, dv = v.shape[1], v.shape[2]
    if k.shape != (n, hkv, d) or v.shape[0] != n or cu_seqlens.ndim != 1:
        raise InputError(f"{op}(): shapes q{q.shape} k{k.shape} v{v.shape} "
                         f"cu_seqlens{cu_seqlens.shape} disagree")
    if hq % hkv:
        raise InputError(f"{op}(): {hq} query heads is not a multiple of {hkv} kv heads")
    if block_t < 16 or block_t & (block_t - 1):
        raise InputError(f"{op}(): block_t must be a power of two >= 16, got {block_t}")
    _check_size(op, q.shape, k.shape, v.shape, (n, hq, dv))
    kmod = _launch.import_kernels("linear_attention")
    block_dv = min(_block(dv), 64)
    (out,) = _launch.launch(
        kmod.linear_packed_kernel,
        grid=(cu_seqlens.shape[0] - 1, hq, -(-dv // block_dv)),
        inputs=(q, k, v, cu_seqlens),
        out_shapes=[jax.ShapeDtypeStruct((n, hq, dv), q.dtype)],
        constexprs=dict(HQ=hq, HKV=hkv, D=d, DV=dv, BLOCK_T=block_t, BLOCK_D=_block(d),
                        BLOCK_DV=block_dv),
        num_warps=4,
        num_stages=1,
        zeroed_outputs=(0,),
    )
    return out


# --------------------------------------------------------------------------- packed attention


def packed_segments(cu_seqlens: jax.Array, n: int) -> tuple[jax.Array, jax.Array]:
    """Per-token ``(segment id, position)`` of a packed buffer of ``n`` tokens, int32 ``[n]`` each.

    Token t belongs to sequence s when ``cu_seqlens[s] <= t < cu_seqlens[s+1]`` and sits at
    position ``t - cu_seqlens[s]``; tokens outside every sequence get segment S and position -1
    (masked). One O(n log S) XLA op, so the kernels just load two ints per token.
    """
    idx = jnp.arange(n, dtype=jnp.int32)
    s = cu_seqlens.shape[0] - 1
    seg = jnp.searchsorted(cu_seqlens[1:], idx, side="right").astype(jnp.int32)
    start = cu_seqlens[jnp.minimum(seg, s)]
    pos = jnp.where((seg < s) & (idx >= start), idx - start, -1).astype(jnp.int32)
    return seg, pos


@dataclass(frozen=True)
class _PackedConfig:
    mask: KernelMask
    scale: float
    block_m: int
    block_n: int
    softcap: float = 0.0


def _packed_consts(cfg: _PackedConfig, q: jax.Array, v: jax.Array, hkv: int) -> dict[str, Any]:
    n, hq, d = q.shape
    dv = v.shape[-1]
    return dict(
        N=n, HQ=hq, HKV=hkv, D=d, DV=dv, **cfg.mask.constexprs(),
        QK_SCALE=cfg.scale * LOG2E, SCALE=cfg.scale, SOFTCAP=cfg.softcap, BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, BLOCK_D=_block(d),
        BLOCK_DV=_block(dv), F32_DOT=_f32_dot(q.dtype),
    )


def _packed_fwd_impl(
    q: jax.Array, k: jax.Array, v: jax.Array, cu: jax.Array, cfg: _PackedConfig
) -> tuple[jax.Array, jax.Array]:
    n, hq, _ = q.shape
    hkv, dv = v.shape[1], v.shape[2]
    seg, pos = packed_segments(cu, n)
    kmod = _launch.import_kernels("packed_attention")
    out, lse = _launch.launch(
        kmod.packed_fwd_kernel,
        grid=(-(-n // cfg.block_m), hq),
        inputs=(q, k, v, seg, pos),
        out_shapes=[
            jax.ShapeDtypeStruct((n, hq, dv), q.dtype),
            jax.ShapeDtypeStruct((hq, n), jnp.float32),
        ],
        constexprs=_packed_consts(cfg, q, v, hkv),
        num_warps=4,
        num_stages=2,
    )
    return out, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _packed(
    q: jax.Array, k: jax.Array, v: jax.Array, cu: jax.Array, cfg: _PackedConfig
) -> tuple[jax.Array, jax.Array]:
    return _packed_fwd_impl(q, k, v, cu, cfg)


def _packed_fwd(
    q: jax.Array, k: jax.Array, v: jax.Array, cu: jax.Array, cfg: _PackedConfig
) -> tuple[tuple[jax.Array, jax.Array], tuple[jax.Array, ...]]:
    out, lse = _packed_fwd_impl(q, k, v, cu, cfg)
    return (out, lse), (q, k, v, cu, out, lse)


def _packed_bwd(
    cfg: _PackedConfig, res: tuple[jax.Array, ...], cts: tuple[jax.Array, jax.Array]
) -> tuple[jax.Array, jax.Array, jax.Array, None]:
    """FlashAttention-2 backward: delta on the host side of XLA, then the dq and dk/dv kernels."""
    q, k, v, cu, out, lse = res
    d_out, d_lse = cts
    n, hq, _ = q.shape
    hkv = v.shape[1]
    seg, pos = packed_segments(cu, n)
    # delta_i = rowsum(o_i * do_i) - dlse_i: d lse_i / d s_ij = p_ij, so the lse cotangent is a
    # shift of delta (and zero when only the output is used).
    delta = jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32), axis=-1).T
    delta = delta - d_lse.astype(jnp.float32)
    d_out = d_out.astype(q.dtype)
    kmod = _launch.import_kernels("packed_attention")
    consts = _packed_consts(cfg, q, v, hkv)
    (dq,) = _launch.launch(
        kmod.packed_bwd_dq_kernel,
        grid=(-(-n // cfg.block_m), hq),
        inputs=(q, k, v, d_out, lse, delta, seg, pos),
        out_shapes=[jax.ShapeDtypeStruct(q.shape, q.dtype)],
        constexprs=consts,
        num_warps=4,
        num_stages=2,
    )
    dk, dv_ = _launch.launch(
        kmod.packed_bwd_dkdv_kernel,
        grid=(-(-n // cfg.block_n), hkv),
        inputs=(q, k, v, d_out, lse, delta, seg, pos, cu),
        out_shapes=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        constexprs=consts,
        num_warps=4,
        num_stages=2,
    )
    return dq, dk, dv_, None


_packed.defvjp(_packed_fwd, _packed_bwd)


def packed_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cu_seqlens: jax.Array,
    *,
    pattern: Pattern,
    scale: float | None = None,
    softcap: float = 0.0,
    return_lse: bool = False,
    block_m: int | None = None,
    block_n: int | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Attention over packed variable-length sequences, differentiable in q, k, v.

    Args:
      q: ``[N, Hq, D]``; k: ``[N, Hkv, D]``; v: ``[N, Hkv, Dv]``: sequences end to end.
      cu_seqlens: ``[S+1]`` int32 device array of boundaries (``cu_seqlens[0] == 0``,
        non-decreasing; tokens past ``cu_seqlens[S]`` are padding and get 0).
      pattern: Causal(), Window(w) or Block(b) on positions within each sequence.
      scale: softmax scale, default 1/sqrt(D).
      softcap: attention-logit soft-capping ``c * tanh(s / c)`` (0 = none), as ``attend``;
        the backward kernels multiply dS by its slope ``1 - tanh²``.
      return_lse: also return the natural-log logsumexp ``[N, Hq]`` fp32 (-inf for rows without
        keys); it is differentiable too.
      block_m / block_n: query / key tile sizes (powers of two >= 16). Default 64, or 32 for fp32
        with D > 64: fp32 operands (tf32x3) of 64-wide tiles need more than the H100's 227 KiB
        of shared memory in the backward kernels.

    Semantics: ``reference_attention`` with B = 1, positions = index within each sequence,
    segment ids = sequence index. Gradients come from the backward kernels (``jax.custom_vjp``):
    jax-triton has no autodiff of its own.
    """
    op = "packed_attention"
    mask = _kernel_mask(pattern, op)
    check_float(op, q=q, k=k, v=v)
    check_int32(op, cu_seqlens=cu_seqlens)
    if q.ndim != 3 or k.ndim != 3 or v.ndim != 3 or cu_seqlens.ndim != 1:
        raise InputError(f"{op}(): want q [N,Hq,D], k/v [N,Hkv,D], cu_seqlens [S+1]; got "
                         f"{q.shape}, {k.shape}, {v.shape}, {cu_seqlens.shape}")
    n, hq, d = q.shape
    hkv = k.shape[1]
    if k.shape != (n, hkv, d) or v.shape[:2] != (n, hkv):
        raise InputError(f"{op}(): shapes q{q.shape} k{k.shape} v{v.shape} disagree")
    if hq % hkv:
        raise InputError(f"{op}(): {hq} query heads is not a multiple of {hkv} kv heads")
    default_block = 32 if jnp.dtype(q.dtype) == jnp.float32 and max(d, v.shape[-1]) > 64 else 64
    block_m = default_block if block_m is None else block_m
    block_n = default_block if block_n is None else block_n
    for name, bs in (("block_m", block_m), ("block_n", block_n)):
        if bs < 16 or bs & (bs - 1):
            raise InputError(f"{op}(): {name} must be a power of two >= 16, got {bs}")
    _check_size(op, q.shape, k.shape, v.shape, (n, hq, v.shape[-1]))
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    cfg = _PackedConfig(mask, scale, block_m, block_n, float(softcap))
    out, lse = _packed(q, k, v, cu_seqlens, cfg)
    return (out, lse.T) if return_lse else out
