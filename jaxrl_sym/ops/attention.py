"""The library's attention op: one JAX primitive, one masked reference, open-ended patterns.

Users call :func:`attend` inside their Flax model. Under plain JAX (jit, grad, vmap) the
primitive lowers to :func:`reference_attention`, a masked computation over every key it is given:
that *is* the padded baseline. The tracer recognises the primitive in a jaxpr (it is the one op
allowed to mix sequence positions) and turns it into a PDG edge whose index expression is the
pattern's S(t); the runtime then reads keys from a store sized by that expression.

Masking is by *positions* and *segment ids*, never by array index, so the same reference serves a
full padded sequence, a packed batch of sequences, a ring buffer whose slots are out of order and a
right-aligned microbatch whose rows start at different slots. A key/query whose position is < 0 is
empty (padding or an unfilled slot); an empty query's output is 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import jax
import jax.numpy as jnp
import sympy
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from jaxrl_sym.errors import InputError, PatternError

# --------------------------------------------------------------------------- patterns


@dataclass(frozen=True)
class KernelMask:
    """A softmax pattern's mask in the Triton kernels' one family (``kernels/common.py``).

    A key at position k is visible from a query at position q iff ``0 <= k <= q`` and
    ``k >= q - lookback`` (when ``lookback`` is set) and ``k >= q - q mod period`` (when
    ``period`` is set). Causal is neither, a window of w keys is ``lookback=w-1``, aligned blocks
    of b are ``period=b``; both together intersect. The kernels evaluate this form for any
    values — they know no pattern — so a new pattern that can state its mask this way needs no
    kernel change. A pattern outside the family returns ``None`` from :meth:`Pattern.kernel_mask`
    and the Triton backend refuses it by name (the XLA backends still run it).
    """

    lookback: int | None = None
    period: int | None = None

    def __post_init__(self) -> None:
        for name in ("lookback", "period"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0
                                  or (name == "period" and v == 0)):
                raise PatternError(f"KernelMask({name}={v!r}): must be None or an int "
                                   f"{'>= 1' if name == 'period' else '>= 0'}")

    def constexprs(self) -> dict[str, int]:
        """The kernels' ``LOOKBACK`` (-1: unbounded) and ``PERIOD`` (0: none) constants."""
        return {"LOOKBACK": -1 if self.lookback is None else self.lookback,
                "PERIOD": self.period or 0}


class Pattern:
    """Base class of attention patterns: everything pattern-specific lives on the subclass.

    A subclass is a frozen dataclass (hashable: it is a primitive parameter and a compile-cache
    key) and defines:

    - ``allows(q_pos, k_pos)``: the mask, by positions — every masked path (reference, padded
      baseline, stores) uses it;
    - ``key_range(t, size)``: S(t), the keys query t reads, as sympy ``[start, stop)``; the tracer
      puts it on the PDG edge and the storage planner derives the store from it (``0:t+1``
      grows, a start bounded behind t is a ring, one that resets is a block buffer);
    - ``symbol``: its size symbol (``w``, ``b``, …; numbered per distinct size), with the value
      in a ``size`` field, or ``None`` (no field) for an unsized pattern;
    - ``kernel_mask()``: its mask in the Triton kernels' family (:class:`KernelMask`), or
      ``None`` if the kernels cannot run it.

    That is the whole change for a new pattern: the tracer, planner, stores, padded baseline and
    Triton kernels read these, never the pattern's name or class.
    """

    name: ClassVar[str]
    symbol: ClassVar[str | None] = None
    softmax: ClassVar[bool] = True  # False: not a softmax over logits (Linear)

    def allows(self, q_pos: jax.Array, k_pos: jax.Array) -> jax.Array:
        raise NotImplementedError

    def key_range(self, t: sympy.Expr, size: sympy.Expr | None) -> tuple[sympy.Expr, sympy.Expr]:
        raise NotImplementedError

    def kernel_mask(self) -> KernelMask | None:
        return None


def _check_size(pattern: str, size: object, what: str, hint: str = "") -> None:
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise PatternError(f"{pattern}(size={size!r}): {what} must be an int >= 1{hint}.")


@dataclass(frozen=True)
class Causal(Pattern):
    """Full causal attention, S(t) = 0:t+1."""

    name = "causal"

    def allows(self, q_pos: jax.Array, k_pos: jax.Array) -> jax.Array:
        return k_pos <= q_pos

    def key_range(self, t: sympy.Expr, size: sympy.Expr | None) -> tuple[sympy.Expr, sympy.Expr]:
        """S(t), the keys query t reads, as [start, stop) in the size symbol."""
        return sympy.Integer(0), t + 1

    def kernel_mask(self) -> KernelMask:
        return KernelMask()


