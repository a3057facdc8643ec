"""A system's training forward, as the RL step's programs take it: whole logits, or the model's
final hidden states and its head apart (:class:`SplitForward`).

Why here, beside the systems: each system gives its forward in one of these shapes (its
``logits_fn``), and the step (:mod:`jaxrl_sym.rl.step.logprobs`) applies the head a chunk of
token slots at a time when it gets a :class:`SplitForward`; the types are the contract between
the two, so they live in the lower layer both read.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core as jcore

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
        return "off: ExecutionConfig.logprob_chunk=None"
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
