"""A model's jaxpr with calls inlined and static loops around ``attend`` unrolled: the tracer's
rules for the one interpreter (:mod:`jaxrl_sym.tracer.interpret`).

Real Flax models hide their layers behind higher-order primitives: ``nnx.jit``/``jax.jit``
(``pjit``), ``jax.checkpoint`` (``checkpoint``), ``custom_jvp``/``custom_vjp`` (``jax.nn.gelu``,
``silu``…), and — the standard way to keep compile time flat in deep models (``nnx.scan``,
MaxText) — ``lax.scan`` over stacked layer weights, or ``fori_loop`` over one shared block. Each
``attend`` call inside such a loop is a *different* attention store per iteration. Reading the
loop body once, as a call, gives one store instead of L and generates wrong tokens.

:func:`eval_jaxpr` evaluates a closed jaxpr through the one interpreter with the rules of
:func:`unfolding` — a hook for the library's attention primitive, rules beside ``scan``,
``while`` and ``cond``, and a default for call-like primitives — which together

* inlines every call-like primitive whose body contains ``attend`` or a static loop (others are
  bound unchanged, keeping their custom derivative rules and jit caching);
* unrolls every ``scan`` with a static trip count up to ``MAX_UNROLL`` (``fori_loop`` with
  Python-int bounds is a scan), with or without ``attend`` in its body: one attention call per
  iteration, numbered in execution order, and an MLP stack applied by a loop is no longer read as
  one layer;
* refuses, naming the user's source line, what cannot be unrolled: ``while_loop`` (dynamic trip
  count) or ``cond``/``switch`` around ``attend``, and a scan over the sequence length.

Two users, one set of rules: :func:`flatten` re-traces the model through it with the hook binding
``attend`` unchanged, so the tracer sees a flat program (one attention equation per layer); the
padded baseline runs it with a hook that reads and writes MAX_LEN caches, so the *unmodified*
model is the padded baseline.

Source lines survive re-tracing: the interpreter re-binds each equation inside JAX's
``user_context`` with the original traceback, so errors raised later (tracer rules) still name
the user's line.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jcore
from jax.extend.core.primitives import cond_p, scan_p, while_p

from jaxrl_sym.errors import UnsupportedPrimitiveError, source_line
from jaxrl_sym.ops.attention import attention_p
from jaxrl_sym.tracer.interpret import Interpreter, NotHandled, bind_eqn

ATTENTION = "sym_attention"
MAX_UNROLL = 1024
"""Longest static loop that is unrolled (layers; far above any real depth). Longer loops without
``attend`` are kept as loops (the tracer's rules then accept them only off the B/T axes)."""

AttendHook = Callable[[int, Any, list[Any]], Any]
"""``hook(index, eqn, invals) -> output``: ``index`` numbers attention calls in execution order."""


def _sub_jaxprs(params: dict[str, Any]) -> Iterator[jcore.Jaxpr]:
    for v in params.values():
        for j in v if isinstance(v, tuple | list) else (v,):
            if isinstance(j, jcore.ClosedJaxpr):
                yield j.jaxpr
            elif isinstance(j, jcore.Jaxpr):
                yield j


def contains_attend(jaxpr: jcore.Jaxpr) -> bool:
    """Whether ``attend`` occurs anywhere in ``jaxpr``, nested bodies included."""
    return any(e.primitive.name == ATTENTION or any(contains_attend(j)
                                                    for j in _sub_jaxprs(e.params))
               for e in jaxpr.eqns)


def _static_scan(eqn: Any) -> bool:
    length = eqn.params.get("length")
    return eqn.primitive.name == "scan" and isinstance(length, int) and length <= MAX_UNROLL


def needs_unfolding(jaxpr: jcore.Jaxpr) -> bool:
    """Whether ``jaxpr`` holds, at any depth, ``attend`` or a static scan (layers applied by a
    loop, with or without attention in the body: a loop body read once would apply one layer)."""
    return any(e.primitive.name == ATTENTION or _static_scan(e)
               or any(needs_unfolding(j) for j in _sub_jaxprs(e.params)) for e in jaxpr.eqns)


def attention_eqns(jaxpr: jcore.Jaxpr) -> list[Any]:
    """The attention equations of a flat jaxpr, in order."""
    return [e for e in jaxpr.eqns if e.primitive.name == ATTENTION]


def call_body(eqn: Any) -> jcore.ClosedJaxpr | None:
    """The body of a call-like primitive (jit, checkpoint, custom_jvp/vjp, closed_call); None
    for anything else — loops and conditionals are not calls: their bodies run many times or
    not at all (reading scan's body as a call once gave one store for L layers)."""
    if eqn.primitive.name in ("scan", "while", "cond"):
        return None
    for name in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        j = eqn.params.get(name)
        if isinstance(j, jcore.ClosedJaxpr):
            return j
        if isinstance(j, jcore.Jaxpr):
            return jcore.ClosedJaxpr(j, ())
    return None


def unfolding(on_attend: AttendHook) -> Interpreter:
    """The tracer's rules for the one interpreter (:mod:`jaxrl_sym.tracer.interpret`): each
    attention call goes to ``on_attend`` with its number in execution order, a static scan is
    unrolled, a call whose body holds ``attend`` or a static loop is inlined, and what cannot be
    unrolled around ``attend`` is refused. Everything else is bound unchanged."""
    count = itertools.count()

    def attend(eqn: Any, invals: list[Any], interp: Interpreter) -> list[Any]:
        del interp
        return [on_attend(next(count), eqn, invals)]

    return Interpreter({attention_p: attend, scan_p: _scan_rule, while_p: _refuse_rule,
                        cond_p: _refuse_rule}, default=_call_rule)


def eval_jaxpr(closed: jcore.ClosedJaxpr, args: Sequence[Any], on_attend: AttendHook
               ) -> list[Any]:
    """Evaluate ``closed`` on ``args`` (arrays or tracers); ``on_attend`` runs each attention."""
    return unfolding(on_attend).eval_jaxpr(closed, args)


def _scan_rule(eqn: Any, invals: list[Any], interp: Interpreter) -> Any:
    """Layers applied by a loop: one copy of the body per iteration (and a scan around
    ``attend`` that is not static is refused by :func:`_unroll_scan`)."""
    if _static_scan(eqn) or contains_attend_eqn(eqn):
        return _unroll_scan(eqn, invals, interp)
    return NotHandled


def _refuse_rule(eqn: Any, invals: list[Any], interp: Interpreter) -> Any:
    """``while_loop`` / ``cond`` around ``attend``: the store count is not known when traced."""
    del invals, interp
    if not contains_attend_eqn(eqn):
        return NotHandled
    what = ("a while_loop (its trip count is only known at run time)"
            if eqn.primitive is while_p else
            "lax.cond/switch (the branch is only known at run time)")
    raise UnsupportedPrimitiveError(
        f"attend is called inside {what} at {source_line(eqn)}: each attention call needs its "
        "own store, known when the model is traced. Loop over layers with a Python loop, "
        "lax.scan / nnx.scan, or fori_loop with Python-int bounds.")


def _call_rule(eqn: Any, invals: list[Any], interp: Interpreter) -> Any:
    """Any other primitive: a call around ``attend`` or a static loop is inlined (custom_vjp
    may prepend operands); others are left to bind, keeping their derivative rules and jit
    caching; ``attend`` inside a primitive that is not a call is refused."""
    body = call_body(eqn)
    if body is not None and any(needs_unfolding(j) for j in _sub_jaxprs(eqn.params)):
        n_in = len(body.jaxpr.invars)
        return interp.eval_jaxpr(body, invals[len(invals) - n_in:])
    if contains_attend_eqn(eqn):
        raise UnsupportedPrimitiveError(
            f"attend is called inside primitive '{eqn.primitive.name}' at {source_line(eqn)}, "
            "which the tracer cannot inline; call attend outside it.")
    return NotHandled


def _unroll_scan(eqn: Any, invals: list[Any], interp: Interpreter) -> list:
    p = eqn.params
    length = p["length"]
    if not isinstance(length, int) or length > MAX_UNROLL:
        raise UnsupportedPrimitiveError(
            f"lax.scan at {source_line(eqn)} calls attend over {length} iterations: only loops "
            f"with a static trip count up to {MAX_UNROLL} (layers) are unrolled; a scan over the "
            "sequence cannot contain attend.")
    n_c, n_carry = _scan_counts(p)
    consts, carry, xs = invals[:n_c], invals[n_c:n_c + n_carry], invals[n_c + n_carry:]
    body = p["jaxpr"] if isinstance(p["jaxpr"], jcore.ClosedJaxpr) else \
        jcore.ClosedJaxpr(p["jaxpr"], ())
    ys_at: dict[int, list[Any]] = {}
    for i in (reversed(range(length)) if p["reverse"] else range(length)):
        x_i = [lax.index_in_dim(x, i, 0, keepdims=False) for x in xs]
        outs = interp.eval_jaxpr(body, [*consts, *carry, *x_i])
        carry, ys_at[i] = outs[:n_carry], outs[n_carry:]
    y_avals = eqn.outvars[n_carry:]
    if length == 0:
        ys = [jnp.zeros(v.aval.shape, v.aval.dtype) for v in y_avals]
    else:
        ys = [jnp.stack([ys_at[i][k] for i in range(length)]) for k in range(len(y_avals))]
    return [*carry, *ys]


def _scan_counts(params: dict[str, Any]) -> tuple[int, int]:
    """(constants, carries) among a scan's operands: jax 0.11 describes the operands as a
    (consts, carry, xs) tuple ``ft_in``; earlier releases had ``num_consts``/``num_carry``."""
    if "ft_in" in params:
        consts, carry, _ = params["ft_in"].elts
        return len(consts.elts), len(carry.elts)
    return params["num_consts"], params["num_carry"]


def bind_attend(index: int, eqn: Any, invals: list[Any]) -> Any:
    """The identity hook: attention stays the library's primitive."""
    del index
    (out,) = bind_eqn(eqn, invals)
    return out


def flatten(closed: jcore.ClosedJaxpr) -> jcore.ClosedJaxpr:
    """``closed`` re-traced with loops around ``attend`` unrolled and their calls inlined.

    Works with symbolic shapes (the tracer's B, T). A jaxpr without such loops comes back with the
    same equations (calls without attention stay calls; the tracer inlines those itself).
    """
    if not any(e.primitive.name != ATTENTION and (_static_scan(e) or any(
            needs_unfolding(j) for j in _sub_jaxprs(e.params))) for e in closed.jaxpr.eqns):
        return closed
    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in closed.jaxpr.invars]
    return jax.make_jaxpr(lambda *a: eval_jaxpr(closed, a, bind_attend))(*avals)


def contains_attend_eqn(eqn: Any) -> bool:
    """Whether an equation is, or nests, an attention call."""
    return eqn.primitive.name == ATTENTION or any(contains_attend(j)
                                                  for j in _sub_jaxprs(eqn.params))
