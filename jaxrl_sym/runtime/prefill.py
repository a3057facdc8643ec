"""Packed prefill: a group's prompts bin-packed into rows, written into the right-aligned stores.

Why: the block prefill pushes a rectangle ``[row bucket, prompt block]`` through the model, so a
group whose prompts range from 64 to 512 tokens computes every short prompt's left padding and
every filler row of its bucket. On the suite's realistic lengths that was about a quarter of
all token positions the runtime computed (the engine's own log, ``waste_by_cause``: prompt
alignment and row-bucket filler; ``bench/results/waste.md``). Packed, the prefill computes the
prompts' tokens and the packing's tail.

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
budget, scanned through the stores; where the plan found the model's position-wise tail
(``builder.tail``) it runs at each prompt's last token only, so the logits are ``[R, V]``
whatever the prompts' lengths (without one a chunk is at least one packed row's ``[L, V]``).

Attention inside the prefill is the masked primitive over each packed row (``L^2`` scores per
row, so its work is about ``total * L``), on every backend; a row whose scores would exceed
:data:`SCORES_BYTES` (one long prompt is a row of its own) attends in blocks of queries, each
over all of its row's keys, so the temporaries grow linearly in the row's length.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxrl_sym.ops.attention import query_block
from jaxrl_sym.ops.attention_blocks import attend_in_query_blocks
from jaxrl_sym.ops.sampling import sample
from jaxrl_sym.runtime.evaluate import evaluate

SCORES_BYTES = 64 << 20
"""Most bytes of fp32 attention scores ``[rows, heads, queries, keys]`` one attention call of a
packed prefill (or prompt cache) holds at a time: a longer packed row attends in blocks of
queries (:func:`~jaxrl_sym.ops.attention_blocks.attend_in_query_blocks`), each over every key of its
row, so the prefill's temporaries grow linearly in a long prompt's length, not with its square.

