"""Triton helpers shared by the attention kernels: the score transform, written once.

``log2_logits`` turns raw ``q·k`` into the log2-domain scores the kernels' ``exp2`` softmax uses:
``s * scale * log2(e)``, or with attention-logit soft-capping (Gemma 2)
``softcap * tanh(s * scale / softcap) * log2(e)``. ``softcap_slope`` is the derivative of the
capped logit with respect to the uncapped one, ``1 - tanh²``, which the backward kernels multiply
into dS. tanh is written as ``2·sigmoid(2x) - 1`` (``tl.sigmoid`` exists compiled and in the
interpreter; a libdevice tanh would not run in the interpreter). ``SOFTCAP == 0`` compiles the
plain path: no extra instructions for models without capping.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def log2_logits(s, QK_SCALE: tl.constexpr, SCALE: tl.constexpr, SOFTCAP: tl.constexpr):
    if SOFTCAP > 0:
        t = 2.0 * tl.sigmoid(s * (2.0 * SCALE / SOFTCAP)) - 1.0
        return t * (SOFTCAP * 1.4426950408889634)
    else:
        return s * QK_SCALE


@triton.jit
def softcap_slope(s, SCALE: tl.constexpr, SOFTCAP: tl.constexpr):
    if SOFTCAP > 0:
        t = 2.0 * tl.sigmoid(s * (2.0 * SCALE / SOFTCAP)) - 1.0
        return 1.0 - t * t
    else:
        return 1.0


# --------------------------------------------------------------------------- the mask family
# Every softmax pattern reaches the kernels as ``KernelMask.constexprs()``
# (jaxrl_sym/ops/attention.py): a key at position k is visible from a query at q iff
# 0 <= k <= q, k >= q - LOOKBACK (LOOKBACK >= 0) and k >= q - q % PERIOD (PERIOD > 0).
# Causal is (-1, 0), a window of w is (w-1, 0), blocks of b are (-1, b). The three functions
# below evaluate that form for any values; they name no pattern, so a new pattern whose mask
# has this form changes nothing here.


@triton.jit
def visible(qpos, kpos, LOOKBACK: tl.constexpr, PERIOD: tl.constexpr):
    """Whether a key at ``kpos`` is visible from a query at ``qpos`` (broadcast shapes); empty
    slots and padded queries (position < 0) see nothing."""
    valid = (kpos >= 0) & (qpos >= 0) & (kpos <= qpos)
    if LOOKBACK >= 0:
        valid = valid & (kpos >= qpos - LOOKBACK)
    if PERIOD > 0:
        valid = valid & (kpos >= qpos - qpos % PERIOD)
    return valid


@triton.jit
def first_key(first, fpos, LOOKBACK: tl.constexpr, PERIOD: tl.constexpr):
    """Packed layout: the first key index the query at index ``first`` (position ``fpos``, the
    earliest valid query of a tile) can see: its sequence's start, raised by each bound."""
    lo = first - fpos
    if LOOKBACK >= 0:
        lo = tl.maximum(lo, first - LOOKBACK)
    if PERIOD > 0:
        lo = tl.maximum(lo, first - fpos % PERIOD)
    return lo


@triton.jit
def last_query(seg_end, last, lpos, LOOKBACK: tl.constexpr, PERIOD: tl.constexpr):
    """Packed layout: one past the last query index that can see the key at index ``last``
    (position ``lpos``) of a sequence ending at ``seg_end``: the sequence's end, lowered by each
    bound (a query further than LOOKBACK ahead, or past the key's period, cannot see it)."""
    q_hi = seg_end
    if LOOKBACK >= 0:
        q_hi = tl.minimum(q_hi, last + LOOKBACK + 1)
    if PERIOD > 0:
        q_hi = tl.minimum(q_hi, last - lpos % PERIOD + PERIOD)
    return q_hi


# --------------------------------------------------------------------------- shared tile steps
# Written once here and inlined by Triton into each kernel that calls them (a ``@triton.jit``
# callee is compiled into its caller), so splitting a kernel into these costs nothing at run time.


@triton.jit
def load_heads(ptr, idx, idx_mask, h, H: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rows ``idx`` of head ``h`` of a ``[rows, H, D]`` array as a ``[len(idx), BLOCK_D]`` tile;
    masked rows and the columns past ``D`` read 0 (and are never fetched)."""
    offs = tl.arange(0, BLOCK_D)
    return tl.load(
        ptr + idx[:, None] * (H * D) + h * D + offs[None, :],
        mask=idx_mask[:, None] & (offs < D)[None, :],
        other=0.0,
    )


@triton.jit
def store_heads(ptr, x, idx, idx_mask, h, H: tl.constexpr, D: tl.constexpr,
                BLOCK_D: tl.constexpr):
    """:func:`load_heads`' inverse: the tile ``x`` into rows ``idx`` of head ``h``, cast to the
    output's dtype; masked rows and the columns past ``D`` are not written."""
    offs = tl.arange(0, BLOCK_D)
    tl.store(
        ptr + idx[:, None] * (H * D) + h * D + offs[None, :],
        x.to(ptr.dtype.element_ty),
        mask=idx_mask[:, None] & (offs < D)[None, :],
    )


@triton.jit
def online_softmax(q, k, v, valid, m_i, l_i, acc, QK_SCALE: tl.constexpr, SCALE: tl.constexpr,
                   SOFTCAP: tl.constexpr, F32_DOT: tl.constexpr):
    """One key tile of the flash-attention forward: scores of ``q`` against ``k`` (masked by
    ``valid``, broadcast to ``[rows, keys]``), then the running max ``m_i``, normaliser ``l_i``
    and unnormalised output ``acc`` rescaled and advanced by ``v``. Returns the new three."""
    if F32_DOT:
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="tf32x3")
    else:
        s = tl.dot(q, tl.trans(k))
    s = tl.where(valid, log2_logits(s, QK_SCALE, SCALE, SOFTCAP), float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row with no valid key so far keeps m = -inf; shift by 0 instead to avoid inf - inf.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if F32_DOT:
        pv = tl.dot(p, v.to(tl.float32), input_precision="tf32x3")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc
