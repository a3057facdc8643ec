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
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core as jcore

from jaxrl_sym.rl.algorithms.losses import slot_terms, value_predictions

LogitsFn = Callable[[list[jax.Array], tuple[jax.Array, ...]], jax.Array]
"""``logits_fn(lm_leaves, layout_inputs) -> [rows, L, vocab]`` logits: one system's forward."""

FeaturesFn = Callable[[list[jax.Array], tuple[jax.Array, ...]], jax.Array]
"""``features_fn(lm_leaves, layout_inputs) -> [rows, L, D]`` final hidden states."""

HeadFn = Callable[[list[jax.Array], jax.Array], jax.Array]
"""``head_fn(lm_leaves, features [..., D]) -> logits [..., vocab]`` (position-wise)."""


@dataclass(frozen=True)
class SplitForward:
    """A system's forward as ``head(features(...))``, plus the whole-logits forward.

    Callable as a :data:`LogitsFn` (the unchunked path, unchanged), so code that wants logits
    keeps working; :func:`jaxrl_sym.rl.step.programs.build_fns` uses ``features``/``head`` when the
    config asks for chunks. ``head_leaves``: indices of the leaves ``head`` reads (the rest are
    kept out of the scan's gradient, see :func:`head_leaf_indices`).
    """

    logits: LogitsFn
    features: FeaturesFn
    head: HeadFn
    head_leaves: frozenset[int]

    def __call__(self, leaves: list[jax.Array], inputs: tuple[jax.Array, ...]) -> jax.Array:
        return self.logits(leaves, inputs)


@dataclass(frozen=True)
class LogitsOnly:
    """A system's forward that gives whole logits only, and why (``reason``, reported as the
    step's ``logprob_chunking`` stat: e.g. the model has no ``features``/``head``)."""

    logits: LogitsFn
    reason: str

    def __call__(self, leaves: list[jax.Array], inputs: tuple[jax.Array, ...]) -> jax.Array:
        return self.logits(leaves, inputs)


def chunking_status(forward: Any, chunk: int | None) -> str:
    """The ``logprob_chunking`` stat: ``on: N token slots per chunk`` or ``off: <why>``."""
    if chunk is None:
        return "off: RLConfig.logprob_chunk=None"
    if isinstance(forward, SplitForward):
        return f"on: {chunk} token slots per chunk"
    if isinstance(forward, LogitsOnly):
        return f"off: {forward.reason}"
    return "off: the system's forward gives whole logits only"


def head_leaf_indices(head: HeadFn, leaves: list[Any], dim: int, dtype: Any) -> frozenset[int]:
    """Which of ``leaves`` the head reads, from its jaxpr on abstract ``[1, 1, dim]`` features.

    Why it matters: the scan's backward keeps one gradient accumulator per differentiated value
    it closes over. Closing over every model leaf (the head is ``nnx.merge`` of all of them)
    would give the backward a zero-filled copy of the whole model; only the head's own leaves
    (the embedding or ``lm_head``) are let through, the rest enter under ``stop_gradient``.
    """
    specs = [jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)) for x in leaves]
    closed = jax.make_jaxpr(head)(specs, jax.ShapeDtypeStruct((1, 1, dim), dtype))
    used: set[Any] = set()
    for eqn in closed.jaxpr.eqns:
        used.update(v for v in eqn.invars if not isinstance(v, jcore.Literal))
    used.update(v for v in closed.jaxpr.outvars if not isinstance(v, jcore.Literal))
    return frozenset(i for i, v in enumerate(closed.jaxpr.invars[:len(leaves)]) if v in used)


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
