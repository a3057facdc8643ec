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


# --------------------------------------------------------------------------- patterns
# The Triton side of a pattern (``Pattern.kernel_code`` in jaxrl_sym/ops/attention.py):
# 0 causal, 1 window of SIZE, 2 aligned blocks of SIZE. A new pattern adds a branch to each of
# the three functions below and nothing in the kernels.


@triton.jit
def visible(qpos, kpos, PATTERN: tl.constexpr, SIZE: tl.constexpr):
    """Whether a key at ``kpos`` is visible from a query at ``qpos`` (broadcast shapes); empty
    slots and padded queries (position < 0) see nothing."""
    valid = (kpos >= 0) & (qpos >= 0) & (kpos <= qpos)
    if PATTERN == 1:
        valid = valid & (kpos > qpos - SIZE)
    if PATTERN == 2:
        valid = valid & (kpos >= qpos - qpos % SIZE)
    return valid


@triton.jit
def first_key(first, fpos, PATTERN: tl.constexpr, SIZE: tl.constexpr):
    """Packed layout: the first key index the query at index ``first`` (position ``fpos``, the
    earliest valid query of a tile) can see."""
    lo = first - fpos
    if PATTERN == 1:
        lo = tl.maximum(lo, first - SIZE + 1)
    if PATTERN == 2:
        lo = first - fpos % SIZE
    return lo


@triton.jit
def last_query(seg_end, last, lpos, PATTERN: tl.constexpr, SIZE: tl.constexpr):
    """Packed layout: one past the last query index that can see the key at index ``last``
    (position ``lpos``) of a sequence ending at ``seg_end``."""
    q_hi = seg_end
    if PATTERN == 1:
        q_hi = tl.minimum(q_hi, last + SIZE)
    if PATTERN == 2:
        q_hi = tl.minimum(q_hi, last - lpos % SIZE + SIZE)
    return q_hi
