"""Several speculative verify steps in one program: the draft on device, no host round trip.

Why: the plain engine already runs ``decode_tile`` steps per dispatch (one device→host sync per
tile). A host-side draft needs the tokens back after every verify, which costs a sync per
verify; on small models that sync costs more than the tokens speculation saves (measured:
``bench/experiments/speculative.py``). Here the prompt-lookup draft runs on device
(:func:`~jaxrl_sym.runtime.speculative.rules.device_ngram_draft`, the same drafts as
:func:`~jaxrl_sym.runtime.speculative.rules.ngram_draft`)
over each row's token history — or a draft model does, from its own stores
(:func:`model_draft`) — so ``m`` verifies are one ``lax.scan``; each row stops at its EOS or
limit inside the tile (later steps leave it untouched, its outputs are ignored).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxrl_sym.runtime.evaluate import evaluate
from jaxrl_sym.runtime.programs import StepBuilder
from jaxrl_sym.runtime.speculative.rules import accept, device_ngram_draft


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class VerifyRows:
    """The per-row state a verify tile takes and advances, as one argument (the speculative
    twin of :class:`~jaxrl_sym.runtime.programs.DecodeRows`).

    Why one value: :func:`verify_tile` took these as seven positional arrays among fourteen,
    and its scan carried four of them by position. ``hist [B, H]``: each row's tokens so far,
    prompt first (the device draft reads them); ``length [B]``: how many; ``emitted [B]`` /
    ``limit [B]``: response tokens so far / at most; ``offset [B]``: slot minus position (the
    store layout); ``done [B]``: rows to leave alone; ``row_id [B]``: the id sampling draws
    with. Arrays (host or device).
    """

    hist: Any
    length: Any
    emitted: Any
    limit: Any
    offset: Any
    done: Any
    row_id: Any


def forward_at(builder: StepBuilder, hoisted: tuple[jax.Array, ...], stores: dict,
               tokens: jax.Array, positions: jax.Array, slots: jax.Array
               ) -> tuple[dict, jax.Array]:
    """The PDG on ``tokens [B, c]`` at ``positions``, every attention store writing row b's
    entries at its own ``slots[b]`` first (-1: none; :meth:`StoreKind.verify`). The slot store
    (feedback edge) is not read: the tokens are given. Returns (stores, fp32 logits
    ``[B, c, V]``): a verify's (the target's) or a draft step's."""
    new_stores = dict(stores)

    def attn(node: Any, args: list[jax.Array]) -> jax.Array:
        spec = builder.specs[node.id]
        out, new_stores[str(node.id)] = spec.kind.verify(spec, stores[str(node.id)], args, slots)
        return out

    out = evaluate(builder.pdg, builder.static_values(hoisted), tokens, positions,
                   attention=attn, dynamic_only=True)
    # every position's logits (the acceptance rule reads them all); nothing is sampled here
    return builder.rows(new_stores), out[builder.pdg.outputs[0]][0].astype(jnp.float32)


def verify_program(builder: StepBuilder, hoisted: tuple[jax.Array, ...], stores: dict,
                   tokens: jax.Array, positions: jax.Array, slots: jax.Array,
                   row_ids: jax.Array, seed: jax.Array, index: jax.Array, *,
                   temperature: float, want_logits: bool) -> tuple[Any, ...]:
    """Evaluate the PDG on ``tokens [B, k+1]`` (the last emitted token, then k drafts) at
    ``positions``; store entries go to ``slots`` (per row, -1: none). The slot store (feedback
    edge) is not read: the host supplies the tokens, as it built the drafts from them.
    Returns (stores, tokens, log-probs, accepted, logits ``[B, k+1, V]`` or an empty array)."""
    stores, logits = forward_at(builder, hoisted, stores, tokens, positions, slots)
    tok, lp, acc = accept(logits, tokens[:, 1:], seed=seed, row_ids=row_ids, index=index,
                          temperature=temperature)
    kept = logits if want_logits else jnp.zeros((0,), jnp.float32)
    return stores, tok, lp, acc, kept


