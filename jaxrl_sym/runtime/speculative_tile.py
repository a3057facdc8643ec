"""Several speculative verify steps in one program: the draft on device, no host round trip.

Why: the plain engine already runs ``decode_tile`` steps per dispatch (one device→host sync per
tile). A host-side draft needs the tokens back after every verify, which costs a sync per
verify; on small models that sync costs more than the tokens speculation saves (measured:
``bench/speculative.py``). Here the prompt-lookup draft runs on device
(:func:`device_ngram_draft`, the same drafts as :func:`~jaxrl_sym.runtime.speculative.ngram_draft`)
over each row's token history, so ``m`` verifies are one ``lax.scan``; each row stops at its EOS
or limit inside the tile (later steps leave it untouched, its outputs are ignored).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxrl_sym.runtime.programs import StepBuilder


def device_ngram_draft(hist: jax.Array, length: jax.Array, k: int, max_n: int = 3) -> jax.Array:
    """``k`` draft tokens per row from ``hist [B, L]`` (each row's prompt + response so far,
    ``length [B]`` tokens): what followed the latest earlier occurrence of the row's last n
    tokens, n = max_n .. 1; short continuations repeat their last token, no match repeats the
    row's last token (the rules of the host :func:`ngram_draft`)."""
    b, size = hist.shape
    j = jnp.arange(size, dtype=jnp.int32)[None]
    at = lambda idx: jnp.take_along_axis(hist, jnp.clip(idx, 0, size - 1)[:, None], axis=1)[:, 0]
    padded = jnp.concatenate([hist, jnp.zeros((b, max_n), hist.dtype)], axis=1)
    start = jnp.zeros((b,), jnp.int32)
    found = jnp.zeros((b,), bool)
    for n in range(max_n, 0, -1):
        ok = (j <= (length - 1 - n)[:, None]) & (n <= length - 1)[:, None]
        for i in range(n):
            ok &= padded[:, i:i + size] == at(length - n + i)[:, None]
        best = jnp.max(jnp.where(ok, j, -1), axis=1)
        start = jnp.where(~found & (best >= 0), best + n, start)
        found |= best >= 0
    idx = jnp.minimum(start[:, None] + jnp.arange(k, dtype=jnp.int32)[None], (length - 1)[:, None])
    drafts = jnp.take_along_axis(hist, jnp.clip(idx, 0, size - 1), axis=1)
    return jnp.where(found[:, None], drafts, at(length - 1)[:, None]).astype(jnp.int32)


def verify_tile(builder: StepBuilder, hoisted: tuple[jax.Array, ...], stores: dict,
                hist: jax.Array, length: jax.Array, emitted: jax.Array, limit: jax.Array,
                offset: jax.Array, done: jax.Array, row_ids: jax.Array, seed: jax.Array, *,
                temperature: float, want_logits: bool, k: int, m: int,
                eos: tuple[int, ...]) -> tuple[Any, ...]:
    """``m`` draft + verify steps. Per row: ``hist``/``length`` its tokens so far (prompt first),
    ``emitted`` / ``limit`` its response tokens so far / at most, ``offset`` slot minus position
    (the store layout), ``done`` rows to leave alone. Returns (stores, then per step: tokens
    ``[m, B, k+1]``, log-probs, tokens kept ``[m, B]`` (0: the row was done), accepted drafts
    ``[m, B]``, logits)."""
    from jaxrl_sym.runtime.speculative import verify_program  # the one verify step

    ar = jnp.arange(k + 1, dtype=jnp.int32)[None]

    def body(carry, _):
        stores, hist, length, emitted, done = carry
        drafts = device_ngram_draft(hist, length, k)
        last = jnp.take_along_axis(hist, jnp.maximum(length - 1, 0)[:, None], axis=1)
        tokens = jnp.concatenate([last, drafts], axis=1)
        positions = jnp.where(done[:, None], -1, (length - 1)[:, None] + ar)
        slots = jnp.where(done[:, None], -1, positions + offset[:, None])
        stores, tok, lp, acc, lg = verify_program(
            builder, hoisted, stores, tokens, positions, slots, row_ids, seed, emitted,
            temperature=temperature, want_logits=want_logits)
        keep = jnp.minimum(acc + 1, limit - emitted)
        hit = jnp.isin(tok, jnp.asarray(eos or (-1,), jnp.int32)) & (ar < keep[:, None])
        keep = jnp.where(hit.any(axis=1), jnp.argmax(hit, axis=1) + 1, keep)
        keep = jnp.where(done, 0, keep)
        cols = jnp.where(ar < keep[:, None], length[:, None] + ar, hist.shape[1])
        rows = jnp.broadcast_to(jnp.arange(hist.shape[0])[:, None], cols.shape)
        hist = hist.at[rows, cols].set(tok, mode="drop")
        done = done | hit.any(axis=1) | (emitted + keep >= limit)
        return (stores, hist, length + keep, emitted + keep, done), (tok, lp, keep, acc, lg)

    (stores, *_), outs = lax.scan(body, (stores, hist, length, emitted, done), None, length=m)
    return (stores, *outs)