@dataclass(frozen=True)
class Window(Pattern):
    """Sliding window of ``size`` keys ending at the query, S(t) = max(0, t-w+1):t+1."""

    size: int
    name = "window"
    symbol: ClassVar[str | None] = "w"

    def __post_init__(self) -> None:
        _check_size("Window", self.size, "the window",
                    " (it is the number of keys a query sees, itself included); use Causal() "
                    "for unbounded attention")

    def allows(self, q_pos: jax.Array, k_pos: jax.Array) -> jax.Array:
        return (k_pos <= q_pos) & (k_pos > q_pos - self.size)

    def key_range(self, t: sympy.Expr, size: sympy.Expr | None) -> tuple[sympy.Expr, sympy.Expr]:
        return sympy.Max(0, t - size + 1), t + 1

    def kernel_mask(self) -> KernelMask:
        return KernelMask(lookback=self.size - 1)


@dataclass(frozen=True)
class Block(Pattern):
    """Causal attention within aligned blocks of ``size``, S(t) = t-(t mod b):t+1."""

    size: int
    name = "block"
    symbol: ClassVar[str | None] = "b"

    def __post_init__(self) -> None:
        _check_size("Block", self.size, "the block size")

    def allows(self, q_pos: jax.Array, k_pos: jax.Array) -> jax.Array:
        return (k_pos <= q_pos) & (k_pos >= q_pos - q_pos % self.size)

    def key_range(self, t: sympy.Expr, size: sympy.Expr | None) -> tuple[sympy.Expr, sympy.Expr]:
        return t - sympy.Mod(t, size), t + 1

    def kernel_mask(self) -> KernelMask:
        return KernelMask(period=self.size)


@dataclass(frozen=True)
class Linear(Pattern):
    """Kernelised causal linear attention (paper Eq. 2) with feature map phi(x) = elu(x) + 1.

    A[t] = phi(q_t)^T S_t / phi(q_t)^T z_t with S_t = sum_{s<=t} phi(k_s) v_s^T and
    z_t = sum_{s<=t} phi(k_s): S(t) = 0:t+1, but the consumer is a sum, so the planner keeps a
    recurrent state (S, z) instead of the keys. Not a softmax: its own kernels
    (``kernels/linear_attention.py``), so no :class:`KernelMask`.
    """

    name = "linear"
    softmax: ClassVar[bool] = False

    def allows(self, q_pos: jax.Array, k_pos: jax.Array) -> jax.Array:
        return k_pos <= q_pos

    def key_range(self, t: sympy.Expr, size: sympy.Expr | None) -> tuple[sympy.Expr, sympy.Expr]:
        return sympy.Integer(0), t + 1


def parse_pattern(spec: str) -> Pattern:
    """Parse ``full|causal``, ``window:W``, ``block:B`` or ``linear`` (the CLI's syntax)."""
    kind, _, arg = spec.partition(":")
    kind = kind.strip().lower()
    if kind in ("full", "causal"):
        return Causal()
    if kind == "linear":
        return Linear()
    if kind in ("window", "block"):
        try:
            size = int(arg)
        except ValueError:
            raise PatternError(
                f"attention pattern {spec!r}: expected '{kind}:<int>', e.g. '{kind}:128'"
            ) from None
        return Window(size) if kind == "window" else Block(size)
    raise PatternError(
        f"unknown attention pattern {spec!r}: use full, window:W, block:B or linear"
    )


def phi(x: jax.Array) -> jax.Array:
    """Linear-attention feature map elu(x)+1 (positive, so the normaliser never vanishes)."""
    return jax.nn.elu(x) + 1.0


# --------------------------------------------------------------------------- segments

SHARED_SEGMENT = 1 << 16
"""Segment ids at or above this are *child* segments of a shared prefix (see
:func:`child_segment`); below it a segment sees only itself."""


def child_segment(parent: int, own: int) -> int:
    """The segment id of a sequence that continues segment ``parent``: its queries see keys of
    its own segment and of ``parent`` (masked by positions as always), so G responses packed
    behind one copy of their prompt attend exactly as G separate prompt+response sequences.

    Encoded in the one int32 segment id the model contract passes through to :func:`attend`
    (``(parent + 1) * 2**16 + own``), so any contract model runs shared-prefix rows unmodified.
    ``own`` < 2**16 and ``parent`` < 2**15 - 1 (int32).
    """
    if not 0 <= own < SHARED_SEGMENT or not 0 <= parent < (1 << 15) - 1:
        raise InputError(f"child_segment(parent={parent}, own={own}): own must be in "
                         f"[0, {SHARED_SEGMENT}) and parent in [0, {(1 << 15) - 1})")
    return (parent + 1) * SHARED_SEGMENT + own


