"""The per-shape JAX baseline: exact-size buffers by recompiling for every new length.

The decode step is ``jax.jit``-ed and fed :class:`ExactKVCache`s (one per attention call of the
unmodified model, kept outside it by :mod:`jaxrl_sym.models.traced`) whose length is the
exact number of tokens so far, so no step attends over empty slots, but every step has a new cache
shape and XLA compiles a new executable for it (``xla_compiles`` ≈ one per length). The Python
loop also checks on the host after every step whether all rows are done, so it stops as early as
possible; that sync and the per-step dispatch are part of its cost. Semantics and outputs match
:func:`jaxrl_sym.baselines.padded.padded_generate` exactly (same left-padded prefill, same
:func:`select_tokens` keys).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl_sym.baselines.padded import left_pad_prompts, row_lengths, trim_rows
from jaxrl_sym.generation import GenerationConfig, GenerationResult, select_tokens
from jaxrl_sym.models.cache import ExactKVCache
from jaxrl_sym.models.traced import TracedForward, trace_forward
from jaxrl_sym.runtime.metrics import (
    CompileCounter,
    MemoryMeter,
    device_peak_bytes,
    executable_temp_bytes,
    tree_bytes,
)

_RELEASE_EVERY = 128  # steps between releases of per-length executables


def _build_steps(
    prefill_fwd: TracedForward, decode_fwd: TracedForward, b: int, gen: GenerationConfig
) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """Jitted prefill and decode step; temperature and seed are static, as in the padded program.

    ``prefill_fwd`` / ``decode_fwd``: the model traced at [B, P] and [B, 1]. The decode step's jit
    retraces and recompiles for every new cache length: that is this baseline's cost.
    """
    temperature = float(gen.temperature)
    seed = int(gen.seed)

    def choose(logits_last: jax.Array, step: jax.Array):
        return select_tokens(
            logits_last,
            seed=seed,
            steps=jnp.full((b,), step, jnp.int32),
            row_ids=jnp.arange(b, dtype=jnp.int32),
            temperature=temperature,
        )

    @jax.jit
    def prefill(state, tokens, positions):
        logits, caches = prefill_fwd(state, tokens, positions, jnp.zeros_like(positions), None,
                                     new_cache=ExactKVCache.like)
        last = logits[:, -1]
        tok, lp = choose(last, jnp.int32(0))
        return caches, tok, lp, last

    @jax.jit
    def step(state, caches, prev, pos, step_idx):
        lg, caches = decode_fwd(state, prev[:, None], pos[:, None], jnp.zeros_like(pos)[:, None],
                                caches, new_cache=ExactKVCache.like)
        lg = lg[:, 0]
        tok, lp = choose(lg, step_idx)
        return caches, tok, lp, lg

    return prefill, step


class _Timed:
    """AOT-compiles through a jit (so its cache is shared) and runs, timing compile and run
    apart: the per-shape baseline's cost is its compiles, so they are reported on their own."""

    def __init__(self, trace_seconds: float) -> None:
        self.compile_seconds, self.run_seconds = trace_seconds, 0.0

    def __call__(self, jitted: Any, *args: Any) -> tuple[Any, Any]:
        t0 = time.perf_counter()
        compiled = jitted.lower(*args).compile()
        t1 = time.perf_counter()
        out = jax.block_until_ready(compiled(*args))
        self.run_seconds += time.perf_counter() - t1
        self.compile_seconds += t1 - t0
        return compiled, out


