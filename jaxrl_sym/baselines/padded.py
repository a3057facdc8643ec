"""The padded/masked XLA baseline: how JAX RL fine-tuning libraries generate today.

Prompts are left-padded to the longest prompt P, the KV cache is preallocated at
MAX_LEN = max(cfg.max_len, P + max(limits)) slots, and one ahead-of-time compiled program runs the
prefill and a ``lax.scan`` over N = max(limits) decode steps. Every row runs all N steps (finished
rows keep decoding garbage that is trimmed on the host) and every step attends over all MAX_LEN
slots, the empty ones masked by position -1. That wasted compute and memory, paid for a single
compile, is what the symbolic runtime is measured against.

The model is any contract model, unmodified: ``model(tokens, positions, segment_ids) -> logits``.
Nothing is read from it but its traced program; :mod:`jaxrl_sym.models.traced` gives each of
its ``attend`` calls a MAX_LEN cache, shaped from that call's traced keys/values, outside the model.

The module also holds the padded forward used as the oracle for packed forwards and gradients:
:func:`padded_forward`, :func:`padded_token_logprobs`, :func:`padded_sequence_logprobs`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from jaxrl_sym.errors import InputError
from jaxrl_sym.generation import (
    GenerationConfig,
    GenerationResult,
    row_limits,
    select_tokens,
    validate_prompts,
)
from jaxrl_sym.models.cache import PaddedKVCache
from jaxrl_sym.models.traced import TracedForward, trace_forward, vocab_size
from jaxrl_sym.runtime.metrics import (
    CompileCounter,
    MemoryMeter,
    device_peak_bytes,
    executable_temp_bytes,
    tree_bytes,
)

# --------------------------------------------------------------------------- shared helpers


@dataclass(frozen=True)
class LeftPadded:
    """A prompt batch left-padded to its longest prompt (shared by both generation baselines).

    tokens / positions: [B, P] int32; pad slots hold token 0 at position -1 (masked), and a row of
    length p has positions 0..p-1 in its last p slots, so every row's last prompt token sits in
    slot P-1 and the first decode step writes slot P for every row.
    """

    tokens: np.ndarray
    positions: np.ndarray
    prompt_lens: np.ndarray
    limits: np.ndarray

    @property
    def batch(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def prompt_len(self) -> int:
        return int(self.tokens.shape[1])

    @property
    def steps(self) -> int:
        """N = max per-row limit: how many decode steps the batch needs at most."""
        return int(self.limits.max())


def left_pad_prompts(
    model: nnx.Module, prompts: Sequence[np.ndarray], cfg: GenerationConfig
) -> LeftPadded:
    """Validate prompts (raises :class:`InputError` naming the prompt) and left-pad them.

    The vocabulary the token ids are checked against is the last dimension of the model's traced
    logits.
    """
    rows = validate_prompts(prompts, vocab_size(model), cfg)
    limits = row_limits(cfg, len(rows)).astype(np.int32)
    lens = np.array([r.size for r in rows], np.int32)
    b, p = len(rows), int(lens.max())
    tokens = np.zeros((b, p), np.int32)
    positions = np.full((b, p), -1, np.int32)
    for i, r in enumerate(rows):
        tokens[i, p - r.size :] = r
        positions[i, p - r.size :] = np.arange(r.size, dtype=np.int32)
    return LeftPadded(tokens, positions, lens, limits)


def trim_rows(
    tokens: np.ndarray,
    logprobs: np.ndarray,
    logits: np.ndarray | None,
    lengths: np.ndarray,
) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray] | None]:
    """Per-row exact outputs from step-major [N, B, ...] arrays and per-row lengths."""
    b = tokens.shape[1]
    toks = [np.asarray(tokens[: lengths[i], i], np.int32) for i in range(b)]
    lps = [np.asarray(logprobs[: lengths[i], i], np.float32) for i in range(b)]
    lgs = None
    if logits is not None:
        lgs = [np.asarray(logits[: lengths[i], i], np.float32) for i in range(b)]
    return toks, lps, lgs


def row_lengths(tokens: np.ndarray, limits: np.ndarray,
                eos_ids: int | tuple[int, ...] | None) -> np.ndarray:
    """Response length per row: up to and including the first EOS, else its limit.

    tokens: [N, B] generated tokens (every row decoded for N >= its limit steps, or until all
    rows finished).
    """
    n, b = tokens.shape
    lengths = np.minimum(limits, n).astype(np.int64)
    ids = np.asarray(() if eos_ids is None else eos_ids, np.int64).reshape(-1)
    if ids.size:
        for i in range(b):
            hits = np.nonzero(np.isin(tokens[: lengths[i], i], ids))[0]
            if hits.size:
                lengths[i] = hits[0] + 1
    return lengths


# --------------------------------------------------------------------------- generation


def _fill_prompt(first: TracedForward, prefill: TracedForward, state: Any, tokens: jax.Array,
                 positions: jax.Array, c: int, new_cache: Callable[..., Any]
                 ) -> tuple[Any, jax.Array]:
    """The prompt's P slots into new MAX_LEN caches: ``first`` (its own width) from empty
    caches, then a scan of ``prefill`` chunks of ``c`` slots. Returns (caches, logits at slot
    P-1, every row's last prompt token under left padding)."""
    p = tokens.shape[1]
    f = int(first.jaxpr.in_avals[-1].shape[1])  # slots of the first chunk
    seg = jnp.zeros_like(positions)
    logits, caches = first(state, tokens[:, :f], positions[:, :f], seg[:, :f], None,
                           new_cache=new_cache, cache_index=0)
    if f == p:
        return caches, logits[:, -1]

    # the last slot's logits ride in the carry: stacked as the scan's output they would be a
    # [chunks, B, V] float32 buffer (2.18 GB at 128 rows x 451 slots / 16 x 151,936 words,
    # XLA:GPU's buffer assignment for H100) of which only the last row is read
    def fill(carry, start):
        caches, _ = carry
        sl = lambda x: lax.dynamic_slice_in_dim(x, start, c, axis=1)
        lg, caches = prefill(state, sl(tokens), sl(positions), sl(seg), caches,
                             new_cache=new_cache, cache_index=start)
        return (caches, lg[:, -1].astype(logits.dtype)), None

    (caches, last), _ = lax.scan(fill, (caches, logits[:, -1]),
                                 jnp.arange(f, p, c, dtype=jnp.int32))
    return caches, last


def _ended(tok: jax.Array, step: jax.Array, limits: jax.Array, eos: tuple[int, ...]
           ) -> jax.Array:
    """Rows whose token ``step`` ends them: their limit, or an EOS token."""
    hit = step + 1 >= limits
    for e in eos:
        hit = hit | (tok == e)
    return hit


def _build_program(
    prefill: TracedForward,
    decode: TracedForward,
    batch: LeftPadded,
    gen: GenerationConfig,
    max_len: int,
    head: TracedForward | None = None,
) -> Callable[..., Any]:
    """The single jitted prefill + scan-decode program (static: shapes, eos, temperature, seed).

    ``prefill`` / ``decode`` are the model traced at [B, C] and [B, 1]: the prompt's P slots are
    filled in chunks of C (one ``head`` chunk of P mod C slots first when C does not divide P,
    then a scan over the rest). The first chunk starts one empty MAX_LEN cache per attention call
    inside the program (so no eager op compiles a program of its own to build them) and the scans
    carry them; they are returned, as a decode loop's state.
    """
    b, p, n = batch.batch, batch.prompt_len, batch.steps
    c = int(prefill.jaxpr.in_avals[-1].shape[1])
    first = head if head is not None else prefill
    eos, want_logits = gen.eos_ids, gen.return_logits
    temperature, seed = float(gen.temperature), int(gen.seed)
    new_cache = lambda k, v: PaddedKVCache.like(k, v, max_len)

    def program(state, tokens, positions, prompt_lens, limits):
        row_ids = jnp.arange(b, dtype=jnp.int32)

        def choose(logits_last: jax.Array, step: jax.Array):
            steps = jnp.full((b,), step, jnp.int32)
            return select_tokens(
                logits_last, seed=seed, steps=steps, row_ids=row_ids, temperature=temperature
            )

        finished = lambda tok, step: _ended(tok, step, limits, eos)

        caches, last = _fill_prompt(first, prefill, state, tokens, positions, c, new_cache)
        tok0, lp0 = choose(last, jnp.int32(0))
        done0 = finished(tok0, jnp.int32(0))

        def body(carry, step):
            caches, prev, done, length = carry
            pos = (prompt_lens + step - 1)[:, None]
            lg, caches = decode(state, prev[:, None], pos, jnp.zeros_like(pos), caches,
                                new_cache=new_cache, cache_index=p + step - 1)
            lg = lg[:, 0]
            tok, lp = choose(lg, step)
            length = length + (~done).astype(jnp.int32)
            done = done | finished(tok, step)
            out = (tok, lp, lg) if want_logits else (tok, lp)
            return (caches, tok, done, length), out

        init = (caches, tok0, done0, jnp.ones((b,), jnp.int32))
        (caches, _, _, lengths), outs = lax.scan(body, init, jnp.arange(1, n, dtype=jnp.int32))
        toks = jnp.concatenate([tok0[None], outs[0]], axis=0)
        lps = jnp.concatenate([lp0[None], outs[1]], axis=0)
        result = {"tokens": toks, "logprobs": lps, "lengths": lengths}
        if want_logits:
            result["logits"] = jnp.concatenate([last[None], outs[2]], axis=0)
        return caches, result

    return jax.jit(program)


def padded_program(model: nnx.Module, batch: LeftPadded, cfg: GenerationConfig
                   ) -> Callable[..., Any]:
    """The jitted program :func:`padded_generate` runs for ``batch``, called as
    ``program(state, tokens, positions, prompt_lens, limits) -> (caches, outputs)``: the model
    traced at the prefill chunk and at one slot, MAX_LEN = max(max_len, P + N). Lowered with
    ``jax.ShapeDtypeStruct`` arguments it compiles without running (the generation ledger)."""
    b, p = batch.batch, batch.prompt_len
    max_len = max(cfg.max_len or 0, p + batch.steps)
    c = cfg.prefill_chunk(b, p, vocab_size(model))
    head = trace_forward(model, b, p % c) if p % c else None
    return _build_program(trace_forward(model, b, c), trace_forward(model, b, 1), batch, cfg,
                          max_len, head)


def padded_generate(
    model: nnx.Module, prompts: Sequence[np.ndarray], cfg: GenerationConfig
) -> GenerationResult:
    """Generate with left-padded prompts, a MAX_LEN cache and one compiled prefill+scan program.

    ``model`` is any contract model (``model(tokens, positions, segment_ids) -> logits``); it is
    traced at [B, C] and [B, 1] and its attention calls are given MAX_LEN caches from outside;
    the prompt is filled in chunks of C slots (:meth:`GenerationConfig.prefill_chunk`; one
    chunk at small vocabularies).

    Returns exact per-row outputs (trimmed on the host) and stats: ``xla_compiles`` (every compile
    during the call), ``peak_bytes``, ``compile_seconds``, ``run_seconds``, ``dispatches``, plus
    the padded geometry (``prompt_len``, ``max_len``, ``decode_steps``).
    """
    with CompileCounter() as counter:
        batch = left_pad_prompts(model, prompts, cfg)
        p, n = batch.prompt_len, batch.steps
        max_len = max(cfg.max_len or 0, p + n)  # the left-padded layout needs P + N slots
        _, state = nnx.split(model)
        inputs = jax.device_put(
            (batch.tokens, batch.positions, batch.prompt_lens, batch.limits)
        )

        t0 = time.perf_counter()
        # Tracing the model is part of building the program, as it is inside jit for any model.
        compiled = padded_program(model, batch, cfg).lower(state, *inputs).compile()
        compile_seconds = time.perf_counter() - t0

        meter = MemoryMeter()
        held_before = tree_bytes(state) + tree_bytes(inputs)
        t0 = time.perf_counter()
        caches, out = compiled(state, *inputs)
        out = jax.block_until_ready(out)
        run_seconds = time.perf_counter() - t0
        # The MAX_LEN caches are the program's outputs (it allocates them), held to the end.
        meter.observe(held_before + tree_bytes(caches) + tree_bytes(out),
                      executable_temp_bytes(compiled), step=0)
        del caches

        host = {k: np.asarray(v) for k, v in out.items()}
    toks, lps, lgs = trim_rows(host["tokens"], host["logprobs"], host.get("logits"),
                               host["lengths"])
    dev_peak = device_peak_bytes()
    stats = {
        "xla_compiles": counter.count, "compile_cache_hits": counter.cache_hits,
        "peak_bytes": dev_peak if dev_peak is not None else meter.peak,
        "accounted_bytes": meter.peak,
        "compile_seconds": compile_seconds,
        "run_seconds": run_seconds,
        "dispatches": 1,
        "prompt_len": p,
        "max_len": max_len,
        "decode_steps": n,
    }
    return GenerationResult(toks, lps, lgs if cfg.return_logits else None, stats)


# --------------------------------------------------------------------------- forward oracles


def padded_forward(model: nnx.Module, tokens: jax.Array, lengths: jax.Array) -> jax.Array:
    """Logits [B, T, V] of a right-padded batch (slots at or beyond a row's length: position -1).

    Pure JAX (no host conversion, no inner jit) so it can sit under ``nnx.grad`` / ``nnx.jit``
    as the gradient oracle.
    """
    tokens = jnp.asarray(tokens, jnp.int32)
    t = tokens.shape[1]
    idx = jnp.arange(t, dtype=jnp.int32)[None, :]
    positions = jnp.where(idx < jnp.asarray(lengths, jnp.int32)[:, None], idx, -1)
    return model(tokens, positions, jnp.zeros_like(positions))


def padded_token_logprobs(
    model: nnx.Module, tokens: jax.Array, lengths: jax.Array, temperature: float = 1.0
) -> jax.Array:
    """[B, T]: entry t is log p(tokens[t] | tokens[:t]) for 1 <= t < length, else 0.

    ``temperature`` scales the logits as :func:`select_tokens` does (0 means unscaled, the
    distribution greedy decoding reports log-probs under). Pure JAX, differentiable.
    """
    tokens = jnp.asarray(tokens, jnp.int32)
    logits = padded_forward(model, tokens, lengths)
    if temperature > 0:
        logits = logits / temperature
    lp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(lp, tokens[:, 1:, None], axis=-1)[..., 0]
    idx = jnp.arange(1, tokens.shape[1], dtype=jnp.int32)[None, :]
    picked = jnp.where(idx < jnp.asarray(lengths, jnp.int32)[:, None], picked, 0.0)
    return jnp.concatenate([jnp.zeros_like(picked[:, :1]), picked], axis=1)


def _check_tokens(kind: str, i: int, a: np.ndarray, vocab: int, *, allow_empty: bool) -> None:
    if a.ndim != 1:
        raise InputError(f"{kind} {i} has shape {a.shape}; each must be 1-D tokens")
    if a.size == 0 and not allow_empty:
        raise InputError(f"{kind} {i} is empty; it needs at least one token")
    if a.size and not np.issubdtype(a.dtype, np.integer):
        raise InputError(f"{kind} {i} has dtype {a.dtype}; token ids must be integers")
    if a.size and (a.min() < 0 or a.max() >= vocab):
        raise InputError(f"{kind} {i} has token ids outside [0, {vocab})")


def padded_sequence_logprobs(
    model: nnx.Module,
    prompts: Sequence[np.ndarray],
    responses: Sequence[np.ndarray],
    temperature: float = 1.0,
) -> list[np.ndarray]:
    """Per-row log-probs of each response token given its prompt (and earlier response tokens).

    One right-padded forward over prompt+response; the scoring oracle for generation outputs
    (pass ``temperature=cfg.temperature`` to reproduce the log-probs generation reports).
    """
    if len(prompts) != len(responses):
        raise InputError(f"{len(prompts)} prompts but {len(responses)} responses; pair them 1:1")
    if len(prompts) == 0:
        raise InputError("no prompts given: pass a non-empty list of 1-D token arrays")
    vocab = vocab_size(model)
    ps = [np.asarray(x) for x in prompts]
    rs = [np.asarray(x) for x in responses]
    for i, (pr, rr) in enumerate(zip(ps, rs, strict=True)):
        _check_tokens("prompt", i, pr, vocab, allow_empty=False)
        _check_tokens("response", i, rr, vocab, allow_empty=True)
    lens = np.array([pr.size + rr.size for pr, rr in zip(ps, rs, strict=True)], np.int32)
    tokens = np.zeros((len(ps), int(lens.max())), np.int32)
    for i, (pr, rr) in enumerate(zip(ps, rs, strict=True)):
        tokens[i, : lens[i]] = np.concatenate([pr, rr]).astype(np.int32)

    graphdef, state = nnx.split(model)

    @jax.jit
    def score(state, tokens, lens):
        return padded_token_logprobs(nnx.merge(graphdef, state), tokens, lens, temperature)

    lp = np.asarray(score(state, tokens, lens))
    return [
        lp[i, pr.size : pr.size + rr.size].astype(np.float32)
        for i, (pr, rr) in enumerate(zip(ps, rs, strict=True))
    ]
