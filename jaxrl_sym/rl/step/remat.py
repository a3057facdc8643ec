"""Recompute each layer in the update's backward: ``jax.checkpoint`` between attention calls.

Why: the update's gradient program keeps, for the backward, every activation of every layer —
at Qwen2.5-0.5B's shape mostly the MLP's ``[tokens, 4864]`` intermediates, the largest term of
the projected RL-step peak once attention recomputes its scores (XLA's buffer assignment:
``bench/results/projection.md``). Gradient checkpointing is what every trainer offers for this
(TRL's ``gradient_checkpointing``, verl's ``enable_gradient_checkpointing``, MaxText's
``remat_policy``): keep each layer's input, recompute the layer in the backward.

How, for any contract model: a model's only sequence mixing is ``attend``, so its function
(after the LoRA rewrite, :mod:`jaxrl_sym.weights.lora_apply`, whatever system built it: the
symbolic runtime's PDG interpreter or the padded model itself) is a chain of position-wise
segments joined by attention calls. :func:`remat_between_attention` traces the function to a
jaxpr, cuts it at every attention equation (:func:`segments`), and has the tracer's one
interpreter (:mod:`jaxrl_sym.tracer.interpret`) evaluate each segment between two cuts as its own
function under ``jax.checkpoint`` — a run of equations with a transformation, not another walk
over the jaxpr: the backward keeps only what crosses a cut (the residual stream, the next
attention's q/k/v — which attention's own rule keeps anyway — and the weights, which are alive
regardless) and recomputes the rest of the segment, one segment at a time, because a segment's
recomputation sits inside its own transposed checkpoint. Equations that manage their own
backward stay outside any segment: attention (its rule recomputes the scores from q/k/v),
custom-VJP calls (the Triton kernels, the head's product) and loops (the chunked log-prob scan
rematerialises its body already). The gradient program's per-layer temporaries fall by an
order of magnitude for about a quarter more update flops (``tests/test_remat.py`` checks the
fall on XLA's own buffer assignment; the numbers at Qwen2.5's width are in
``bench/results/projection.md``).

The values are the same computation in the same order (only when they are computed differs), so
losses and gradients equal the function's own to float rounding.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax

from jaxrl_sym.ops.attention import attention_p
from jaxrl_sym.tracer.interpret import Interpreter

__all__ = ["remat_between_attention", "segments"]

# equations that differentiate themselves: kept out of the checkpointed segments
_OWN_BACKWARD = frozenset({"custom_vjp_call", "scan", "while"})


def _cut(eqn: Any) -> bool:
    return eqn.primitive is attention_p or eqn.primitive.name in _OWN_BACKWARD


def segments(eqns: Sequence[Any]) -> list[tuple[int, int, bool]]:
    """``(start, stop, checkpointed)`` ranges covering ``eqns`` in order: each cut equation
    alone (not checkpointed), the runs between them checkpointed."""
    out: list[tuple[int, int, bool]] = []
    start = 0
    for i, eqn in enumerate(eqns):
        if _cut(eqn):
            if i > start:
                out.append((start, i, True))
            out.append((i, i + 1, False))
            start = i + 1
    if start < len(eqns):
        out.append((start, len(eqns), True))
    return out


def remat_between_attention(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with every segment between attention calls rematerialised in its backward (see
    the module docstring). Same arguments and result as ``fn``; traceable, differentiable."""

    def call(*args: Any) -> Any:
        closed, shape = jax.make_jaxpr(fn, return_shape=True)(*args)
        runs = [(a, b, jax.checkpoint if remat else None)
                for a, b, remat in segments(closed.jaxpr.eqns)]
        out = Interpreter().eval_jaxpr(closed, jax.tree_util.tree_leaves(args), runs=runs)
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(shape), out)

    return call
