"""Per-slot log-probs, entropies and values without a ``[tokens × vocab]`` logits array.

Why: at Qwen's 151,936-token vocabulary the fp32 logits of 16k token slots take ~10 GB, and the
loss's backward wants them (or their softmax) again — the memory blow-up RL users hit first.
Everything the RL loss reads from the logits is per slot
(:func:`~jaxrl_sym.rl.algorithms.losses.slot_terms`: the target's log-prob, the entropy, PPO's
linear value read-out), and the LM head is position-wise; so when a model exposes its final hidden
states and its head separately (the contract's optional ``features``/``head`` split,
:func:`jaxrl_sym.models.contract.check_features`), the head is applied to one chunk of slots at a
time inside a ``lax.scan`` whose body is rematerialised (``jax.checkpoint``): the forward keeps
only the ``[slots, D]`` hidden states and the per-slot terms, and the backward recomputes one
chunk's logits at a time.
Peak memory then grows with ``chunk × vocab``, not ``tokens × vocab``.

Chunks run along the sequence axis of the layout's ``[rows, L]`` slots (``chunk // rows``
positions of every row per chunk, at least one): rows stay whole, so a mesh that splits rows
over its data axes splits every chunk the same way. ``L`` is padded up to a whole number of
chunks with zero features, whose terms are computed and dropped.

Why no chunking over the vocabulary as well: it would bound memory by ``chunk × vocab_chunk``
instead of ``chunk × vocab`` — but a smaller token chunk bounds it just as well, without an
online log-sum-exp and a second scan (the benchmark, ``bench/experiments/logprob_memory.py``,
reports the peak and the time for several chunk sizes).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxrl_sym.rl.algorithms.losses import slot_terms, value_predictions
from jaxrl_sym.systems.forward import SplitForward


def chunk_positions(rows: int, chunk: int) -> int:
    """Positions of every row per chunk: ``chunk`` slots over ``rows`` rows, at least one."""
    return max(1, chunk // max(rows, 1))


def scan_slots(body: Callable[[jax.Array, dict[str, jax.Array]], dict[str, jax.Array]],
               feats: jax.Array, slots: dict[str, jax.Array], chunk: int
               ) -> dict[str, jax.Array]:
    """``body(features [R, c, D], slot arrays [R, c]) -> {name: [R, c]}`` over chunks of ``c``
    positions of ``feats [R, L, D]``; returns the per-slot outputs ``[R, L]``.

    ``body`` is rematerialised in the backward (``jax.checkpoint``), so what a chunk computes
    from its logits is never stored for more than one chunk at a time.
    """
    rows, length = feats.shape[:2]
    c = min(chunk_positions(rows, chunk), length)
    n = -(-length // c)
    pad = n * c - length

    def split(x: jax.Array) -> jax.Array:  # [R, L, ...] -> [n, R, c, ...]
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return jnp.moveaxis(x.reshape(rows, n, c, *x.shape[2:]), 1, 0)

    step = jax.checkpoint(body, prevent_cse=False)
    _, out = jax.lax.scan(lambda carry, xs: (carry, step(*xs)), None,
                          (split(feats), {k: split(v) for k, v in slots.items()}))
    return {k: jnp.moveaxis(v, 0, 1).reshape(rows, n * c)[:, :length] for k, v in out.items()}


def chunked_terms(fwd: SplitForward, leaves: list[jax.Array], inputs: tuple[jax.Array, ...],
                  targets: jax.Array | None, temperature: float, chunk: int, *,
                  value_head: dict[str, jax.Array] | None = None, entropy: bool = True,
                  logprobs: bool = True) -> dict[str, jax.Array]:
    """:func:`~jaxrl_sym.rl.algorithms.losses.slot_terms` of every slot, one chunk's logits at
    a time.

    ``logprobs=False`` (the value pass, ``targets`` None) computes only ``v``. The features are
    computed once for the whole batch, outside the scan.
    """
    feats = fwd.features(leaves, inputs)
    held = [x if i in fwd.head_leaves else jax.lax.stop_gradient(x)
            for i, x in enumerate(leaves)]

    def body(f: jax.Array, slot: dict[str, jax.Array]) -> dict[str, jax.Array]:
        logits = fwd.head(held, f)
        if not logprobs:
            return {"v": value_predictions(logits, value_head)}
        return slot_terms(logits, slot["targets"], temperature, value_head, entropy=entropy)

    return scan_slots(body, feats, {} if targets is None else {"targets": targets}, chunk)
