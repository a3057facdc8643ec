"""The attention primitive in blocks of queries: bounded temporaries for long packed rows.

Its own module beside :mod:`jaxrl_sym.ops.attention` (the primitive, its rules and reference),
which it only calls: a packed prefill (:mod:`jaxrl_sym.runtime.prefill`) runs one long prompt as
a row of its own, where the primitive in one call holds ``[heads, T, T]`` scores.
"""

from __future__ import annotations

import jax

from jaxrl_sym.ops.attention import Pattern, attention_p, in_query_blocks


def attend_in_query_blocks(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array,
                           k_pos: jax.Array, q_seg: jax.Array, k_seg: jax.Array, *,
                           block: int, pattern: Pattern, scale: float, softcap: float
                           ) -> jax.Array:
    """The attention primitive over every key, ``block`` queries at a time (a ``lax.map``), so
    its scores and mask are ``[B, H, block, Tk]`` instead of ``[B, H, Tq, Tk]``: temporaries
    linear in the keys, not quadratic. Each query's row of scores, softmax and weighted sum are
    computed over the same keys as in one call, so the result is the primitive's up to float
    rounding (XLA's dots and reductions at other shapes may sum in another order: within
    ~5e-7 of one call on CPU, fp32). Queries past the last block's end are padding at
    position -1 (empty: output 0) and are cut off. ``block >= Tq``: the primitive itself.

    Why: a packed prefill runs the primitive over whole packed rows, one long prompt a row of
    its own; at 16k tokens the ``[heads, T, T]`` fp32 scores were nearly all of a toy model's
    prefill memory (issue 47; the numbers: ``bench/results/cpu/design_notes.md``)."""
    if block >= q.shape[1]:
        return attention_p.bind(q, k, v, q_pos, k_pos, q_seg, k_seg, pattern=pattern,
                                scale=scale, softcap=softcap)
    return in_query_blocks(lambda qb, pb, sb: attention_p.bind(
        qb, k, v, pb, k_pos, sb, k_seg, pattern=pattern, scale=scale, softcap=softcap),
        q, q_pos, q_seg, block)
