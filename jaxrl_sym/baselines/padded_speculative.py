"""The padded baseline with the same speculative decoding as the symbolic runtime.

What a padded JAX stack does to speculate: prompts left-padded to P, every attention call's
cache preallocated at ``MAX_LEN = P + N + K`` slots, one compiled prefill program and one
compiled verify program at ``[B, K+1]``. Every row runs every verify until the last row ends
(finished rows keep computing, masked), and every query attends over all MAX_LEN slots. The
draft (:func:`~jaxrl_sym.runtime.speculative.rules.ngram_draft`) and the acceptance rule
(:func:`~jaxrl_sym.runtime.speculative.rules.accept`) are the symbolic runtime's, so with the same
seed both systems keep the same drafts; greedy output equals plain padded decoding.

Rows accept different numbers of drafts, so a row's write offset is its own:
:class:`RowKVCache` writes row b's entries at its slot ``P + n_b - 1`` (n_b: tokens emitted),
which is where a rejected draft's entry sits, so the next verify overwrites it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from jaxrl_sym.baselines.padded import left_pad_prompts
from jaxrl_sym.errors import InputError
from jaxrl_sym.generation import GenerationConfig, GenerationResult, select_tokens
from jaxrl_sym.models.traced import trace_forward
from jaxrl_sym.runtime.metrics import (
    CompileCounter,
    device_peak_bytes,
    executable_temp_bytes,
    tree_bytes,
)
from jaxrl_sym.runtime.speculative.rules import SpecLog, accept, ngram_draft


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class RowKVCache:
    """A MAX_LEN cache written at a per-row slot: k/v ``[B, L, Hkv, D]``, pos/seg ``[B, L]``."""

    k: jax.Array
    v: jax.Array
    pos: jax.Array
    seg: jax.Array

    @staticmethod
    def like(k: Any, v: Any, max_len: int) -> RowKVCache:
        b = k.shape[0]
        return RowKVCache(jnp.zeros((b, max_len, *k.shape[2:]), k.dtype),
                          jnp.zeros((b, max_len, *v.shape[2:]), v.dtype),
                          jnp.full((b, max_len), -1, jnp.int32), jnp.zeros((b, max_len), jnp.int32))

    def update(self, k_new: jax.Array, v_new: jax.Array, pos_new: jax.Array, seg_new: jax.Array,
               index: jax.Array | int | None) -> RowKVCache:
        """Row b's T_new entries at slots ``index[b] ..`` (a scalar index: every row's)."""
        if index is None:
            raise InputError("RowKVCache.update needs the slot index (cache_index=)")
        idx = jnp.broadcast_to(jnp.asarray(index, jnp.int32), self.pos.shape[:1])
        z = jnp.zeros((), jnp.int32)

        def put(buf, new, i):
            at = (i, *([z] * (buf.ndim - 1)))
            return lax.dynamic_update_slice(buf, new.astype(buf.dtype), at)

        row = jax.vmap(put)
        return RowKVCache(row(self.k, k_new, idx), row(self.v, v_new, idx),
                          row(self.pos, pos_new, idx), row(self.seg, seg_new, idx))


def padded_speculative_generate(model: nnx.Module, prompts: Sequence[np.ndarray],
                                cfg: GenerationConfig, *, speculate: int) -> GenerationResult:
    """Speculative generation on left-padded prompts and MAX_LEN caches (see the module doc).

    Stats as :func:`~jaxrl_sym.baselines.padded.padded_generate`'s plus the speculation report
    (:meth:`SpecLog.report`): acceptance rate overall and per row, draft seconds.
    """
    if isinstance(speculate, bool) or not isinstance(speculate, int) or speculate < 1:
        raise InputError(f"speculate={speculate!r}: an int >= 1 (the draft tokens per verify)")
    k = speculate
    log = SpecLog()
    with CompileCounter() as counter:
        batch = left_pad_prompts(model, prompts, cfg)
        b, p, n = batch.batch, batch.prompt_len, batch.steps
        max_len = p + n + k
        _, state = nnx.split(model)
        t0 = time.perf_counter()
        prefill, verify = _programs(model, state, batch, cfg, k, max_len)
        compile_seconds = time.perf_counter() - t0
        t0 = time.perf_counter()
        caches, tok0, lp0, lg0 = prefill(state, batch.tokens, batch.positions)
        toks = [[int(t)] for t in np.asarray(tok0)]
        lps = [[float(x)] for x in np.asarray(lp0)]
        lgs = [[x] for x in np.asarray(lg0)] if cfg.return_logits else None
        done = np.array([_ended(toks[i], batch.limits[i], cfg) for i in range(b)])
        verifies = 0
        while not done.all():
            t1 = time.perf_counter()
            tokens = np.stack([_draft(batch, i, toks[i], k) for i in range(b)])
            log.draft_seconds += time.perf_counter() - t1
            emitted = np.asarray([len(t) for t in toks], np.int32)
            positions = (batch.prompt_lens + emitted - 1)[:, None] + np.arange(k + 1)
            caches, *res = verify(state, caches, tokens, positions.astype(np.int32),
                                  (p + emitted - 1).astype(np.int32), emitted)
            verifies += 1
            _collect([np.asarray(x) for x in res], toks, lps, lgs, done, log, batch.limits, cfg,
                     k)
        run_seconds = time.perf_counter() - t0
        # held: weights and the MAX_LEN caches (allocated once), plus the verify's temporaries
        held = tree_bytes(state) + tree_bytes(caches) + executable_temp_bytes(verify)
    log.verifies[k] = verifies
    stats = {"xla_compiles": counter.count, "compile_seconds": compile_seconds,
             "run_seconds": run_seconds, "dispatches": 1 + verifies, "prompt_len": p,
             "peak_bytes": device_peak_bytes() or held, "accounted_bytes": held,
             "max_len": max_len, "generated_tokens": int(sum(len(t) for t in toks)),
             **log.report(b)}
    return GenerationResult([np.asarray(t, np.int32) for t in toks],
                            [np.asarray(x, np.float32) for x in lps],
                            None if lgs is None else [np.stack(x) for x in lgs], stats)


def _programs(model: nnx.Module, state: Any, batch: Any, cfg: GenerationConfig, k: int,
              max_len: int) -> tuple[Any, Any]:
    """The prefill and ``[B, K+1]`` verify programs, compiled ahead of time (as
    ``padded_generate``'s: ``run_seconds`` then counts the run alone)."""
    b, p = batch.batch, batch.prompt_len
    new_cache = lambda kk, vv: RowKVCache.like(kk, vv, max_len)
    prefill_fn, verify_fn = trace_forward(model, b, p), trace_forward(model, b, k + 1)
    row_ids = jnp.arange(b, dtype=jnp.int32)
    seed = jnp.uint32(cfg.seed)

    @jax.jit
    def prefill(state, tokens, positions):
        logits, caches = prefill_fn(state, tokens, positions, jnp.zeros_like(positions), None,
                                    new_cache=new_cache, cache_index=0)
        tok, lp = select_tokens(logits[:, -1], seed=seed, steps=jnp.zeros((b,), jnp.int32),
                                row_ids=row_ids, temperature=cfg.temperature)
        kept = logits[:, -1].astype(jnp.float32) if cfg.return_logits else jnp.zeros((0,))
        return caches, tok, lp, kept

    @jax.jit
    def verify(state, caches, tokens, positions, starts, index):
        logits, caches = verify_fn(state, tokens, positions, jnp.zeros_like(positions), caches,
                                   new_cache=new_cache, cache_index=starts)
        tok, lp, acc = accept(logits, tokens[:, 1:], seed=seed, row_ids=row_ids, index=index,
                              temperature=cfg.temperature)
        kept = logits.astype(jnp.float32) if cfg.return_logits else jnp.zeros((0,))
        return caches, tok, lp, acc, kept

    cache_shapes = jax.eval_shape(prefill, state, batch.tokens, batch.positions)[0]
    rows_k = jax.ShapeDtypeStruct((b, k + 1), jnp.int32)
    rows_1 = jax.ShapeDtypeStruct((b,), jnp.int32)
    return (prefill.lower(state, batch.tokens, batch.positions).compile(),
            verify.lower(state, cache_shapes, rows_k, rows_k, rows_1, rows_1).compile())


def _draft(batch: Any, i: int, row: list[int], k: int) -> np.ndarray:
    """Row i's verify input: its last token, then k drafts from its prompt + response."""
    ctx = np.concatenate([batch.tokens[i, batch.prompt_len - batch.prompt_lens[i]:], row])
    return np.asarray([ctx[-1], *ngram_draft(ctx, k)], np.int32)


def _ended(row: list[int], limit: int, cfg: GenerationConfig) -> bool:
    return row[-1] in cfg.eos_ids or len(row) >= limit


def _collect(res: list[np.ndarray], toks: list[list[int]], lps: list[list[float]],
             lgs: list[list[np.ndarray]] | None, done: np.ndarray, log: SpecLog,
             limits: np.ndarray, cfg: GenerationConfig, k: int) -> None:
    """Each live row keeps its accepted drafts and the target's token, up to EOS/limit."""
    tok, lp, acc, lg = res
    for i in np.nonzero(~done)[0]:
        log.proposed[i] = log.proposed.get(i, 0) + k
        log.accepted[i] = log.accepted.get(i, 0) + int(acc[i])
        for j in range(int(acc[i]) + 1):
            toks[i].append(int(tok[i, j]))
            lps[i].append(float(lp[i, j]))
            if lgs is not None:
                lgs[i].append(lg[i, j])
            if _ended(toks[i], int(limits[i]), cfg):
                done[i] = True
                break
