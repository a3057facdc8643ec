"""Per-primitive rules: may this equation run position by position (and row by row)?

The tracer labels every array axis whose extent is exactly ``T`` (sequence) or ``B`` (batch).
A rule receives the labels of the equation's inputs and outputs and raises if the primitive mixes
values across a labelled axis (a reduction over ``T``, a slice that shifts positions, a gather
along the sequence…). Only ``sym_attention`` may mix positions, and it does so through an edge
whose index expression the tracer knows.

Rules live in a table keyed by primitive name, the way JAX registers its own per-primitive rules;
a primitive with no rule is accepted only if it touches no labelled axis (then it is static, e.g.
weight preprocessing, and gets hoisted out of the decode loop).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import sympy

from jaxrl_sym.errors import NonCausalMixingError, UnsupportedPrimitiveError

Label = str | None  # "T", "B" or None


@dataclass(frozen=True)
class EqnView:
    """What a rule sees of one jaxpr equation (shapes already converted to sympy)."""

    prim: str
    params: dict[str, Any]
    in_shapes: tuple[tuple[sympy.Expr, ...], ...]
    in_labels: tuple[tuple[Label, ...], ...]
    out_shapes: tuple[tuple[sympy.Expr, ...], ...]
    out_labels: tuple[tuple[Label, ...], ...]
    in_literal: tuple[Any, ...]  # literal value per input, or None
    source: str

    def labelled(self, which: str = "in", i: int = 0) -> dict[int, str]:
        labels = self.in_labels[i] if which == "in" else self.out_labels[i]
        return {ax: lab for ax, lab in enumerate(labels) if lab is not None}

    def touches_labels(self) -> bool:
        return any(any(lab for lab in labs) for labs in (*self.in_labels, *self.out_labels))


_DIM_NAME = {"T": "sequence dimension T", "B": "batch dimension B"}


def _mix(view: EqnView, label: str, what: str) -> NonCausalMixingError:
    fix = (
        "Only jaxrl_sym.attend may combine positions; per-position work must keep T as its own "
        "axis." if label == "T" else "Rows of the batch must stay independent."
    )
    return NonCausalMixingError(
        f"primitive '{view.prim}' at {view.source} {what} along the {_DIM_NAME[label]}, which "
        f"cannot run incrementally. {fix}"
    )


Rule = Callable[[EqnView], None]


def _elementwise(view: EqnView) -> None:
    # jaxpr elementwise ops have equal ranks; since JAX 0.4.3x an operand axis of extent 1 may
    # broadcast implicitly. A labelled result axis may therefore come from a size-1 operand axis
    # (a value repeated over B/T), but never from a differently labelled one.
    out = view.out_labels[0]
    for labs, shp in zip(view.in_labels, view.in_shapes, strict=True):
        if not shp:
            continue
        for ax, (lab, dim) in enumerate(zip(labs, shp, strict=True)):
            if lab != out[ax] and not (lab is None and dim == 1):
                raise _mix(view, lab or out[ax],
                           f"broadcasts/misaligns (operand {shp} vs result {view.out_shapes[0]})")


def _axes_param(name: str, what: str) -> Rule:
    def rule(view: EqnView) -> None:
        axes = view.params.get(name, ())
        axes = (axes,) if isinstance(axes, int) else tuple(axes)
        for ax, lab in view.labelled("in", 0).items():
            if ax in axes:
                raise _mix(view, lab, what)

    return rule


def _broadcast_in_dim(view: EqnView) -> None:
    bdims = view.params["broadcast_dimensions"]
    out = view.out_labels[0]
    for ax, lab in view.labelled("in", 0).items():
        if out[bdims[ax]] != lab:
            raise _mix(view, lab, "moves")


def _reshape(view: EqnView) -> None:
    # A labelled axis survives a reshape only if it stays its own axis with the same static
    # stride structure in front of it (so element (b, t, …) keeps its meaning).
    ishape, oshape = view.in_shapes[0], view.out_shapes[0]
    olabels = view.out_labels[0]
    for ax, lab in view.labelled("in", 0).items():
        if lab not in olabels:
            raise _mix(view, lab, "merges or splits")
        oax = olabels.index(lab)
        before_in = sympy.Mul(*ishape[:ax])
        before_out = sympy.Mul(*oshape[:oax])
        if sympy.simplify(before_in - before_out) != 0:
            raise _mix(view, lab, "reorders (reshape changes what precedes the axis)")


def _dot_general(view: EqnView) -> None:
    (lc, rc), (lb, rb) = view.params["dimension_numbers"]
    for side, contract, batch in ((0, lc, lb), (1, rc, rb)):
        for ax, lab in view.labelled("in", side).items():
            if ax in contract:
                raise _mix(view, lab, "contracts (sums over)")
            if ax in batch:
                other = view.in_labels[1 - side][(rb if side == 0 else lb)[list(batch).index(ax)]]
                if other != lab:
                    raise _mix(view, lab, "pairs mismatched axes")


def _slice(view: EqnView) -> None:
    start, limit = view.params["start_indices"], view.params["limit_indices"]
    strides = view.params.get("strides") or (1,) * len(start)
    for ax, lab in view.labelled("in", 0).items():
        full = start[ax] == 0 and strides[ax] == 1
        full = full and sympy.simplify(sympy.sympify(limit[ax]) - view.in_shapes[0][ax]) == 0
        if not full:
            raise _mix(view, lab, "slices (shifts or drops positions)")


def _pad(view: EqnView) -> None:
    for ax, lab in view.labelled("in", 0).items():
        if tuple(view.params["padding_config"][ax]) != (0, 0, 0):
            raise _mix(view, lab, "pads")


def _gather(view: EqnView) -> None:
    # Fine if every labelled operand axis is either vmapped (a batching dim) or taken whole
    # without being indexed: that is how x[..., :d//2] appears under symbolic shapes.
    dn = view.params["dimension_numbers"]
    sizes = view.params["slice_sizes"]
    for ax, lab in view.labelled("in", 0).items():
        if ax in dn.operand_batching_dims:
            continue
        whole = sympy.simplify(sympy.sympify(sizes[ax]) - view.in_shapes[0][ax]) == 0
        if ax in dn.start_index_map or ax in dn.collapsed_slice_dims or not whole:
            raise _mix(view, lab, "gathers (indexes data at computed positions)")


def _dynamic_slice(view: EqnView) -> None:
    sizes = view.params.get("slice_sizes")
    for ax, lab in view.labelled("in", 0).items():
        start = view.in_literal[1 + ax] if len(view.in_literal) > 1 + ax else None
        size = None if sizes is None else sympy.sympify(sizes[ax])
        same = size is None or sympy.simplify(size - view.in_shapes[0][ax]) == 0
        if not (same and start == 0):
            raise _mix(view, lab, "slices at a run-time offset")


def _iota(view: EqnView) -> None:
    dim = view.params["dimension"]
    lab = view.out_labels[0][dim]
    if lab is not None:
        raise NonCausalMixingError(
            f"primitive 'iota' at {view.source} counts along the {_DIM_NAME[lab]}: positions "
            "derived from jnp.arange over the sequence are wrong for decode steps and packed "
            "sequences. Take positions as a model input (tokens, positions, segment_ids) instead."
        )


def _dim_as_value(view: EqnView) -> None:
    raise NonCausalMixingError(
        f"primitive 'dim_as_value' at {view.source} uses the symbolic extent "
        f"{view.params.get('dim')} as a value (e.g. x.shape[1] in arithmetic); the runtime "
        "executes chunks whose length differs from the sequence length. Pass it as an input."
    )


def _scan_like(view: EqnView) -> None:
    ax = view.params.get("axis", 0)
    lab = view.in_labels[0][ax]
    if lab == "T":
        raise UnsupportedPrimitiveError(
            f"primitive '{view.prim}' at {view.source} is a prefix scan over the sequence "
            "dimension T; the tracer does not incrementalise scans yet. Express the recurrence "
            "with jaxrl_sym.attend(…, Linear()) or keep the scan outside the model."
        )
    if lab == "B":
        raise _mix(view, lab, "scans")


def _stack(view: EqnView) -> None:
    # jnp.stack (RoPE on interleaved pairs, k/v packing): the new axis is not B or T, and every
    # operand must carry B/T on the axes the result keeps for them.
    ax = view.params["axis"]
    out = view.out_labels[0]
    for labs in view.in_labels:
        if (*labs[:ax], None, *labs[ax:]) != out:
            lab = next(lab for lab in (*labs, *out) if lab)
            raise _mix(view, lab, "stacks misaligned operands")


def _attention(view: EqnView) -> None:
    q, k = view.in_labels[0], view.in_labels[1]
    if q[:2] != ("B", "T") or k[:2] != ("B", "T"):
        raise NonCausalMixingError(
            f"sym_attention at {view.source}: q and k must be [B, T, heads, dim] over the traced "
            f"batch and sequence dimensions, got labels {q} and {k}"
        )


def _sample(view: EqnView) -> None:
    # sample_p (jaxrl_sym.ops.sampling): per row (and position), it reduces only the logits'
    # vocabulary axis; the seed, steps and row ids are per-row operands.
    labels = view.in_labels[0]
    if labels and labels[-1] is not None:
        raise _mix(view, labels[-1], "samples along (the vocabulary must be the last axis)")


ELEMENTWISE = frozenset(
    [
        "abs", "acos", "acosh", "add", "add_any", "and", "asin", "asinh", "atan", "atan2",
        "atanh", "bitcast_convert_type", "cbrt", "ceil", "clamp", "conj", "convert_element_type",
        "copy", "copy_p", "cos", "cosh", "digamma", "div", "eq", "erf", "erf_inv", "erfc", "exp",
        "exp2", "expm1", "floor", "ge", "gt", "igamma", "imag", "integer_pow", "is_finite", "le",
        "lgamma", "log", "log1p", "logistic", "lt", "max", "min", "mul", "ne", "neg", "nextafter",
        "not", "or", "population_count", "pow", "real", "reduce_precision", "rem", "round",
        "rsqrt", "select_n", "shift_left", "shift_right_arithmetic", "shift_right_logical",
        "sign", "sin", "sinh", "sqrt", "square", "stop_gradient", "sub", "tan", "tanh", "xor",
        "sharding_constraint", "optimization_barrier",
    ]
)

RULES: dict[str, Rule] = {name: _elementwise for name in ELEMENTWISE}
RULES.update(
    {
        "broadcast_in_dim": _broadcast_in_dim,
        "reshape": _reshape,
        "transpose": lambda view: None,
        "squeeze": _axes_param("dimensions", "squeezes"),
        "dot_general": _dot_general,
        "reduce_sum": _axes_param("axes", "reduces"),
        "reduce_max": _axes_param("axes", "reduces"),
        "reduce_min": _axes_param("axes", "reduces"),
        "reduce_prod": _axes_param("axes", "reduces"),
        "reduce_and": _axes_param("axes", "reduces"),
        "reduce_or": _axes_param("axes", "reduces"),
        "argmax": _axes_param("axes", "reduces"),
        "argmin": _axes_param("axes", "reduces"),
        "cumsum": _scan_like,
        "cumprod": _scan_like,
        "cummax": _scan_like,
        "cummin": _scan_like,
        "cumlogsumexp": _scan_like,
        "slice": _slice,
        "pad": _pad,
        "concatenate": _axes_param("dimension", "concatenates"),
        "split": _axes_param("axis", "splits"),
        "unstack": _axes_param("axis", "unstacks"),
        "stack": _stack,
        "rev": _axes_param("dimensions", "reverses"),
        "sort": _axes_param("dimension", "sorts"),
        "gather": _gather,
        "dynamic_slice": _dynamic_slice,
        "iota": _iota,
        "dim_as_value": _dim_as_value,
        "sym_attention": _attention,
        "sample": _sample,
    }
)


def check_equation(view: EqnView) -> None:
    """Apply the primitive's rule; reject unknown primitives that touch labelled axes."""
    rule = RULES.get(view.prim)
    if rule is not None:
        rule(view)
        return
    if view.touches_labels():
        labs = {lab for labs in (*view.in_labels, *view.out_labels) for lab in labs if lab}
        dims = " and ".join(_DIM_NAME[lab] for lab in sorted(labs, reverse=True))
        raise UnsupportedPrimitiveError(
            f"primitive '{view.prim}' at {view.source} acts on the {dims} and jaxrl_sym has no "
            f"rule for it. Rewrite that line with supported ops (elementwise, dot_general, "
            f"reshape, reductions over feature axes, jaxrl_sym.attend), or add a rule to "
            f"jaxrl_sym.tracer.rules.RULES."
        )
