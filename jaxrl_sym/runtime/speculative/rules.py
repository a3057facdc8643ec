"""Speculative decoding's shared vocabulary: the drafts, the acceptance rule, the log.

Why a home of its own, below the runtime and the baselines: the padded speculative baseline
(:mod:`jaxrl_sym.baselines.padded_speculative`) must keep the same drafts and decisions as the
symbolic runtime (:mod:`jaxrl_sym.runtime.speculative.lm`) so that the two are comparable token for
token, yet a baseline must not import the system it is measured against. Both import these, as
both import :func:`jaxrl_sym.generation.select_tokens`.

- :func:`ngram_draft`: prompt-lookup drafting (no model) on the host, and
  :func:`device_ngram_draft`, its twin over a device batch (the runtime's verify tile);
- :func:`accept`: the acceptance rule on device. Greedy: drafts are kept while they equal the
  target's argmax, then the target's own token — so the output is plain greedy decoding's, token
  for token. Temperature > 0: rejection sampling for a deterministic draft (draft x accepted with
  probability p(x), else a token from p with x removed, renormalised), which leaves every emitted
  token distributed as the target's p given its prefix. Log-probs are always the target's.
- :class:`SpecLog`: what speculation did in one generate call (both systems report it).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

NGRAM_MAX = 3  # longest suffix the prompt-lookup draft matches


def ngram_draft(context: np.ndarray, k: int, max_n: int = NGRAM_MAX) -> np.ndarray:
    """k tokens proposed for the continuation of ``context`` (1-D ints), no model.

    Prompt lookup: for n = max_n .. 1, find the latest earlier occurrence of the context's last
    n tokens and propose what followed it; the first n that matches wins. Short or missing
    continuations are filled by repeating the last proposed (or the last context) token — any
    draft is correct (verification decides), a bad one only lowers the acceptance rate.
    """
    ctx = np.asarray(context)
    out: list[int] = []
    for n in range(min(max_n, len(ctx) - 1), 0, -1):
        tail = ctx[-n:]
        # windows of n tokens ending before the last token; latest match first
        wins = np.lib.stride_tricks.sliding_window_view(ctx[:-1], n)
        hits = np.nonzero((wins == tail).all(axis=1))[0]
        if hits.size:
            start = int(hits[-1]) + n
            out = ctx[start:start + k].tolist()
            break
    fill = out[-1] if out else int(ctx[-1])
    return np.asarray(out + [fill] * (k - len(out)), np.int32)


def device_ngram_draft(hist: jax.Array, length: jax.Array, k: int, max_n: int = NGRAM_MAX
                       ) -> jax.Array:
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


def accept(logits: jax.Array, drafts: jax.Array, *, seed: jax.Array, row_ids: jax.Array,
           index: jax.Array, temperature: float) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The verify step's decision for every row.

    logits ``[B, k+1, V]``: the target's at the last emitted token and at each draft token;
    drafts ``[B, k]``; index ``[B]``: the response index of the token position 0 decides (the
    sampling key, with seed and row id). Returns (tokens ``[B, k+1]``, the target's log-probs of
    them, accepted ``[B]``): a row emits ``tokens[:accepted + 1]`` — its accepted drafts, then
    one token of the target's (the correction at the first rejection, or a bonus token).
    """
    x = logits.astype(jnp.float32)
    k = drafts.shape[1]
    if temperature == 0.0:
        lp = jax.nn.log_softmax(x, axis=-1)
        tok = jnp.argmax(x, axis=-1).astype(jnp.int32)
        ok = drafts == tok[:, :k]
    else:
        lp = jax.nn.log_softmax(x / temperature, axis=-1)
        keys = _keys(seed, row_ids, index, k + 1)  # [B, k+1]
        u = jax.vmap(jax.vmap(lambda kk: jax.random.uniform(jax.random.fold_in(kk, 0))))(keys)
        p_draft = jnp.exp(jnp.take_along_axis(lp[:, :k], drafts[..., None], axis=-1)[..., 0])
        ok = u[:, :k] < p_draft
        # residual at position i < k: p with draft i removed (renormalised by categorical);
        # at position k (every draft accepted): p itself
        hit = jax.nn.one_hot(drafts, x.shape[-1], dtype=bool)
        hit = jnp.concatenate([hit, jnp.zeros_like(hit[:, :1])], axis=1)
        resid = jnp.where(hit, -jnp.inf, lp)
        draw = lambda kk, row: jax.random.categorical(jax.random.fold_in(kk, 1), row)
        tok = jax.vmap(jax.vmap(draw))(keys, resid).astype(jnp.int32)
    accepted = jnp.cumprod(ok.astype(jnp.int32), axis=1).sum(axis=1)
    i = jnp.arange(k + 1)[None]
    padded = jnp.concatenate([drafts, drafts[:, -1:]], axis=1)
    tok = jnp.where(i < accepted[:, None], padded, tok)
    return tok, jnp.take_along_axis(lp, tok[..., None], axis=-1)[..., 0], accepted


def _keys(seed: jax.Array, row_ids: jax.Array, index: jax.Array, c: int) -> jax.Array:
    """One key per (row, response index): fold_in(fold_in(key(seed), row), index + i)."""
    base = jax.random.key(seed)

    def row_keys(row, start):
        rk = jax.random.fold_in(base, row)
        return jax.vmap(lambda j: jax.random.fold_in(rk, start + j))(jnp.arange(c))

    return jax.vmap(row_keys)(row_ids, index)


@dataclasses.dataclass
class SpecLog:
    """What speculation did in one generate call: per request row, drafts proposed/accepted;
    verify dispatches per k; draft seconds. ``verify_seconds`` / ``timed``: seconds and count of
    verifies per k that compiled nothing — the adaptive choice's cost table, carried from call to
    call by :class:`SpeculativeLM` (a compile would make a k look too dear to try again)."""

    proposed: dict[int, int] = dataclasses.field(default_factory=dict)
    accepted: dict[int, int] = dataclasses.field(default_factory=dict)
    verify_seconds: dict[int, float] = dataclasses.field(default_factory=dict)
    timed: dict[int, int] = dataclasses.field(default_factory=dict)
    verifies: dict[int, int] = dataclasses.field(default_factory=dict)
    draft_seconds: float = 0.0

    def rate(self) -> float | None:
        total = sum(self.proposed.values())
        return sum(self.accepted.values()) / total if total else None

    def report(self, n_rows: int) -> dict[str, Any]:
        per_row = [self.accepted.get(i, 0) / self.proposed[i] if self.proposed.get(i) else None
                   for i in range(n_rows)]
        return {"acceptance_rate": self.rate(), "acceptance_per_row": per_row,
                "drafted_tokens": sum(self.proposed.values()),
                "accepted_tokens": sum(self.accepted.values()),
                "verify_steps": dict(sorted(self.verifies.items())),
                "draft_seconds": self.draft_seconds}
