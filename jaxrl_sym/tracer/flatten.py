"""One interpreter over a model's jaxpr: calls inlined, static loops around ``attend`` unrolled.

Real Flax models hide their layers behind higher-order primitives: ``nnx.jit``/``jax.jit``
(``pjit``), ``jax.checkpoint`` (``checkpoint``), ``custom_jvp``/``custom_vjp`` (``jax.nn.gelu``,
``silu``…), and — the standard way to keep compile time flat in deep models (``nnx.scan``,
MaxText) — ``lax.scan`` over stacked layer weights, or ``fori_loop`` over one shared block. Each
``attend`` call inside such a loop is a *different* attention store per iteration. Reading the
loop body once, as a call, gives one store instead of L and generates wrong tokens.

:func:`eval_jaxpr` evaluates a closed jaxpr equation by equation, with one hook for the library's
attention primitive, and

* inlines every call-like primitive whose body contains ``attend`` or a static loop (others are
  bound unchanged, keeping their custom derivative rules and jit caching);
* unrolls every ``scan`` with a static trip count up to ``MAX_UNROLL`` (``fori_loop`` with
  Python-int bounds is a scan), with or without ``attend`` in its body: one attention call per
  iteration, numbered in execution order, and an MLP stack applied by a loop is no longer read as
  one layer;
* refuses, naming the user's source line, what cannot be unrolled: ``while_loop`` (dynamic trip
  count) or ``cond``/``switch`` around ``attend``, and a scan over the sequence length.

Two users, one interpreter: :func:`flatten` re-traces the model through it with the hook binding
``attend`` unchanged, so the tracer sees a flat program (one attention equation per layer); the
padded baseline runs it with a hook that reads and writes MAX_LEN caches, so the *unmodified*
model is the padded baseline.

Source lines survive re-tracing: each equation is re-bound inside JAX's ``user_context`` with the
original traceback, so errors raised later (tracer rules) still name the user's line.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jcore

from jaxrl_sym.errors import UnsupportedPrimitiveError, source_line

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


@contextlib.contextmanager
def _user_frame(eqn: Any) -> Iterator[None]:
    """Re-bind under the equation's original traceback, as ``jax.core.eval_jaxpr`` does (private
    JAX API, used in one place)."""
    try:
        from jax._src import source_info_util
        ctx = source_info_util.user_context(
            eqn.source_info.traceback,
            name_stack=source_info_util.current_name_stack() + eqn.source_info.name_stack)
    except Exception:  # pragma: no cover - older/newer JAX without it: lose lines, not results
        ctx = contextlib.nullcontext()
    with ctx:
        yield


@dataclass
class _Counter:
    n: int = 0
    seen: list[Any] = field(default_factory=list)

    def next(self) -> int:
        self.n += 1
        return self.n - 1


def eval_jaxpr(closed: jcore.ClosedJaxpr, args: Sequence[Any], on_attend: AttendHook,
               _counter: _Counter | None = None) -> list[Any]:
    """Evaluate ``closed`` on ``args`` (arrays or tracers); ``on_attend`` runs each attention."""
    counter = _counter if _counter is not None else _Counter()
    jaxpr = closed.jaxpr
    env: dict[Any, Any] = {}

    def read(a: Any) -> Any:
        return a.val if isinstance(a, jcore.Literal) else env[a]

    for v, x in zip(jaxpr.constvars, closed.consts, strict=True):
        env[v] = x
    for v, x in zip(jaxpr.invars, args, strict=True):
        env[v] = x
    for eqn in jaxpr.eqns:
        invals = [read(a) for a in eqn.invars]
        with _user_frame(eqn):
            outs = _eval_eqn(eqn, invals, on_attend, counter)
        for v, x in zip(eqn.outvars, outs, strict=True):
            env[v] = x
    return [read(v) for v in jaxpr.outvars]


def _eval_eqn(eqn: Any, invals: list[Any], on_attend: AttendHook, counter: _Counter) -> list:
    name = eqn.primitive.name
    if name == ATTENTION:
        return [on_attend(counter.next(), eqn, invals)]
    has_attend = any(contains_attend(j) for j in _sub_jaxprs(eqn.params))
    if _static_scan(eqn):  # layers applied by a loop: one copy of the body per iteration
        return _unroll_scan(eqn, invals, on_attend, counter)
    body = call_body(eqn)
    if body is not None and any(needs_unfolding(j) for j in _sub_jaxprs(eqn.params)):
        n_in = len(body.jaxpr.invars)  # custom_vjp may prepend operands
        return eval_jaxpr(body, invals[len(invals) - n_in:], on_attend, counter)
    if has_attend:
        if name == "scan":
            return _unroll_scan(eqn, invals, on_attend, counter)  # raises: too long / over T
        if name in ("while", "cond"):
            what = ("a while_loop (its trip count is only known at run time)" if name == "while"
                    else "lax.cond/switch (the branch is only known at run time)")
            raise UnsupportedPrimitiveError(
                f"attend is called inside {what} at {source_line(eqn)}: each attention call "
                "needs its own store, known when the model is traced. Loop over layers with a "
                "Python loop, lax.scan / nnx.scan, or fori_loop with Python-int bounds.")
        raise UnsupportedPrimitiveError(
            f"attend is called inside primitive '{name}' at {source_line(eqn)}, which the tracer "
            "cannot inline; call attend outside it.")
    with eqn.ctx.manager:
        out = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
    return list(out) if eqn.primitive.multiple_results else [out]


def _unroll_scan(eqn: Any, invals: list[Any], on_attend: AttendHook, counter: _Counter) -> list:
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
        outs = eval_jaxpr(body, [*consts, *carry, *x_i], on_attend, counter)
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
    return eqn.primitive.bind(*invals, **eqn.params)


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
