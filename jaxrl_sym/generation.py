"""What every generation system shares: the request, its validation, token selection, the result.

The symbolic runtime and both baselines (padded, per-shape) call the same
:func:`select_tokens`, so with the same seed they pick the same token whenever their logits agree;
the padded baseline is the oracle in tests.

This module imports JAX only inside :func:`select_tokens`: the CLI validates a
:class:`GenerationConfig` (and maps seeds with :func:`seed32`) before paying JAX's import time,
so a bad flag fails in well under a second.
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from jaxrl_sym.errors import InputError

if TYPE_CHECKING:
    import jax

SEED_MASK = 0xFFFFFFFF


def seed32(seed: Any, name: str = "seed") -> int:
    """Map any Python or NumPy integer to the 32-bit seed every system uses: ``seed mod 2**32``.

    Why one rule: the symbolic runtime feeds the seed to a compiled program as a ``uint32``
    array, the baselines pass it as a static Python int; for values in ``[0, 2**32)`` both give
    the same ``jax.random.key``, outside it the runtime overflowed while the baselines accepted
    it. Taking the value modulo ``2**32`` (``seed & 0xFFFFFFFF``, two's complement for negative
    seeds, so ``-1 → 4294967295``) keeps every existing seed in that range unchanged and makes
    all others legal and identical across systems. Seeds that differ by a multiple of ``2**32``
    therefore sample the same tokens. Bools are refused (``True`` is almost always a mistake).
    """
    return as_int(seed, name) & SEED_MASK


def as_int(value: Any, name: str) -> int:
    """``value`` as a Python int if it is a Python or NumPy integer (not a bool), else
    :class:`InputError` naming ``name`` — NumPy scalars (``np.int64(5)``) come out of array
    arithmetic constantly and must behave like the ints they are."""
    if not isinstance(value, bool | np.bool_):
        try:
            return operator.index(value)  # int, np.integer, 0-d integer arrays; not floats
        except TypeError:
            pass
    raise InputError(f"{name}={value!r} ({type(value).__name__}): must be an integer")


def _int_at_least(value: Any, name: str, minimum: int = 1) -> int:
    v = as_int(value, name)
    if v < minimum:
        raise InputError(f"{name}={v}: must be >= {minimum}")
    return v


def _eos(value: Any) -> int | tuple[int, ...]:
    """``eos_id`` as one int >= 0 or a non-empty tuple of distinct ints >= 0."""
    if (isinstance(value, Sequence) and not isinstance(value, str | bytes)) or \
            (isinstance(value, np.ndarray) and value.ndim > 0):
        ids = tuple(_int_at_least(v, "eos_id", minimum=0) for v in value)
        if not ids:
            raise InputError("eos_id=(): give at least one id, or None for no EOS")
        if len(set(ids)) != len(ids):
            raise InputError(f"eos_id={ids}: an id is repeated")
        return ids
    return _int_at_least(value, "eos_id", minimum=0)


def _limits(value: Any) -> int | tuple[int, ...]:
    """``max_new_tokens`` as one int or a tuple of ints, each >= 1 (a row must allow a token)."""
    name = "max_new_tokens"
    if isinstance(value, str | bytes):
        raise InputError(f"{name}={value!r}: give one int for every row or one int per row")
    if isinstance(value, Sequence) or (isinstance(value, np.ndarray) and value.ndim > 0):
        if (isinstance(value, np.ndarray) and value.ndim != 1) or len(value) == 0:
            raise InputError(f"{name}={value!r}: give one int, or a non-empty 1-D sequence "
                             "with one int per row")
        return tuple(_int_at_least(v, f"{name}[{i}]") for i, v in enumerate(value))
    return _int_at_least(value, name)  # one limit for every row (floats and bools refused)


# The lowest sampling temperature: below it logits / temperature reach ~1e30 and the RL ratio
# exp(lp_new - lp_old) of two forwards that differ in the last bit overflows (vLLM clamps to
# the same 0.01 with a warning; here it is an error). 0 means greedy.
MIN_SAMPLING_TEMPERATURE = 0.01


def check_sampling_temperature(t: float, name: str = "temperature") -> None:
    """Refuse a temperature in (0, :data:`MIN_SAMPLING_TEMPERATURE`), naming ``name``."""
    if 0.0 < t < MIN_SAMPLING_TEMPERATURE:
        raise InputError(f"{name}={t:g}: sampling below {MIN_SAMPLING_TEMPERATURE} scales the "
                         "logits into float32 overflow (±inf log-probs); use 0 for greedy "
                         f"decoding or a temperature >= {MIN_SAMPLING_TEMPERATURE}")


def _temperature(value: Any) -> float:
    if isinstance(value, np.ndarray) and value.ndim == 0:
        value = value[()]
    if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Real):
        raise InputError(f"temperature={value!r} ({type(value).__name__}): must be a real number "
                         ">= 0 (0 = greedy)")
    t = float(value)
    if not math.isfinite(t) or t < 0:
        # NaN/inf used to reach softmax and come back as all-zero tokens with NaN log-probs.
        raise InputError(f"temperature={t}: must be finite and >= 0 (0 = greedy)")
    check_sampling_temperature(t)
    return t


@dataclass(frozen=True)
class GenerationConfig:
    """How to generate.

    max_new_tokens: per-row limit (int for all rows, or one int per row, each >= 1; NumPy
      integers are accepted and stored as Python ints, a sequence as a tuple). A row ends at its
      limit or after emitting ``eos_id``, whichever comes first.
    eos_id: token id that ends a row (an int >= 0; checked against the vocabulary at generation),
      several ids (a sequence: a row ends at the first of any of them — Llama 3 and Qwen
      instruct checkpoints have two or three) or None. :attr:`eos_ids` is always a tuple.
    temperature: 0 means greedy (argmax); > 0 samples from softmax(logits / temperature) with a key
      derived from (seed, row index, step), identical in every system. Must be finite.
    seed: any integer; stored as ``seed mod 2**32`` (see :func:`seed32`), the value every system
      keys its sampling with.
    max_len: optional cap on prompt + response length. The symbolic runtime sizes no buffer by it;
      it only validates. The padded baseline pads to it (default: longest prompt + limit).
    prefill_logits_bytes: the prompt is filled in chunks whose fp32 logits ``[rows, chunk,
      vocab]`` stay under this many bytes (see :meth:`prefill_chunk`); every system obeys it.
      The symbolic runtime's packed prefill chunks whole packed rows (at least one) and, where
      it finds the model's position-wise tail, computes logits at each prompt's last token
      only; its attention scores have a budget of their own
      (:data:`jaxrl_sym.runtime.prefill.SCORES_BYTES`), not this one.
    """

    max_new_tokens: int | tuple[int, ...]
    eos_id: int | tuple[int, ...] | None = None
    temperature: float = 0.0
    seed: int = 0
    max_len: int | None = None
    return_logits: bool = False
    prefill_logits_bytes: int = 1 << 30

    def __post_init__(self) -> None:
        """Check and normalise every field once, where the request is made.

        Why here and not in each system: a bad value used to surface late and differently per
        system (NaN temperature → zero tokens with NaN log-probs; ``seed=2**32`` → an
        ``OverflowError`` in the runtime while the padded baseline accepted it). After this,
        every system sees Python ints/floats in range: ``max_new_tokens`` an int or a tuple of
        ints >= 1, ``seed`` in ``[0, 2**32)`` (:func:`seed32`), ``temperature`` a finite float
        >= 0. Each error is an :class:`InputError` naming the field and its value.
        """
        put = lambda name, value: object.__setattr__(self, name, value)  # frozen dataclass
        put("max_new_tokens", _limits(self.max_new_tokens))
        put("temperature", _temperature(self.temperature))
        put("seed", seed32(self.seed))
        if self.eos_id is not None:
            put("eos_id", _eos(self.eos_id))
        if self.max_len is not None:
            put("max_len", _int_at_least(self.max_len, "max_len"))
        if not isinstance(self.return_logits, bool | np.bool_):
            raise InputError(f"return_logits={self.return_logits!r}: must be True or False")
        put("return_logits", bool(self.return_logits))
        put("prefill_logits_bytes",
            _int_at_least(self.prefill_logits_bytes, "prefill_logits_bytes"))

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """Every id that ends a row (empty: rows end at their limits only)."""
        if self.eos_id is None:
            return ()
        return self.eos_id if isinstance(self.eos_id, tuple) else (self.eos_id,)

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
    lim = cfg.max_new_tokens  # an int or a tuple of ints >= 1 (GenerationConfig.__post_init__)
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
    """Check prompts (non-empty 1-D integer token arrays inside the vocabulary) and limits.

    Any iterable of prompts is taken (a generator is read once, here); a string or a mapping is
    refused, naming what was given."""
    if isinstance(prompts, str | bytes | dict) or not hasattr(prompts, "__iter__") \
            or getattr(prompts, "ndim", 1) == 0:
        raise InputError(f"prompts: got {type(prompts).__name__}; pass a list of 1-D token "
                         "arrays (tokenize text first, e.g. with load_pretrained's tokenizer)")
    if not hasattr(prompts, "__len__"):
        prompts = list(prompts)
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
    for e in cfg.eos_ids:
        if not 0 <= e < vocab_size:
            raise InputError(f"eos_id={e} is outside the vocabulary [0, {vocab_size})")
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
    import jax  # here, not at module level: see the module docstring
    import jax.numpy as jnp

    x = logits.astype(jnp.float32)
    if temperature == 0.0:
        tok = jnp.argmax(x, axis=-1).astype(jnp.int32)
        lp = jax.nn.log_softmax(x, axis=-1)
    else:
        lp = jax.nn.log_softmax(x / temperature, axis=-1)
        # Inverse-CDF sampling: one uniform per row instead of categorical's V Gumbel draws.
        # Why: drawing V random numbers per row and step made sampling at temperature 1 take a
        # third of the CPU rollout (bench/results/cpu/design_notes.md), and at Qwen's 151,936
        # words it is 19M draws per decode step of 128 rows. Exact: token i is
        # picked iff cdf[i-1] <= u < cdf[i], probability p[i]; a zero-probability token spans an
        # empty interval, and u is scaled by the row's total so rounding never runs off the end.
        cdf = jnp.cumsum(jnp.exp(lp), axis=-1)

        def one(row_cdf, step, row):
            key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), row), step)
            u = jax.random.uniform(key, (), jnp.float32) * row_cdf[-1]
            return jnp.sum(row_cdf <= u, dtype=jnp.int32)

        last = lp.shape[-1] - 1 - jnp.argmax(jnp.flip(lp > -jnp.inf, axis=-1), axis=-1)
        tok = jnp.minimum(jax.vmap(one)(cdf, steps, row_ids), last).astype(jnp.int32)
    return tok, jnp.take_along_axis(lp, tok[:, None], axis=-1)[:, 0]
