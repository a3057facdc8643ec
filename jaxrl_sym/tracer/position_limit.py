"""How far a model can see: the first position its own index arithmetic sends outside a table.

Why: a model with learned positions (GPT-2's ``wpe``, OPT's offset table) reads them with a gather
into a fixed ``[N, d]`` table. Fed a position at or past the table's end, JAX's gather does not
fail: ``jnp.take`` fills NaN, ``mode="clip"`` repeats the last row. A request longer than the
model's context then generated token 0 with NaN log-probs and no error (found 2026-11-29 on the
zoo's GPT-2 at 10 + 40 tokens with a 32-position table); only the RL update's divergence guard
noticed, a step later. The model declares nothing, so the limit is read from its jaxpr.

How: the jaxpr is evaluated by the one interpreter (:mod:`jaxrl_sym.tracer.interpret`) with
numpy *probes* instead of arrays. The ``positions`` input is the probe ``0, 1, …, PROBE - 1`` (one
value per position; rows and time steps are independent, the tracer's rules guarantee it), and
every element-wise integer operation of it (``max(p, 0)``, ``p + 2``, ``jnp.take``'s wrap of
negative indices: ``select_n(p < 0, p, p + N)``) is computed exactly on those values. A gather
whose index is a probe, from a table whose indexed axis has a static extent ``N``, gives the first
position whose index falls outside ``[0, N)``. Anything the probe does not model (a value that
mixes in the tokens, a float path, an operation without a rule here) becomes opaque, and an
opaque index gives no limit: the check never refuses a request it cannot explain. Nothing is
compiled or run on a device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from jax.extend import core as jcore
from jax.extend.core import primitives

from jaxrl_sym.errors import InputError, source_line
from jaxrl_sym.tracer.flatten import call_body
from jaxrl_sym.tracer.interpret import Interpreter

PROBE = 1 << 20
"""Positions probed (0 … 1,048,575): past any context a model with a position table has."""


@dataclass(frozen=True)
class PositionLimit:
    """Positions ``0 … positions - 1`` index inside every table the model reads by position.

    ``table``: the first offending table's shape; ``source``: the model's line that gathers it."""

    positions: int
    table: tuple[int, ...]
    source: str

    def check(self, model: str, prompt_lens: Any, limits: Any) -> None:
        """Refuse a request in which some row would reach past the table: a row of prompt
        length L that may generate n tokens is fed positions up to L + n - 1 (its last token
        too, by the RL update's forward), so L + n must not exceed :attr:`positions`."""
        lens = np.asarray(prompt_lens, np.int64) + np.asarray(limits, np.int64)
        if lens.size == 0 or int(lens.max()) <= self.positions:
            return
        row = int(np.argmax(lens))
        length = int(np.asarray(prompt_lens)[row])
        limit = int(np.asarray(limits)[row])
        room = self.positions - length
        fix = (f"lower max_new_tokens to {room}" if room > 0 else
               f"shorten the prompt below {self.positions} tokens")
        raise InputError(
            f"row {row}: a {length}-token prompt with max_new_tokens {limit} would feed "
            f"position {length + limit - 1} to {model}, whose positions are read from a table "
            f"of {self.table[0]} (shape {list(self.table)}, {self.source}): positions past "
            f"{self.positions - 1} index outside it and give NaN or clamped logits without an "
            f"error. Keep prompt + max_new_tokens <= {self.positions} ({fix}), or use a model "
            "whose position table is longer.")


class _Opaque:
    """A value the probe does not model."""


OPAQUE = _Opaque()

# element-wise primitives on per-position values (numpy broadcasting does the rest)
_ELEMENTWISE: dict[str, Callable[..., np.ndarray]] = {
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "neg": np.negative,
    "max": np.maximum, "min": np.minimum, "abs": np.abs, "sign": np.sign,
    "lt": np.less, "le": np.less_equal, "gt": np.greater, "ge": np.greater_equal,
    "eq": np.equal, "ne": np.not_equal, "and": np.logical_and, "or": np.logical_or,
    "not": np.logical_not,
    "clamp": lambda lo, x, hi: np.minimum(np.maximum(x, lo), hi),
    "rem": np.fmod,  # lax.rem truncates toward zero, as fmod does
    "div": lambda a, b: np.trunc(np.true_divide(a, b)).astype(np.int64),
    "select_n": lambda which, *cases: (np.where(which, cases[1], cases[0]) if len(cases) == 2
                                       else np.choose(np.asarray(which, np.int64), cases)),
}
# operations that only add or drop unit axes of a per-position value
_SAME = frozenset({"broadcast_in_dim", "reshape", "squeeze", "expand_dims", "copy", "copy_p"})


def _value(x: Any) -> Any:
    """A probe, or a literal or scalar constant as a numpy value; anything else is opaque."""
    if isinstance(x, np.ndarray) and x.shape == (PROBE,):
        return x
    if isinstance(x, np.ndarray | np.generic | int | float | bool) and np.ndim(x) == 0:
        return np.asarray(x)
    return OPAQUE


def _rules(found: list[PositionLimit]) -> Interpreter:
    calls: list[str] = []  # the lines of the calls being evaluated, outermost first

    def where(eqn: Any) -> str:
        """The user's line: inside library internals (``jnp.take``'s jit), the call's."""
        src = source_line(eqn, installed=False)
        for outer in reversed(calls):
            if src.startswith("<unknown") or "/site-packages/jax/" in src:
                src = outer
        return src

    def gather(eqn: Any, invals: list[Any], interp: Interpreter) -> list[Any]:
        table, index = eqn.invars[0].aval.shape, invals[1]
        axes = eqn.params["dimension_numbers"].start_index_map
        if isinstance(index, np.ndarray) and len(axes) == 1 and \
                isinstance(table[axes[0]], int) and all(isinstance(d, int) for d in table):
            n = int(table[axes[0]])
            bad = np.flatnonzero((index < 0) | (index >= n))
            if bad.size and bad[0] > 0:  # position 0 out of range: not a position table
                found.append(PositionLimit(int(bad[0]), tuple(table), where(eqn)))
        return [OPAQUE] * len(eqn.outvars)

    def default(eqn: Any, invals: list[Any], interp: Interpreter) -> list[Any]:
        body = call_body(eqn)
        if body is not None:
            calls.append(where(eqn))
            try:
                n = len(body.jaxpr.invars)
                return interp.eval_jaxpr(body, [_value(v) for v in invals[-n:]] if n else [])
            finally:
                calls.pop()
        name = eqn.primitive.name
        args = [_value(v) for v in invals]
        if not all(isinstance(a, np.ndarray) for a in args) or \
                not any(a.ndim for a in args):  # nothing per-position: not this module's concern
            return [OPAQUE] * len(eqn.outvars)
        if name in _SAME and len(args) == 1:
            return [args[0]]
        if name == "convert_element_type" and np.issubdtype(np.dtype(eqn.params["new_dtype"]),
                                                            np.integer):
            return [np.trunc(args[0]).astype(np.int64)]
        if name == "convert_element_type" and eqn.params["new_dtype"] == np.bool_:
            return [args[0] != 0]
        fn = _ELEMENTWISE.get(name)
        return [fn(*args)] if fn is not None and len(eqn.outvars) == 1 else \
            [OPAQUE] * len(eqn.outvars)

    return Interpreter(rules={primitives.gather_p: gather}, default=default)


def position_limit(closed: jcore.ClosedJaxpr, positions_index: int) -> PositionLimit | None:
    """The tightest limit of ``closed``'s position tables (``positions_index``: which input is
    the positions), or None where no table is read by position (RoPE, ALiBi, no positions)."""
    found: list[PositionLimit] = []
    args: list[Any] = [OPAQUE] * len(closed.jaxpr.invars)
    args[positions_index] = np.arange(PROBE, dtype=np.int64)
    _rules(found).eval_jaxpr(jcore.ClosedJaxpr(closed.jaxpr, [_value(c) for c in closed.consts]),
                             args)
    return min(found, key=lambda f: f.positions, default=None)
