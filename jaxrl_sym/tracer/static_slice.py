"""Gathers that are static slices, traced back into slices.

Why: under symbolic shapes JAX's indexing cannot take a slice even along a static axis — its
static-slice path refuses any array with a symbolic extent — so ``x[..., : d // 2]`` (RoPE's
rotate-half, in every model we trace) reaches the tracer as a ``gather`` whose start index is a
constant. A gather's transpose is a ``scatter-add`` into zeros of the operand's shape, and in the
update's rematerialised backward XLA materialises those zeros as a copy per layer, scheduled in
the forward and alive until that layer's backward: one ``f32[T, heads × head_dim]`` buffer per
layer that the plain model (a ``slice``, transposed to a ``pad``) never holds. At Qwen2.5-0.5B's
shape and a 17,408-token packed row that was 24 × 62.4 MB = 1.5 GB of the update's temporaries
(``tests/test_update_residuals.py``; ``bench/results/projection/reasoning/README.md``).

:func:`as_slice` rewrites such an equation into the ``slice`` it is — the same values, the
same gradient (a pad and a scatter-add into zeros add the same numbers to zero) — when its start
indices are known while tracing: a literal, or a small value :func:`fold` computed from literals
(``jnp`` builds the index with ``broadcast_in_dim`` of a Python int).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.extend import core as jcore
from jax.extend.core import primitives as prims

from jaxrl_sym.tracer.interpret import bind_eqn

__all__ = ["as_slice", "fold"]

_FOLDED = frozenset({prims.broadcast_in_dim_p, prims.convert_element_type_p,
                     prims.concatenate_p, jax.lax.reshape_p})
"""Primitives :func:`fold` evaluates while tracing: what index arithmetic is built from."""
_SMALL = 64  # elements: an index vector, never data


def _value(atom: Any, known: Mapping[Any, np.ndarray]) -> np.ndarray | None:
    if isinstance(atom, jcore.Literal):
        return np.asarray(atom.val)
    return known.get(atom)


def _static(d: Any) -> bool:
    return isinstance(d, int | np.integer)


def fold(eqn: Any, known: dict[Any, np.ndarray]) -> None:
    """Record in ``known`` the value of ``eqn``'s output when it is small index arithmetic
    (:data:`_FOLDED`) over literals and values already known."""
    if eqn.primitive not in _FOLDED or len(eqn.outvars) != 1:
        return
    shape = eqn.outvars[0].aval.shape
    if not all(_static(d) for d in shape) or int(np.prod(shape)) > _SMALL:
        return
    args = [_value(a, known) for a in eqn.invars]
    if any(a is None for a in args):
        return
    with jax.ensure_compile_time_eval():  # the tracer may run inside an outer jit's trace
        known[eqn.outvars[0]] = np.asarray(bind_eqn(eqn, args)[0])


def as_slice(eqn: Any, known: Mapping[Any, np.ndarray]) -> Any | None:
    """``eqn`` as a ``slice`` equation when it is a gather of one in-bounds window at constant
    start indices (every operand axis kept, none collapsed or batched); else None."""
    if eqn.primitive is not prims.gather_p:
        return None
    operand, indices = eqn.invars
    start_at = _value(indices, known)
    dn, sizes = eqn.params["dimension_numbers"], eqn.params["slice_sizes"]
    rank = len(operand.aval.shape)
    if (start_at is None or dn.collapsed_slice_dims or dn.operand_batching_dims
            or tuple(dn.offset_dims) != tuple(range(rank))
            or start_at.shape != (len(dn.start_index_map),)):
        return None
    start, limit = [0] * rank, list(sizes)
    for ax, i in zip(dn.start_index_map, start_at.tolist(), strict=True):
        extent, n = operand.aval.shape[ax], sizes[ax]
        if not (_static(extent) and _static(n) and 0 <= i <= extent - n):
            return None  # out of bounds: the gather's mode decides, a slice cannot
        start[ax], limit[ax] = int(i), int(i) + int(n)
    return eqn.replace(primitive=prims.slice_p, invars=[operand],
                       params={"start_indices": tuple(start), "limit_indices": tuple(limit),
                               "strides": None})