Why: the masked primitive over a whole packed row holds ``[heads, T, T]`` scores, and one long
prompt is a row of its own: a toy model's prefill grew with the square of a long prompt, many
times padded's, whose prompt chunks of ``GenerationConfig.prefill_chunk`` bound its queries
(issue 47; the numbers: ``bench/results/cpu/design_notes.md``). Rows of
the default packing (the longest prompt's length, RL prompts of a few hundred tokens) fit in one
block and run the primitive unchanged. 64 MiB: a few such buffers per block stay far below a
device's memory while the blocks stay long enough (1,024 queries at 4,096 keys and 4 heads) that
the loop over them costs little; with them a long prompt's prefill temporaries stay near
flat in its length (``tests/test_prefill_long.py`` checks it; the numbers:
``bench/results/cpu/design_notes.md``)."""


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


def cache_prompts(builder: Any, hoisted: tuple[jax.Array, ...], tokens: jax.Array,
                  positions: jax.Array, rows: jax.Array, last: jax.Array, *, chunk_rows: int
                  ) -> tuple[dict[str, dict[str, jax.Array]], jax.Array]:
    """The prompt cache of a refilling group (a jitted program; :mod:`~jaxrl_sym.runtime.
    prompt_cache`): packed prompts (one batch entry per distinct prompt) through the model,
    keeping what each attention node would write into a store — keys, values and positions
    per packed token (``{node: {"k" [N, Hkv, D], "v", "pos" [N]}}``, N = rows x length) —
    instead of writing it, and each entry's last-token logits ``[U, V]`` (fp32). A refill
    then writes a prompt's entries into the row that takes it (:func:`refill_from_cache`)
    without running the model again: one program per chunk shape, whatever the refill."""
    n_chunks = tokens.shape[0] // chunk_rows
    split = lambda x: x.reshape(n_chunks, chunk_rows, *x.shape[1:])
    vocab = int(builder.pdg.node(builder.pdg.outputs[0]).shape[-1])

    def body(best, chunk):
        tok_c, pos_c, row_c, start = chunk
        kept: dict[str, dict[str, jax.Array]] = {}

        def keep(name: str, k: jax.Array, v: jax.Array, k_pos: jax.Array) -> None:
            kept[name] = {"k": k, "v": v, "pos": k_pos}

        picked, here = _model_on_chunk(builder, hoisted, tok_c, pos_c, row_c, last,
                                       start * tokens.shape[1], keep)
        return jnp.where(here[:, None], picked, best), kept

    init = jnp.zeros((last.shape[0], vocab), jnp.float32)
    starts = jnp.arange(n_chunks, dtype=jnp.int32) * chunk_rows
    logits, kept = lax.scan(body, init, (split(tokens), split(positions), split(rows), starts))
    return jax.tree_util.tree_map(lambda x: x.reshape(-1, *x.shape[2:]), kept), logits


def refill_from_cache(builder: Any, stores: dict[str, Any], cache: dict[str, Any],
                      logits: jax.Array, start: jax.Array, lens: jax.Array, entry: jax.Array,
                      refilled: jax.Array, write: jax.Array, step: jax.Array,
                      row_ids: jax.Array, seed: jax.Array, *, pcap: int, temperature: float,
                      want_logits: bool) -> tuple[Any, ...]:
    """Give the rows where ``refilled`` ([R] bool) is set new samples (a jitted program;
    :mod:`jaxrl_sym.runtime.refill`): every store empties those rows
    (:meth:`StoreKind.reset`) and takes, by its own :meth:`StoreKind.fill`, the cached keys and
    values of the row's prompt (``start`` [R]: its first token in the cache, ``lens`` its
    length) at slots ending just before ``write``, the slot the group's next decode step
    writes; each row samples its token 0 from its prompt's cached logits (``entry``) under
    response index 0's key, so a sample's tokens do not depend on when, or whether, it was
    refilled. The token goes where decode step ``step`` reads its input; other rows' stores
    and fed-back tokens are untouched. Returns (stores, tokens [R], log-probs [R], logits
    [R, V] or an empty array); the other rows' entries are meaningless."""
    b = refilled.shape[0]
    j = jnp.arange(pcap, dtype=jnp.int32)
    pos = j[None, :] - (pcap - lens[:, None])  # [R, pcap]: right-aligned prompt positions
    valid = refilled[:, None] & (pos >= 0)
    flat = jnp.clip(start[:, None] + pos, 0, None).reshape(-1)
    rows = jnp.where(valid, jnp.arange(b, dtype=jnp.int32)[:, None], b).reshape(-1)
    slots = jnp.broadcast_to(write - pcap + j, (b, pcap)).reshape(-1)
    pos = jnp.where(valid, pos, -1).reshape(-1)
    new = {}
    for name, st in stores.items():
        spec = _spec(builder, name)
        st = spec.kind.reset(spec, st, refilled)
        if name in cache:
            c = cache[name]
            n = c["pos"].shape[0]
            at = jnp.minimum(flat, n - 1)
            st = spec.kind.fill(spec, st, c["k"][at], c["v"][at], pos, rows, slots)
        new[name] = st
    picked = logits[jnp.clip(entry, 0, logits.shape[0] - 1)]
    tok, lp = sample(picked, seed=seed, steps=jnp.zeros((b,), jnp.int32), row_ids=row_ids,
                     temperature=temperature)
    for nid, sp in builder.slots.items():
        old = sp.kind.read(sp, new[str(nid)], step)[:, 0]
        new[str(nid)] = sp.kind.write(sp, new[str(nid)], jnp.where(refilled, tok, old), step)
    return builder.rows(new), tok, lp, (picked if want_logits else jnp.zeros((0,), jnp.float32))


def _spec(builder: Any, name: str) -> Any:
    """The spec of store ``name``: an attention node's, or the feedback edge's slot."""
    nid = int(name)
    return builder.specs[nid] if nid in builder.specs else builder.slots[nid]


