"""LoRA without merged weights: ``x @ W + scale · (x @ A) @ B`` wherever a targeted kernel only
feeds a matmul, found in the jaxpr of whatever function reads the leaves.

Why: :func:`~jaxrl_sym.weights.lora.merged_leaves` forms ``W + scale · A @ B`` for every target,
which any contract model then runs unchanged — but inside the update's gradient program that
costs, per target, the merged weight (kept for the backward's ``dx``), the ``A @ B`` product
and a full ``[in, out]`` gradient before it is reduced to ``dA`` / ``dB``. Compiled at Qwen2.5-
0.5B's shape (XLA's buffer assignment, ``bench/results/projection.md``) those are ~2 GB of the
update's temporaries. The low-rank path needs none of them: the base ``W`` is frozen (its
product needs no gradient), and ``dA``, ``dB`` come from ``[tokens, rank]`` intermediates.

How, for any model: :func:`lora_call` traces ``fn(leaves, *args)`` to a jaxpr (once, when the
enclosing program is traced) and evaluates it with the frozen base leaves through the tracer's
one interpreter (:mod:`jaxrl_sym.tracer.interpret`), LoRA being two rules beside the primitives
it changes, as JAX keeps a derivative rule beside each primitive. The rule for ``dot_general``
rewrites each one whose right operand is a target (directly or through dtype conversions) and
contracts the kernel's input axis with no batch axes — what ``nnx.Linear`` and every ``x @ W``
emit. Any other use of a target (a transpose, a sub-program, a left operand) gets the merged
weight, formed right there as ``merged_leaves`` forms it, so the result is always the merged
model's; only the bytes differ. The rewrite is exact at initialisation (``B = 0`` adds 0) and
equal to the merged model up to float rounding otherwise (tests: logits, gradients).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.core.primitives import convert_element_type_p, dot_general_p

from jaxrl_sym.tracer.interpret import Interpreter, NotHandled, bind_eqn
from jaxrl_sym.weights.lora import Adapter, LoraPlan

__all__ = ["lora_call"]


def lora_call(fn: Callable[..., Any], plan: LoraPlan, dtype: Any = None
              ) -> Callable[..., Any]:
    """``fn(leaves, *args)`` as ``g(base_leaves, adapters, *args)`` with the targets of
    ``plan`` carrying ``scale · A @ B`` (see the module docstring). ``dtype``: the compute dtype
    every floating leaf and adapter is cast to first (None: the base leaves' own), as
    ``merged_leaves(..., dtype)`` casts. Traceable and differentiable in ``adapters``."""

    def call(base_leaves: Sequence[Any], adapters: Sequence[Adapter], *args: Any) -> Any:
        leaves = [_cast(x, dtype) for x in base_leaves]
        closed, shape = jax.make_jaxpr(fn, return_shape=True)(leaves, *args)
        interp, concrete = _interpreter(plan, list(base_leaves), adapters, dtype)
        which = {idx: k for k, idx in enumerate(plan.indices)}
        ins = [_Target(which[i], x.dtype, x) if i in which else x for i, x in enumerate(leaves)]
        out = interp.eval_jaxpr(closed, [*ins, *jax.tree_util.tree_leaves(args)])
        out = [concrete(x) for x in out]
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(shape), out)

    return call


def _cast(x: Any, dtype: Any) -> Any:
    floating = hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)
    return x.astype(dtype) if dtype is not None and floating and x.dtype != dtype else x


class _Target:
    """A value that is target ``k``'s kernel converted to ``dtype``: what the interpreter's
    environment holds for it, so the rules can tell a kernel product from any other use."""

    def __init__(self, k: int, dtype: Any, value: Any) -> None:
        self.k, self.dtype, self.value = k, dtype, value


def _interpreter(plan: LoraPlan, base: list[Any], adapters: Sequence[Adapter], dtype: Any
                 ) -> tuple[Interpreter, Callable[[Any], Any]]:
    """The one interpreter (:mod:`jaxrl_sym.tracer.interpret`) with LoRA's rules beside
    ``convert_element_type`` (a re-typed target stays a target) and ``dot_general`` (a kernel
    product gets the low-rank term), and a default that gives every other use the merged
    weight; with the function that merges a value if it is a target."""
    merged: dict[tuple[int, Any], Any] = {}

    def concrete(x: Any) -> Any:
        """The merged kernel in the use's dtype, as ``merged_leaves`` forms it (once per use
        dtype: a target read by a transpose or a sub-program); any other value as it is."""
        if not isinstance(x, _Target):
            return x
        key = (x.k, jnp.dtype(x.dtype))
        if key not in merged:
            w, ad = base[plan.indices[x.k]], adapters[x.k]
            delta = jnp.matmul(ad["a"].astype(jnp.float32), ad["b"].astype(jnp.float32),
                               precision=lax.Precision.HIGHEST)
            m = (w.astype(jnp.float32) + plan.scale * delta).astype(dtype or w.dtype)
            merged[key] = m.astype(x.dtype)
        return merged[key]

    def convert(eqn: Any, invals: list[Any], interp: Interpreter) -> Any:
        (t,) = invals
        if not isinstance(t, _Target):
            return NotHandled
        new = eqn.params["new_dtype"]
        return [_Target(t.k, new, lax.convert_element_type(t.value, new))]

    def dot(eqn: Any, invals: list[Any], interp: Interpreter) -> Any:
        x, t = invals
        if not (isinstance(t, _Target) and _kernel_product(eqn)):
            return NotHandled
        return [_low_rank_product(eqn, concrete(x), t.value, adapters[t.k], plan.scale,
                                  t.dtype)]

    def other(eqn: Any, invals: list[Any], interp: Interpreter) -> list[Any]:
        return bind_eqn(eqn, [concrete(x) for x in invals])

    rules = {convert_element_type_p: convert, dot_general_p: dot}
    return Interpreter(rules, default=other), concrete


def _kernel_product(eqn: Any) -> bool:
    """``x @ W`` on a 2-D kernel: contracts W's input axis (0) with no batch axes."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    return (len(eqn.invars[1].aval.shape) == 2 and tuple(rc) == (0,) and len(lc) == 1
            and not lb and not rb)


def _low_rank_product(eqn: Any, x: Any, w: Any, ad: Adapter, scale: float, dt: Any) -> Any:
    """``x @ W + scale · (x @ A) @ B`` in the equation's own dimension numbers and output
    type; A and B in the kernel's dtype as the model reads it (``dt``)."""
    params = eqn.params
    (lc, _), _ = params["dimension_numbers"]
    kw = {"precision": params["precision"],
          "preferred_element_type": params["preferred_element_type"]}
    base = lax.dot_general(x, w, params["dimension_numbers"], **kw)
    xa = lax.dot_general(x, ad["a"].astype(dt), ((tuple(lc), (0,)), ((), ())), **kw)
    low = lax.dot_general(xa, ad["b"].astype(dt), (((xa.ndim - 1,), (0,)), ((), ())), **kw)
    return base + (scale * low).astype(base.dtype)