def model_draft(builder: StepBuilder, hoisted: tuple[jax.Array, ...], stores: dict,
                hist: jax.Array, length: jax.Array, offset: jax.Array, done: jax.Array,
                k: int) -> tuple[jax.Array, dict]:
    """``k`` greedy draft tokens per row from a draft model's own stores (same row layout as
    the target's: slot = position + ``offset``).

    The first step feeds the row's last two tokens: when the previous verify accepted every
    draft, the last of them was never fed to the draft (re-feeding an entry the stores hold
    writes the same keys). Then each proposal is fed back, k - 1 times. Rejected proposals
    from the previous round sit at positions this round writes before any query attends them
    (the argument of :meth:`StoreKind.verify`). Greedy, so the draft is deterministic — the
    case the acceptance rule (:func:`~jaxrl_sym.runtime.speculative.rules.accept`) is exact for.
    Done rows write nothing (slots -1) and their proposals are ignored."""
    two = jnp.asarray([-2, -1], jnp.int32)[None]
    pos = length[:, None] + two
    tok = jnp.take_along_axis(hist, jnp.maximum(pos, 0), axis=1)
    drafts = []
    for i in range(k):
        p = jnp.where(done[:, None], -1, pos)
        stores, lg = forward_at(builder, hoisted, stores, tok, p,
                                jnp.where(done[:, None], -1, pos + offset[:, None]))
        tok = jnp.argmax(lg[:, -1], axis=-1).astype(jnp.int32)[:, None]
        drafts.append(tok[:, 0])
        pos = (length + i)[:, None]
    return jnp.stack(drafts, axis=1), stores


def verify_tile(builder: StepBuilder, hoisted: tuple[jax.Array, ...], stores: dict,
                rows: VerifyRows, seed: jax.Array, draft_hoisted: tuple[jax.Array, ...] = (),
                draft_stores: dict | None = None, *, temperature: float, want_logits: bool,
                k: int, m: int, eos: tuple[int, ...], draft: StepBuilder | None = None
                ) -> tuple[Any, ...]:
    """``m`` draft + verify steps over ``rows`` (:class:`VerifyRows`; a row stops at its EOS
    or limit, later steps leave it alone). ``draft``: a draft model's step builder (its
    weights and stores in ``draft_hoisted`` / ``draft_stores``); None: prompt lookup.
    Returns (stores, draft stores, then per step: tokens ``[m, B, k+1]``, log-probs, tokens
    kept ``[m, B]`` (0: the row was done), accepted drafts ``[m, B]``, logits)."""
    ar = jnp.arange(k + 1, dtype=jnp.int32)[None]

    def body(carry, _):
        stores, dstores, r = carry
        if draft is None:
            drafts = device_ngram_draft(r.hist, r.length, k)
        else:
            drafts, dstores = model_draft(draft, draft_hoisted, dstores, r.hist, r.length,
                                          r.offset, r.done, k)
        last = jnp.take_along_axis(r.hist, jnp.maximum(r.length - 1, 0)[:, None], axis=1)
        tokens = jnp.concatenate([last, drafts], axis=1)
        positions = jnp.where(r.done[:, None], -1, (r.length - 1)[:, None] + ar)
        slots = jnp.where(r.done[:, None], -1, positions + r.offset[:, None])
        stores, tok, lp, acc, lg = verify_program(
            builder, hoisted, stores, tokens, positions, slots, r.row_id, seed, r.emitted,
            temperature=temperature, want_logits=want_logits)
        keep = jnp.minimum(acc + 1, r.limit - r.emitted)
        hit = jnp.isin(tok, jnp.asarray(eos or (-1,), jnp.int32)) & (ar < keep[:, None])
        keep = jnp.where(hit.any(axis=1), jnp.argmax(hit, axis=1) + 1, keep)
        keep = jnp.where(r.done, 0, keep)
        cols = jnp.where(ar < keep[:, None], r.length[:, None] + ar, r.hist.shape[1])
        at = jnp.broadcast_to(jnp.arange(r.hist.shape[0])[:, None], cols.shape)
        r = dataclasses.replace(
            r, hist=r.hist.at[at, cols].set(tok, mode="drop"), length=r.length + keep,
            emitted=r.emitted + keep,
            done=r.done | hit.any(axis=1) | (r.emitted + keep >= r.limit))
        return (stores, dstores, r), (tok, lp, keep, acc, lg)

    carry = (stores, draft_stores or {}, rows)
    (stores, dstores, *_), outs = lax.scan(body, carry, None, length=m)
    return (stores, dstores, *outs)
