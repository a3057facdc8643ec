"""The sampling primitive: ``sample_p`` picks each row's next token from its logits.

Why a primitive: the generation loop's ``sample`` node (:mod:`jaxrl_sym.passes.generation`) is a
PDG node like any other, and like ``attend``'s node it carries the primitive the runtime binds.
Its operands beyond the logits — the seed, each row's response index and row id — exist only in
the runtime, so the PDG's node has one input and the runtime's sample handler binds ``sample_p``
with the rest (:func:`jaxrl_sym.runtime.evaluate.evaluate`); a program that samples
nothing (the packed forward) leaves the node out. Its rules are registered here as ``attend``'s
are in :mod:`jaxrl_sym.ops.attention` (implementation, abstract evaluation, lowering) and in
:data:`jaxrl_sym.tracer.rules.RULES` (it acts position by position, reducing only the
vocabulary axis).

The computation is :func:`jaxrl_sym.generation.select_tokens` (greedy at temperature 0, else
inverse-CDF sampling keyed by (seed, row, step)), which the baselines call directly: the same
tokens for the same key in every system.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import mlir

from jaxrl_sym.generation import select_tokens

sample_p = Primitive("sample")
"""Operands: logits ``[B, V]``, seed (uint32 scalar), steps ``[B]`` (each row's response index
of the token being sampled), row ids ``[B]``. Param: ``temperature`` (float, static). Results:
tokens ``[B]`` int32 and their log-probs ``[B]`` float32."""
sample_p.multiple_results = True


def _select(logits: jax.Array, seed: jax.Array, steps: jax.Array, row_ids: jax.Array, *,
            temperature: float) -> tuple[jax.Array, jax.Array]:
    return select_tokens(logits, seed=seed, steps=steps, row_ids=row_ids,
                         temperature=temperature)


def _impl(logits, seed, steps, row_ids, *, temperature: float):
    return jax.jit(_select, static_argnames="temperature")(logits, seed, steps, row_ids,
                                                           temperature=temperature)


def _abstract(logits, seed, steps, row_ids, *, temperature: float):
    rows = logits.shape[:-1]
    return (jax.core.ShapedArray(rows, jnp.int32), jax.core.ShapedArray(rows, jnp.float32))


sample_p.def_impl(_impl)
sample_p.def_abstract_eval(_abstract)
mlir.register_lowering(sample_p, mlir.lower_fun(_select, multiple_results=True))


def sample(logits: jax.Array, *, seed: jax.Array, steps: jax.Array, row_ids: jax.Array,
           temperature: float) -> tuple[jax.Array, jax.Array]:
    """Each row's next token and its log-probability (``sample_p``; see the module doc)."""
    tok, lp = sample_p.bind(logits, seed, steps, row_ids, temperature=float(temperature))
    return tok, lp
