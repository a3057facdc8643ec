"""Packed prefill: a group's prompts bin-packed into rows, written into the right-aligned stores.

Why: the block prefill pushes a rectangle ``[row bucket, prompt block]`` through the model, so a
group whose prompts range from 64 to 512 tokens computes every short prompt's left padding and
every filler row of its bucket. On the suite's realistic lengths that was 24% of all token
positions the runtime computed (the engine's own log, ``waste_by_cause``: prompt alignment 9%,
row-bucket filler 15%). Packed, the prefill computes the prompts' tokens and the packing's tail.

How: prompts are packed (:mod:`jaxrl_sym.runtime.packing`: first-fit-decreasing into rows of the
longest prompt's bucketed length, as the training forward packs sequences); the model runs on
those rows with segment ids, so the attention primitive masks across prompts;
each attention node's keys and values are then scattered into its store by the store's own
:meth:`StoreKind.fill` at each token's right-aligned slot (the decode steps that follow are
unchanged: every row still writes slot ``pcap + s - 1`` at step s). Row ``r``'s first token is
sampled from the logits at its last prompt token. A prompt that repeats (RL samples G responses
per prompt) is packed once and its keys and values written into every repeat's store row
(``PackedPrompts.copies``), so a GRPO rollout's prefill computes 1/G of the prompt tokens that
padded and Tunix compute.
Large vocabularies: the packed rows run in chunks whose logits fit the generation config's
budget, scanned through the stores.

Attention inside the prefill is the masked primitive over each packed row (``L^2`` scores per
row), on every backend.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxrl_sym.ops.sampling import sample
from jaxrl_sym.runtime.evaluate import bind, evaluate


def packed_prefill(builder: Any, hoisted: tuple[jax.Array, ...], stores: dict[str, Any],
                   tokens: jax.Array, positions: jax.Array, rows: jax.Array, slots: jax.Array,
                   last: jax.Array, copies: jax.Array, row_ids: jax.Array, seed: jax.Array, *,
                   temperature: float, want_logits: bool, chunk_rows: int
                   ) -> tuple[Any, ...]:
    """Fill empty stores from packed prompts; sample every row's token 0 (a jitted program).

    ``copies`` ``[R, M]``: the rows each packed prompt's entries are written to
    (``PackedPrompts.copies``; M > 1 where some row repeats another's prompt).

    Returns (stores, tokens [R], log-probs [R], last-token logits [R, V] or an empty array).
    """
    stores, logits = _packed(builder, hoisted, stores, tokens, positions, rows, slots, last,
                             copies, chunk_rows)
    steps = jnp.zeros((last.shape[0],), jnp.int32)
    tok, lp = sample(logits, seed=seed, steps=steps, row_ids=row_ids, temperature=temperature)
    zero = jnp.zeros((), jnp.int32)
    for nid, sp in builder.slots.items():
        stores = {**stores, str(nid): sp.kind.write(sp, stores[str(nid)], tok, zero)}
    # with a mesh: the stores leave split over its data axes, as every step program takes them
    return builder.rows(stores), tok, lp, (logits if want_logits else jnp.zeros((0,), jnp.float32))


def refill_prefill(builder: Any, hoisted: tuple[jax.Array, ...], stores: dict[str, Any],
                   tokens: jax.Array, positions: jax.Array, rows: jax.Array, slots: jax.Array,
                   last: jax.Array, copies: jax.Array, row_ids: jax.Array, seed: jax.Array,
                   refilled: jax.Array, step: jax.Array, *, temperature: float,
                   want_logits: bool, chunk_rows: int) -> tuple[Any, ...]:
    """Give the rows where ``refilled`` ([R] bool) is set new samples mid-group (a jitted
    program; :mod:`jaxrl_sym.runtime.refill`): every store empties those rows
    (:meth:`StoreKind.reset`), their packed prompts fill them at slots ending where the group's
    next decode step writes, and each samples its token 0 — under response index 0's key, so
    the sample's tokens do not depend on when it was refilled. The token goes where decode step
    ``step`` (the group's next) reads its input; the other rows' stores and fed-back tokens
    are untouched. Returns what :func:`packed_prefill` returns (the
    other rows' entries are meaningless)."""
    stores = {k: _spec(builder, k).kind.reset(_spec(builder, k), s, refilled)
              for k, s in stores.items()}
    stores, logits = _packed(builder, hoisted, stores, tokens, positions, rows, slots, last,
                             copies, chunk_rows)
    steps = jnp.zeros((last.shape[0],), jnp.int32)
    tok, lp = sample(logits, seed=seed, steps=steps, row_ids=row_ids, temperature=temperature)
    for nid, sp in builder.slots.items():
        old = sp.kind.read(sp, stores[str(nid)], step)[:, 0]
        fed = jnp.where(refilled, tok, old)
        stores = {**stores, str(nid): sp.kind.write(sp, stores[str(nid)], fed, step)}
    return builder.rows(stores), tok, lp, (logits if want_logits else jnp.zeros((0,), jnp.float32))


def _spec(builder: Any, name: str) -> Any:
    """The spec of store ``name``: an attention node's, or the feedback edge's slot."""
    nid = int(name)
    return builder.specs[nid] if nid in builder.specs else builder.slots[nid]


def _packed(builder: Any, hoisted: tuple[jax.Array, ...], stores: dict[str, Any],
            tokens: jax.Array, positions: jax.Array, rows: jax.Array, slots: jax.Array,
            last: jax.Array, copies: jax.Array, chunk_rows: int
            ) -> tuple[dict[str, Any], jax.Array]:
    """The packed rows through the model in chunks, filling the stores; each batch row's
    last-prompt-token logits ``[R, V]`` (fp32)."""
    pdg = builder.pdg
    n_chunks = tokens.shape[0] // chunk_rows
    split = lambda x: x.reshape(n_chunks, chunk_rows, *x.shape[1:])
    vocab = int(pdg.node(pdg.outputs[0]).shape[-1])
    batch = last.shape[0]

    def body(carry, chunk):
        st, best = carry
        tok_c, pos_c, row_c, slot_c, start = chunk
        idx = last - start * tokens.shape[1]
        n = tok_c.shape[0] * tok_c.shape[1]
        here = (idx >= 0) & (idx < n)
        at = jnp.clip(idx, 0, n - 1)
        st, picked = _evaluate_chunk(builder, hoisted, st, tok_c, pos_c, row_c, slot_c, copies,
                                     at)
        return (st, jnp.where(here[:, None], picked.astype(jnp.float32), best)), None

    init = (stores, jnp.zeros((batch, vocab), jnp.float32))
    starts = jnp.arange(n_chunks, dtype=jnp.int32) * chunk_rows
    (stores, logits), _ = lax.scan(body, init, (split(tokens), split(positions), split(rows),
                                                split(slots), starts))
    return stores, logits


def _evaluate_chunk(builder: Any, hoisted: tuple[jax.Array, ...], stores: dict[str, Any],
                    tokens: jax.Array, positions: jax.Array, rows: jax.Array, slots: jax.Array,
                    copies: jax.Array, at: jax.Array) -> tuple[dict[str, Any], jax.Array]:
    """The model on packed rows; each attention node attends within them (masked primitive)
    and its store takes the rows' keys/values (``StoreKind.fill``), each token into every row
    of ``copies`` that shares its prompt. Returns the logits at the flat positions ``at``
    ``[batch, V]``: the position-wise tail runs there only where the plan found one
    (``builder.tail``), else on every position and the logits are picked after."""
    new = dict(stores)
    batch, m = copies.shape
    # token t goes to rows copies[rows[t], :] (entry t * m + j); out of range: dropped
    target = jnp.where(rows[..., None] >= 0, copies[jnp.clip(rows, 0, batch - 1)],
                       batch).reshape(-1)
    repeat = lambda x: jnp.repeat(x.reshape(-1, *x.shape[2:]), m, axis=0)
    flat_slots = repeat(slots)

    def attn(node: Any, args: list[jax.Array]) -> jax.Array:
        spec = builder.specs[node.id]
        k, v, k_pos = args[1], args[2], args[4]
        new[str(node.id)] = spec.kind.fill(spec, stores[str(node.id)], repeat(k), repeat(v),
                                           repeat(k_pos), target, flat_slots)
        return bind(node, args)  # attention within the packed rows: the masked primitive

    segments = jnp.where(rows >= 0, rows, batch)
    length = tokens.shape[1]
    pairs = None if builder.tail is None else (at // length, at % length, builder.tail)
    out = evaluate(builder.pdg, builder.static_values(hoisted), tokens, positions, segments,
                   attention=attn, dynamic_only=True, at=pairs)
    logits = out[builder.pdg.outputs[0]][0]
    if pairs is not None:
        return new, logits[:, 0]
    return new, jnp.take(logits.reshape(-1, logits.shape[-1]), at, axis=0)
