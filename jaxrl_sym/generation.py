"""What every generation system shares: the request, its validation, token selection, the result.

The symbolic runtime and both baselines (padded, per-shape) call the same
:func:`select_tokens`, so with the same seed they pick the same token whenever their logits agree;
the padded baseline is the oracle in tests.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_sym.errors import InputError


@dataclass(frozen=True)
class GenerationConfig:
    """How to generate.

    max_new_tokens: per-row limit (int for all rows, or one int per row). A row ends at its limit
      or after emitting ``eos_id``, whichever comes first.
    temperature: 0 means greedy (argmax); > 0 samples from softmax(logits / temperature) with a key
      derived from (seed, row index, step), identical in every system.
    max_len: optional cap on prompt + response length. The symbolic runtime sizes no buffer by it;
      it only validates. The padded baseline pads to it (default: longest prompt + limit).
    prefill_logits_bytes: the prompt is filled in chunks whose fp32 logits ``[rows, chunk,
      vocab]`` stay under this many bytes (see :meth:`prefill_chunk`); every system obeys it.
    """

    max_new_tokens: int | tuple[int, ...]
    eos_id: int | None = None
    temperature: float = 0.0
    seed: int = 0
    max_len: int | None = None
    return_logits: bool = False
    prefill_logits_bytes: int = 1 << 30

    def prefill_chunk(self, rows: int, prompt_len: int, vocab: int) -> int:
        """Prompt slots per prefill chunk: all of them when their logits fit
        ``prefill_logits_bytes``, else the most that do (at least 16).

        Why: a contract model returns logits at every position and XLA does not sink the
        last-position slice into the head's matmul, so a one-shot prefill of 128 prompts of 451
        tokens at Qwen's 151,936 words materialises 32.7 GiB of logits to read one column (on an
        80 GB H100 the padded RL step failed to compile; sym's peak doubled). Chunked prefill —
        what vLLM and other serving stacks do — keeps one chunk's logits alive at a time.
        """
        per_slot = 4 * rows * vocab
        if prompt_len * per_slot <= self.prefill_logits_bytes:
            return prompt_len
        return min(prompt_len, max(16, self.prefill_logits_bytes // per_slot))


@dataclass
class GenerationResult:
    """Per-row outputs (exact lengths, no padding) plus run statistics."""

    tokens: list[np.ndarray]
    logprobs: list[np.ndarray]
    logits: list[np.ndarray] | None = None
    stats: dict = field(default_factory=dict)


def row_limits(cfg: GenerationConfig, n_rows: int) -> np.ndarray:
    """Per-row max_new_tokens as an int array, validated."""
    lim = cfg.max_new_tokens
    arr = np.full(n_rows, lim, np.int64) if isinstance(lim, int) else np.asarray(lim, np.int64)
    if arr.shape != (n_rows,):
        raise InputError(
            f"max_new_tokens has {arr.size} entries for {n_rows} prompts; give one int or one "
            "per prompt"
        )
    bad = np.nonzero(arr < 1)[0]
    if bad.size:
        raise InputError(f"max_new_tokens[{bad[0]}] = {arr[bad[0]]}: every row must allow >= 1")
    return arr


def validate_prompts(
    prompts: Sequence[np.ndarray | Sequence[int]], vocab_size: int, cfg: GenerationConfig
) -> list[np.ndarray]:
    """Check prompts (non-empty 1-D integer token arrays inside the vocabulary) and limits."""
    if len(prompts) == 0:
        raise InputError("no prompts given: pass a non-empty list of 1-D token arrays")
    out = []
    limits = row_limits(cfg, len(prompts))
    for i, p in enumerate(prompts):
        a = np.asarray(p)
        if a.ndim != 1:
            raise InputError(f"prompt {i} has shape {a.shape}; each prompt must be 1-D tokens")
        if a.size == 0:
            raise InputError(f"prompt {i} is empty; every prompt needs at least one token")
        if not np.issubdtype(a.dtype, np.integer):
            raise InputError(
                f"prompt {i} has dtype {a.dtype}; token ids must be integers (e.g. np.int32)"
            )
        if a.min() < 0 or a.max() >= vocab_size:
            raise InputError(
                f"prompt {i} has token ids outside [0, {vocab_size}) (min {a.min()}, max {a.max()})"
            )
        if cfg.max_len is not None and a.size + int(limits[i]) > cfg.max_len:
            raise InputError(
                f"prompt {i} has {a.size} tokens; with max_new_tokens={int(limits[i])} it exceeds "
                f"max_len={cfg.max_len}. Shorten the prompt, lower max_new_tokens or raise max_len."
            )
        out.append(a.astype(np.int32))
    if cfg.eos_id is not None and not 0 <= cfg.eos_id < vocab_size:
        raise InputError(f"eos_id={cfg.eos_id} is outside the vocabulary [0, {vocab_size})")
    if cfg.temperature < 0:
        raise InputError(f"temperature={cfg.temperature} must be >= 0 (0 = greedy)")
    return out


def select_tokens(
    logits: jax.Array,
    *,
    seed: jax.Array,
    steps: jax.Array,
    row_ids: jax.Array,
    temperature: float,
) -> tuple[jax.Array, jax.Array]:
    """Pick the next token per row and its log-probability under the sampling distribution.

    logits [B, V] (any float dtype; computed in fp32), steps [B] int32 (index of the token being
    generated within its row's response), row_ids [B] int32 (the row's index in the request).
    temperature is static: 0 → argmax. Returns (tokens [B] int32, logprobs [B] float32).
    """
    x = logits.astype(jnp.float32)
    if temperature == 0.0:
        tok = jnp.argmax(x, axis=-1).astype(jnp.int32)
        lp = jax.nn.log_softmax(x, axis=-1)
    else:
        lp = jax.nn.log_softmax(x / temperature, axis=-1)

        def one(row_lp, step, row):
            key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), row), step)
            return jax.random.categorical(key, row_lp).astype(jnp.int32)

        tok = jax.vmap(one)(lp, steps, row_ids)
    return tok, jnp.take_along_axis(lp, tok[:, None], axis=-1)[:, 0]
