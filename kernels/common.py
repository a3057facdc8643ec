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