def _packed(builder: Any, hoisted: tuple[jax.Array, ...], stores: dict[str, Any],
            tokens: jax.Array, positions: jax.Array, rows: jax.Array, slots: jax.Array,
            last: jax.Array, copies: jax.Array, chunk_rows: int
            ) -> tuple[dict[str, Any], jax.Array]:
    """The packed rows through the model in chunks, filling the stores; each batch row's
    last-prompt-token logits ``[R, V]`` (fp32). Each attention node's store takes the rows'
    keys/values (``StoreKind.fill``), each token into every row of ``copies`` that shares its
    prompt."""
    n_chunks = tokens.shape[0] // chunk_rows
    split = lambda x: x.reshape(n_chunks, chunk_rows, *x.shape[1:])
    vocab = int(builder.pdg.node(builder.pdg.outputs[0]).shape[-1])
    batch, m = copies.shape
    repeat = lambda x: jnp.repeat(x, m, axis=0)  # flat [N, …] tokens, each to its m rows

    def body(carry, chunk):
        st, best = carry
        tok_c, pos_c, row_c, slot_c, start = chunk
        new = dict(st)
        # token t goes to rows copies[rows[t], :] (entry t * m + j); out of range: dropped
        target = jnp.where(row_c[..., None] >= 0, copies[jnp.clip(row_c, 0, batch - 1)],
                           batch).reshape(-1)

        def fill(name: str, k: jax.Array, v: jax.Array, k_pos: jax.Array) -> None:
            spec = _spec(builder, name)
            new[name] = spec.kind.fill(spec, st[name], repeat(k), repeat(v), repeat(k_pos),
                                       target, repeat(slot_c.reshape(-1)))

        picked, here = _model_on_chunk(builder, hoisted, tok_c, pos_c, row_c, last,
                                       start * tokens.shape[1], fill)
        return (new, jnp.where(here[:, None], picked, best)), None

    init = (stores, jnp.zeros((batch, vocab), jnp.float32))
    starts = jnp.arange(n_chunks, dtype=jnp.int32) * chunk_rows
    (stores, logits), _ = lax.scan(body, init, (split(tokens), split(positions), split(rows),
                                                split(slots), starts))
    return stores, logits


def _model_on_chunk(builder: Any, hoisted: tuple[jax.Array, ...], tokens: jax.Array,
                    positions: jax.Array, rows: jax.Array, last: jax.Array, offset: jax.Array,
                    keys: Callable[[str, jax.Array, jax.Array, jax.Array], None]
                    ) -> tuple[jax.Array, jax.Array]:
    """The model on one chunk of packed rows; each attention node attends within them (the
    masked primitive) and hands its keys, values and key positions, flattened to ``[N, …]``,
    to ``keys(store name, k, v, k_pos)``. Returns the fp32 logits of each batch entry's last
    prompt token (``last``: flat indices over all chunks; this chunk starts at ``offset``)
    ``[batch, V]`` and whether that token is in this chunk: the position-wise tail runs there
    only where the plan found one (``builder.tail``), else on every position and the logits
    are picked after."""
    length = tokens.shape[1]
    n = tokens.shape[0] * length
    idx = last - offset
    here = (idx >= 0) & (idx < n)
    at = jnp.clip(idx, 0, n - 1)
    flat = lambda x: x.reshape(-1, *x.shape[2:])

    def attn(node: Any, args: list[jax.Array]) -> jax.Array:
        keys(str(node.id), flat(args[1]), flat(args[2]), flat(args[4]))
        # attention within the packed rows: the masked primitive, in blocks of queries whose
        # scores fit SCORES_BYTES (one block, the plain primitive, on rows that short)
        q = args[0]
        block = query_block(q.shape[0], q.shape[2], q.shape[1], args[1].shape[1], SCORES_BYTES)
        return attend_in_query_blocks(*args, block=block, **node.params)

    segments = jnp.where(rows >= 0, rows, last.shape[0])
    pairs = None if builder.tail is None else (at // length, at % length, builder.tail)
    out = evaluate(builder.pdg, builder.static_values(hoisted), tokens, positions, segments,
                   attention=attn, dynamic_only=True, at=pairs)
    logits = out[builder.pdg.outputs[0]][0]
    picked = (logits[:, 0] if pairs is not None
              else jnp.take(logits.reshape(-1, logits.shape[-1]), at, axis=0))
    return picked.astype(jnp.float32), here