def segments_visible(q_seg: jax.Array, k_seg: jax.Array) -> jax.Array:
    """Whether a key's segment is visible from a query's (broadcasting): the same segment, or
    the query's parent when the query's segment is a :func:`child_segment`."""
    parent = jnp.right_shift(q_seg, 16) - 1
    return (q_seg == k_seg) | ((q_seg >= SHARED_SEGMENT) & (k_seg == parent))


# --------------------------------------------------------------------------- reference


def attention_mask(
    pattern: Pattern,
    q_pos: jax.Array,
    k_pos: jax.Array,
    q_seg: jax.Array,
    k_seg: jax.Array,
) -> jax.Array:
    """[B, Tq, Tk] boolean: which key each query may read."""
    qp = q_pos[:, :, None]
    kp = k_pos[:, None, :]
    same = segments_visible(q_seg[:, :, None], k_seg[:, None, :])
    valid = (qp >= 0) & (kp >= 0)
    return valid & same & pattern.allows(qp, kp)


def reference_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_pos: jax.Array,
    k_pos: jax.Array,
    q_seg: jax.Array,
    k_seg: jax.Array,
    *,
    pattern: Pattern,
    scale: float,
    softcap: float = 0.0,
) -> jax.Array:
    """Masked attention over every key given; fp32 accumulation; returns q.dtype.

    ``softcap`` > 0 squashes the scaled logits to ``softcap * tanh(s / softcap)`` before the
    softmax (Gemma 2's attention-logit soft-capping); 0 leaves them unchanged.

    Shapes: q [B,Tq,Hq,D], k [B,Tk,Hkv,D], v [B,Tk,Hkv,Dv], positions/segments [B,T*] int32.
    Grouped-query attention: query head h reads kv head h // (Hq // Hkv).
    """
    b, tq, hq, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    mask = attention_mask(pattern, q_pos, k_pos, q_seg, k_seg)[:, None, None]  # B,1,1,Tq,Tk
    qg = q.reshape(b, tq, hkv, g, d).astype(jnp.float32)
    kf = k.astype(jnp.float32)
    vf = v.astype(jnp.float32)
    if isinstance(pattern, Linear):
        w = jnp.einsum("bqhgd,bkhd->bhgqk", phi(qg), phi(kf))
        w = jnp.where(mask, w, 0.0)
        num = jnp.einsum("bhgqk,bkhd->bqhgd", w, vf)
        den = jnp.sum(w, axis=-1)  # b h g q
        den = jnp.moveaxis(den, 3, 1)[..., None]  # b q h g 1
        out = jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), 0.0)
    else:
        s = jnp.einsum("bqhgd,bkhd->bhgqk", qg, kf) * scale
        if softcap:
            s = softcap * jnp.tanh(s / softcap)
        s = jnp.where(mask, s, -jnp.inf)
        m = jnp.max(s, axis=-1, keepdims=True)
        m = jnp.where(jnp.isfinite(m), m, 0.0)
        p = jnp.exp(s - m)
        den = jnp.sum(p, axis=-1, keepdims=True)
        p = p / jnp.where(den > 0, den, 1.0)
        out = jnp.einsum("bhgqk,bkhd->bqhgd", p, vf)
    return out.reshape(b, tq, hq, v.shape[-1]).astype(q.dtype)


QUERY_BLOCK_MIN = 16  # fewest queries a block holds (past it a block's scores pass the budget)
SCORES_BYTES_PER_CALL = 512 << 20
"""fp32 scores ``[rows, heads, Tq, Tk]`` one lowered call may hold before it runs in blocks of
queries (:func:`bounded_reference`): every committed 1k-token workload stays one call (the GPU
preset's 1,280-slot update row: 275 MB); a 16k-token row held tens of GB a layer (issue 47;
the numbers: ``bench/results/cpu/design_notes.md``)."""


