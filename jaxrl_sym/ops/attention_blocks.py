"""The attention primitive in blocks of queries: bounded temporaries for long packed rows.

Its own module beside :mod:`jaxrl_sym.ops.attention` (the primitive, its rules and reference),
which it only calls: a packed prefill (:mod:`jaxrl_sym.runtime.prefill`) runs one long prompt as
a row of its own, where the primitive in one call holds ``[heads, T, T]`` scores.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_sym.ops.attention import Pattern, attention_p

QUERY_BLOCK_MIN = 16
"""Fewest queries :func:`query_block` puts in a block: past it a block's scores exceed the
budget rather than the loop growing without end (keys that long are rare)."""


def query_block(rows: int, heads: int, tq: int, tk: int, budget: int) -> int:
    """Queries per block of :func:`attend_in_query_blocks` such that one block's fp32 scores
    ``[rows, heads, block, tk]`` fit ``budget`` bytes (at least :data:`QUERY_BLOCK_MIN`);
    ``tq`` (one block, the plain primitive) when all of them fit. Blocks are as even as their
    count allows, on a multiple of 8, so the padding stays under 8 queries per block."""
    per_query = 4 * rows * heads * tk
    if tq * per_query <= budget:
        return tq
    most = max(QUERY_BLOCK_MIN, budget // per_query)
    n = -(-tq // most)  # blocks
    even = -(-tq // n)  # queries per block, as even as n blocks allow
    return min(tq, -(-even // 8) * 8)


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
    its own; at 16,384 tokens the ``[heads, T, T]`` fp32 scores were 4.3 GB of a 2-layer toy
    model's 4.55 GB prefill (issue 47)."""
    b, tq = q.shape[:2]
    if block >= tq:
        return attention_p.bind(q, k, v, q_pos, k_pos, q_seg, k_seg, pattern=pattern,
                                scale=scale, softcap=softcap)
    n = -(-tq // block)
    pad = n * block - tq

    def blocks(x: jax.Array, fill: int | float) -> jax.Array:
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)
        return jnp.moveaxis(x.reshape(b, n, block, *x.shape[2:]), 1, 0)

    def one(qb: tuple[jax.Array, jax.Array, jax.Array]) -> jax.Array:
        return attention_p.bind(qb[0], k, v, qb[1], k_pos, qb[2], k_seg, pattern=pattern,
                                scale=scale, softcap=softcap)

    out = jax.lax.map(one, (blocks(q, 0), blocks(q_pos, -1), blocks(q_seg, 0)))
    out = jnp.moveaxis(out, 0, 1).reshape(b, n * block, *out.shape[3:])
    return out[:, :tq]
