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
enclosing program is traced) and evaluates it with the frozen base leaves, rewriting each
``dot_general`` whose right operand is a target (directly or through dtype conversions) and
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
from jax.extend import core as jcore

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
        flat_args = jax.tree_util.tree_leaves(args)
        out = _eval(closed, plan, leaves, list(base_leaves), adapters, flat_args, dtype)
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(shape), out)

    return call


def _cast(x: Any, dtype: Any) -> Any:
    floating = hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)
    return x.astype(dtype) if dtype is not None and floating and x.dtype != dtype else x


class _Target:
    """A value that is target ``k``'s kernel, converted to ``dtype``: what a use reads."""

    def __init__(self, k: int, dtype: Any) -> None:
        self.k, self.dtype = k, dtype


def _eval(closed: jcore.ClosedJaxpr, plan: LoraPlan, leaves: list[Any], base: list[Any],
          adapters: Sequence[Adapter], args: list[Any], dtype: Any) -> list[Any]:
    jaxpr = closed.jaxpr
    env: dict[Any, Any] = {}
    target: dict[Any, _Target] = {}
    which = {idx: k for k, idx in enumerate(plan.indices)}
    merged: dict[tuple[int, Any], Any] = {}

    def merged_weight(t: _Target) -> Any:
        """The merged kernel in the use's dtype, as ``merged_leaves`` forms it (once per use
        dtype: a target read by a transpose or a sub-program)."""
        key = (t.k, jnp.dtype(t.dtype))
        if key not in merged:
            w, ad = base[plan.indices[t.k]], adapters[t.k]
            delta = jnp.matmul(ad["a"].astype(jnp.float32), ad["b"].astype(jnp.float32),
                               precision=lax.Precision.HIGHEST)
            m = (w.astype(jnp.float32) + plan.scale * delta).astype(dtype or w.dtype)
            merged[key] = m.astype(t.dtype)
        return merged[key]

    def read(v: Any) -> Any:
        if isinstance(v, jcore.Literal):
            return v.val
        return merged_weight(target[v]) if v in target else env[v]

    for v, c in zip(jaxpr.constvars, closed.consts, strict=True):
        env[v] = c
    invars = jaxpr.invars
    for i, v in enumerate(invars[:len(leaves)]):
        env[v] = leaves[i]
        if i in which:
            target[v] = _Target(which[i], leaves[i].dtype)
    for v, x in zip(invars[len(leaves):], args, strict=True):
        env[v] = x
    for eqn in jaxpr.eqns:
        outs = _eqn(eqn, env, target, read, plan, adapters)
        if outs is None:
            continue
        for v, x in zip(eqn.outvars, outs, strict=True):
            env[v] = x
    return [read(v) for v in jaxpr.outvars]


def _eqn(eqn: Any, env: dict[Any, Any], target: dict[Any, _Target], read: Callable[[Any], Any],
         plan: LoraPlan, adapters: Sequence[Adapter]) -> list[Any] | None:
    """Evaluate one equation; None when it only re-typed a target (recorded, not computed)."""
    name = eqn.primitive.name
    ins = eqn.invars
    if name == "convert_element_type" and ins[0] in target:
        target[eqn.outvars[0]] = _Target(target[ins[0]].k, eqn.params["new_dtype"])
        env[eqn.outvars[0]] = lax.convert_element_type(env[ins[0]], eqn.params["new_dtype"])
        return None
    if name == "dot_general" and ins[1] in target and _kernel_product(eqn):
        t = target[ins[1]]
        x, w = read(ins[0]), env[ins[1]]
        return [_low_rank_product(eqn, x, w, adapters[t.k], plan.scale, t.dtype)]
    params = eqn.primitive.get_bind_params(eqn.params)  # as jax.core.eval_jaxpr binds
    with eqn.ctx.manager:
        ans = eqn.primitive.bind(*[read(v) for v in ins], **params)
    return list(ans) if eqn.primitive.multiple_results else [ans]


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