def query_block(rows: int, heads: int, tq: int, tk: int, budget: int) -> int:
    """Queries per block such that one block's fp32 scores ``[rows, heads, block, tk]`` fit
    ``budget`` (at least :data:`QUERY_BLOCK_MIN`; ``tq`` when all fit), as even as the block
    count allows, on a multiple of 8 (under 8 queries of padding per block)."""
    per_query = 4 * rows * heads * tk
    if tq * per_query <= budget:
        return tq
    even = -(-tq // -(-tq // max(QUERY_BLOCK_MIN, budget // per_query)))  # tq / blocks, up
    return min(tq, -(-even // 8) * 8)


def in_query_blocks(one, q: jax.Array, q_pos: jax.Array, q_seg: jax.Array, block: int
                    ) -> jax.Array:
    """``one(q, q_pos, q_seg)`` over ``block`` queries at a time (``lax.map``); padding queries
    sit at position -1 (empty: output 0) and are cut off."""
    b, tq = q.shape[:2]
    n = -(-tq // block)

    def blocks(x: jax.Array, fill: int | float) -> jax.Array:
        x = jnp.pad(x, [(0, 0), (0, n * block - tq)] + [(0, 0)] * (x.ndim - 2),
                    constant_values=fill)
        return jnp.moveaxis(x.reshape(b, n, block, *x.shape[2:]), 1, 0)

    out = jax.lax.map(lambda x: one(*x), (blocks(q, 0), blocks(q_pos, -1), blocks(q_seg, 0)))
    return jnp.moveaxis(out, 0, 1).reshape(b, n * block, *out.shape[3:])[:, :tq]


def bounded_reference(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array,
                      k_pos: jax.Array, q_seg: jax.Array, k_seg: jax.Array, *, pattern: Pattern,
                      scale: float, softcap: float, budget: int = SCORES_BYTES_PER_CALL
                      ) -> jax.Array:
    """:func:`reference_attention` in checkpointed blocks of queries past ``budget``: a gradient
    recomputes one block's scores at a time (``block x Tk``); equal up to rounding."""
    ref = lambda qb, pb, sb: reference_attention(qb, k, v, pb, k_pos, sb, k_seg,
                                                 pattern=pattern, scale=scale, softcap=softcap)
    block = query_block(q.shape[0], q.shape[2], q.shape[1], k.shape[1], budget)
    if block >= q.shape[1]:
        return ref(q, q_pos, q_seg)
    return in_query_blocks(jax.checkpoint(ref), q, q_pos, q_seg, block)


# --------------------------------------------------------------------------- primitive

attention_p = Primitive("sym_attention")
"""The primitive the tracer looks for. Params: ``pattern`` (a Pattern), ``scale`` (float),
``softcap`` (float, 0 = none)."""


def _impl(*args: jax.Array, pattern: Pattern, scale: float, softcap: float) -> jax.Array:
    return jax.jit(bounded_reference, static_argnames=("pattern", "scale", "softcap"))(
        *args, pattern=pattern, scale=scale, softcap=softcap
    )


def _abstract(q, k, v, q_pos, k_pos, q_seg, k_seg, *, pattern: Pattern, scale: float,
              softcap: float):
    return jax.core.ShapedArray((*q.shape[:3], v.shape[-1]), q.dtype)


def _jvp(primals, tangents, *, pattern: Pattern, scale: float, softcap: float):
    # Differentiate the masked reference itself: positions/segments are integer, so their
    # tangents are float0 and the reference treats them as constants.
    #
    # Under jax.checkpoint: a gradient keeps only q/k/v (and the integer positions) of each
    # attention call and recomputes its scores in the backward pass, as every flash-attention
    # backward does. Without it XLA saved about four fp32 [rows, heads, T, T] buffers per call
    # (scores, mask, exponentials, probabilities): at the Qwen2.5-0.5B RL-step shape that was
    # most of the update's per-layer memory, and checkpointing cut the gradient program's XLA
    # temporaries to about a third for both systems (bench/results/projection.md); the price is
    # one more attention forward per backward.
    q, k, v, *rest = primals
    tq, tk, tv, *_ = tangents
    f = jax.checkpoint(lambda q_, k_, v_: bounded_reference(
        q_, k_, v_, *rest, pattern=pattern, scale=scale, softcap=softcap))
    tq, tk, tv = (ad.instantiate_zeros(t) for t in (tq, tk, tv))
    return jax.jvp(f, (q, k, v), (tq, tk, tv))


def _batch(args, dims, *, pattern: Pattern, scale: float, softcap: float):
    # vmap keeps the primitive: the mapped axis is folded into the rows (rows are independent),
    # so a model that vmaps attend over rows still traces to one attend over [B, T, ...] and the
    # runtime can give it a store. Unmapped operands are broadcast along the mapped axis.
    n = next(a.shape[d] for a, d in zip(args, dims, strict=True) if isinstance(d, int))
    moved = [jnp.moveaxis(a, d, 0) if isinstance(d, int) else jnp.broadcast_to(a, (n, *a.shape))
             for a, d in zip(args, dims, strict=True)]
    rows = moved[0].shape[1]
    flat = [m.reshape(n * rows, *m.shape[2:]) for m in moved]
    out = attention_p.bind(*flat, pattern=pattern, scale=scale, softcap=softcap)
    return out.reshape(n, rows, *out.shape[1:]), 0


attention_p.def_impl(_impl)
attention_p.def_abstract_eval(_abstract)
ad.primitive_jvps[attention_p] = _jvp
batching.primitive_batchers[attention_p] = _batch
mlir.register_lowering(
    attention_p,
    mlir.lower_fun(
        lambda *a, pattern, scale, softcap: bounded_reference(
            *a, pattern=pattern, scale=scale, softcap=softcap),
        multiple_results=False,
    ),
)


# --------------------------------------------------------------------------- user API


def _check(name: str, x: jax.Array, rank: int, *, floating: bool) -> None:
    if x.ndim != rank:
        raise InputError(f"attend(): argument {name!r} must have rank {rank}, got shape {x.shape}")
    if floating and not jnp.issubdtype(x.dtype, jnp.floating):
        raise InputError(
            f"attend(): argument {name!r} must be a floating dtype, got {x.dtype}; "
            "cast it with .astype(jnp.float32) or bfloat16"
        )
    if not floating and x.dtype != jnp.int32:
        raise InputError(
            f"attend(): argument {name!r} must be int32 positions/segment ids, got {x.dtype}"
        )


def attend(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    pattern: Pattern,
    *,
    q_positions: jax.Array,
    kv_positions: jax.Array,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    scale: float | None = None,
    logit_softcap: float | None = None,
) -> jax.Array:
    """Attention with a symbolic access pattern.

    Args:
      q: [B, Tq, Hq, D] queries. k: [B, Tk, Hkv, D] keys. v: [B, Tk, Hkv, Dv] values.
        Hq must be a multiple of Hkv (grouped-query attention).
      pattern: Causal(), Window(w), Block(b) or Linear().
      q_positions / kv_positions: [B, T*] int32 token positions; < 0 marks an empty slot.
      q_segment_ids / kv_segment_ids: [B, T*] int32; queries only see keys of their segment
        (packed sequences), and a child segment (id >= 2**16, :func:`child_segment`) also its
        parent's (a shared prompt). Default: one segment.
      scale: softmax scale, default 1/sqrt(D).
      logit_softcap: if given (> 0), scaled logits become ``c * tanh(s / c)`` before the
        softmax (Gemma 2); not defined for Linear().
    """
    if not isinstance(pattern, Pattern):
        raise PatternError(
            f"attend(): pattern must be a Pattern — Causal(), Window(w), Block(b), Linear() or "
            f"your own subclass of jaxrl_sym.ops.attention.Pattern — got {pattern!r}"
        )
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check(name, x, 4, floating=True)
    for name, x in (("q_positions", q_positions), ("kv_positions", kv_positions)):
        _check(name, x, 2, floating=False)
    if q.shape[2] % k.shape[2] != 0:
        raise InputError(
            f"attend(): {q.shape[2]} query heads is not a multiple of {k.shape[2]} kv heads"
        )
    if k.shape[:3] != v.shape[:3] or q.shape[-1] != k.shape[-1]:
        raise InputError(f"attend(): shapes q{q.shape} k{k.shape} v{v.shape} do not agree")
    if q_segment_ids is None:
        q_segment_ids = jnp.zeros_like(q_positions)
    if kv_segment_ids is None:
        kv_segment_ids = jnp.zeros_like(kv_positions)
    for name, x in (("q_segment_ids", q_segment_ids), ("kv_segment_ids", kv_segment_ids)):
        _check(name, x, 2, floating=False)
    if scale is None:
        scale = 1.0 / float(q.shape[-1]) ** 0.5
    softcap = _softcap(logit_softcap, pattern)
    return attention_p.bind(
        q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids,
        pattern=pattern, scale=float(scale), softcap=softcap,
    )


def _softcap(value: float | None, pattern: Pattern) -> float:
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0 \
            or value == float("inf"):
        raise InputError(f"attend(): logit_softcap must be a finite number > 0 (Gemma 2 uses "
                         f"50.0), got {value!r}; pass None for no capping")
    if not pattern.softmax:
        raise PatternError(f"attend(): logit_softcap has no meaning for {pattern!r} attention "
                           "(there is no softmax over logits)")
    return float(value)