def _decode(step: Any, run: _Timed, meter: MemoryMeter, state: Any, batch: Any,
            first: tuple[Any, ...], params_bytes: int, cfg: GenerationConfig
            ) -> tuple[list[Any], list[Any], list[Any], int]:
    """The host loop: one step program per length until every row ended (a host sync per
    step decides it); returns the per-step tokens, log-probs, logits and the dispatch count."""
    caches, tok, lp, lg = first
    held_out: list[Any] = [tok, lp] + ([lg] if cfg.return_logits else [])
    toks, lps, lgs = [tok], [lp], [lg]
    tok_host = np.asarray(tok)
    done = np.zeros(batch.batch, bool)
    dispatches = 1
    for s in range(1, batch.steps + 1):
        done |= s >= batch.limits
        if cfg.eos_ids:
            done |= np.isin(tok_host, cfg.eos_ids)
        if done.all() or s == batch.steps:
            break
        if s % _RELEASE_EVERY == 0:
            # Lengths only grow, so no earlier executable is reused within this run. Release
            # them: XLA:CPU otherwise runs out of JIT code memory after several hundred
            # executables ("LLVM ERROR: Unable to allocate section memory", seen at 1024
            # tokens). Every length is still compiled exactly once.
            jax.clear_caches()
        pos = (batch.prompt_lens + s - 1).astype(np.int32)
        compiled, (new_caches, tok, lp, lg) = run(step, state, caches, tok, jax.device_put(pos),
                                                  np.int32(s))
        dispatches += 1
        held_out += [tok, lp] + ([lg] if cfg.return_logits else [])
        meter.observe(
            params_bytes + tree_bytes(caches) + tree_bytes(new_caches) + tree_bytes(held_out),
            executable_temp_bytes(compiled), step=s)
        caches = new_caches
        toks.append(tok)
        lps.append(lp)
        lgs.append(lg)
        t0 = time.perf_counter()
        tok_host = np.asarray(tok)  # the per-step host sync that decides early stopping
        run.run_seconds += time.perf_counter() - t0
    return toks, lps, lgs, dispatches


def pershape_generate(
    model: nnx.Module, prompts: Sequence[np.ndarray], cfg: GenerationConfig
) -> GenerationResult:
    """Generate one jitted step per token with exact-length caches (one compile per length).

    Same outputs as :func:`padded_generate`; stats: ``xla_compiles``, ``peak_bytes`` (max over
    steps of params + live caches + outputs held + that step's executable temporaries),
    ``compile_seconds``, ``run_seconds``, ``dispatches`` (one per executed step), ``decode_steps``.
    """
    with CompileCounter() as counter:
        batch = left_pad_prompts(model, prompts, cfg)
        b = batch.batch
        _, state = nnx.split(model)
        t0 = time.perf_counter()
        prefill, step = _build_steps(trace_forward(model, b, batch.prompt_len),
                                     trace_forward(model, b, 1), b, cfg)
        run = _Timed(time.perf_counter() - t0)
        params_bytes = tree_bytes(state)
        meter = MemoryMeter()
        tokens, positions = jax.device_put((batch.tokens, batch.positions))
        compiled, first = run(prefill, state, tokens, positions)
        caches, tok, lp, lg = first
        meter.observe(params_bytes + tree_bytes((tokens, positions, caches))
                      + tree_bytes([tok, lp] + ([lg] if cfg.return_logits else [])),
                      executable_temp_bytes(compiled), step=0)
        toks, lps, lgs, dispatches = _decode(step, run, meter, state, batch, first,
                                             params_bytes, cfg)
        tok_np = np.stack([np.asarray(t) for t in toks])
        lp_np = np.stack([np.asarray(x) for x in lps])
        lg_np = np.stack([np.asarray(x) for x in lgs]) if cfg.return_logits else None
    lengths = row_lengths(tok_np, batch.limits, cfg.eos_ids)
    out_toks, out_lps, out_lgs = trim_rows(tok_np, lp_np, lg_np, lengths)
    dev_peak = device_peak_bytes()
    stats = {
        "xla_compiles": counter.count, "compile_cache_hits": counter.cache_hits,
        "peak_bytes": dev_peak if dev_peak is not None else meter.peak,
        "accounted_bytes": meter.peak,
        "compile_seconds": run.compile_seconds,
        "run_seconds": run.run_seconds,
        "dispatches": dispatches,
        "prompt_len": batch.prompt_len,
        "decode_steps": len(toks),
    }
    return GenerationResult(out_toks, out_lps, out_lgs, stats)
