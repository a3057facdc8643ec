"""The one jaxpr interpreter: equations evaluated in order over an environment, with rules beside
the primitives.

Why one: three features re-evaluate a traced program with a twist — the tracer unrolls the layer
loops around ``attend`` (:mod:`jaxrl_sym.tracer.flatten`), LoRA turns a matmul by a targeted
kernel into ``x @ W + scale · (x @ A) @ B`` (:mod:`jaxrl_sym.weights.lora_apply`), and remat
evaluates the runs between attention calls under ``jax.checkpoint``
(:mod:`jaxrl_sym.rl.step.remat`). Each used to walk the jaxpr with its own loop, and each loop
had its own way of reading literals, binding a primitive (``get_bind_params``, the equation's
``ctx``) and keeping the user's source line, so a fix in one was not a fix in the others. JAX
itself has one evaluator and keeps what differs per primitive in tables (``mlir`` lowerings,
``ad.primitive_jvps``); here likewise the twist is data handed to :class:`Interpreter`:

* ``rules``: a :data:`Rule` per primitive, ``rule(eqn, invals, interp) -> outvals`` or
  :data:`NotHandled` (then the default applies); ``interp`` lets a rule evaluate a sub-program
  with the same rules (an inlined call, an unrolled loop body);
* ``default``: the rule for equations whose primitive has none (or whose rule declined); when it
  declines too, the equation is bound as ``jax.core.eval_jaxpr`` binds it (:func:`bind_eqn`);
* ``runs``: ``(start, stop, wrap)`` ranges partitioning the equations; a run with a ``wrap`` is
  evaluated as its own function of the values it reads from before it, transformed by ``wrap``
  (remat passes ``jax.checkpoint``), its body by this same interpreter.

Every equation is evaluated inside JAX's ``user_context`` with its original traceback, so what a
re-traced program raises later (a tracer rule, a shape error) still names the user's line.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from jax.extend import core as jcore

__all__ = ["Interpreter", "NotHandled", "Rule", "Run", "bind_eqn", "user_frame"]


class _NotHandledType:
    """The type of :data:`NotHandled` (one instance)."""

    def __repr__(self) -> str:
        return "NotHandled"


NotHandled = _NotHandledType()
"""What a rule returns to leave an equation to the default (a rule for ``scan`` that only unrolls
static loops declines the others)."""

Rule = Callable[[Any, list[Any], "Interpreter"], "Sequence[Any] | _NotHandledType"]
"""``rule(eqn, invals, interp) -> outvals`` (one per ``eqn.outvars``) or :data:`NotHandled`."""

Run = tuple[int, int, Callable[[Callable[..., Any]], Callable[..., Any]] | None]
"""``(start, stop, wrap)``: equations ``start:stop``; ``wrap`` transforms them as one function
(``jax.checkpoint``), None evaluates them in place."""


def bind_eqn(eqn: Any, invals: Sequence[Any]) -> list[Any]:
    """``eqn``'s primitive bound on ``invals`` as ``jax.core.eval_jaxpr`` binds it: parameters
    through ``get_bind_params`` (sub-jaxprs back to what ``bind`` takes), under the equation's
    context manager; always a list of outputs."""
    params = eqn.primitive.get_bind_params(eqn.params)
    with eqn.ctx.manager:
        out = eqn.primitive.bind(*invals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


@contextlib.contextmanager
def user_frame(eqn: Any) -> Iterator[None]:
    """Evaluate under the equation's original traceback, as ``jax.core.eval_jaxpr`` does (private
    JAX API, used in this one place)."""
    try:
        from jax._src import source_info_util
        ctx = source_info_util.user_context(
            eqn.source_info.traceback,
            name_stack=source_info_util.current_name_stack() + eqn.source_info.name_stack)
    except Exception:  # pragma: no cover - older/newer JAX without it: lose lines, not results
        ctx = contextlib.nullcontext()
    with ctx:
        yield


def _read(env: Mapping[Any, Any], atom: Any) -> Any:
    return atom.val if isinstance(atom, jcore.Literal) else env[atom]


@dataclass(frozen=True)
class Interpreter:
    """Evaluates jaxprs, applying ``rules`` (keyed by primitive) and ``default`` (see the module
    docstring). Without either it is ``jax.core.eval_jaxpr``."""

    rules: Mapping[Any, Rule] = field(default_factory=dict)
    default: Rule | None = None

    def eval_jaxpr(self, closed: jcore.ClosedJaxpr, args: Sequence[Any],
                   runs: Sequence[Run] | None = None) -> list[Any]:
        """``closed`` on ``args`` (arrays, tracers or whatever the rules put in the
        environment); the outputs, one per ``closed.jaxpr.outvars``."""
        jaxpr = closed.jaxpr
        env: dict[Any, Any] = dict(zip(jaxpr.constvars, closed.consts, strict=True))
        env.update(zip(jaxpr.invars, args, strict=True))
        if runs is None:
            self.eval_eqns(jaxpr.eqns, env)
        else:
            self._eval_runs(jaxpr, runs, env)
        return [_read(env, v) for v in jaxpr.outvars]

    def eval_eqns(self, eqns: Sequence[Any], env: dict[Any, Any]) -> None:
        """Evaluate ``eqns`` in order, reading and writing ``env`` (variable → value)."""
        for eqn in eqns:
            outs = self.eval_eqn(eqn, [_read(env, v) for v in eqn.invars])
            env.update(zip(eqn.outvars, outs, strict=True))

    def eval_eqn(self, eqn: Any, invals: list[Any]) -> Sequence[Any]:
        """One equation: its primitive's rule, else the default, else :func:`bind_eqn`."""
        with user_frame(eqn):
            rule = self.rules.get(eqn.primitive)
            out = rule(eqn, invals, self) if rule is not None else NotHandled
            if out is NotHandled and self.default is not None:
                out = self.default(eqn, invals, self)
            return bind_eqn(eqn, invals) if out is NotHandled else out

    def _eval_runs(self, jaxpr: jcore.Jaxpr, runs: Sequence[Run], env: dict[Any, Any]) -> None:
        eqns = jaxpr.eqns
        stops = [0, *(b for _, b, _ in runs)]
        if any(a != s or b < a for (a, b, _), s in zip(runs, stops, strict=False)) or \
                stops[-1] != len(eqns):
            raise ValueError(f"runs {[r[:2] for r in runs]} do not partition the {len(eqns)} "
                             "equations in order")
        last = _last_reads(eqns, jaxpr.outvars)
        for start, stop, wrap in runs:
            run = eqns[start:stop]
            if wrap is None:
                self.eval_eqns(run, env)
                continue
            ins, outs = _boundary(run, last, stop)
            results = wrap(self._as_function(run, ins, outs))(*[env[v] for v in ins])
            env.update(zip(outs, results, strict=True))

    def _as_function(self, eqns: Sequence[Any], ins: list[Any], outs: list[Any]
                     ) -> Callable[..., list[Any]]:
        """``eqns`` as a function of the variables ``ins`` to the variables ``outs``."""

        def run(*xs: Any) -> list[Any]:
            local = dict(zip(ins, xs, strict=True))
            self.eval_eqns(eqns, local)
            return [local[v] for v in outs]

        return run


def _last_reads(eqns: Sequence[Any], outvars: Sequence[Any]) -> dict[Any, int]:
    """Each variable's last reader: an equation's index, ``len(eqns)`` if returned."""
    last: dict[Any, int] = {}
    for i, eqn in enumerate(eqns):
        last.update((v, i) for v in eqn.invars if not isinstance(v, jcore.Literal))
    last.update((v, len(eqns)) for v in outvars if not isinstance(v, jcore.Literal))
    return last


def _boundary(run: Sequence[Any], last: dict[Any, int], stop: int
              ) -> tuple[list[Any], list[Any]]:
    """(variables the run reads from before it, variables it defines that are read at or after
    ``stop``), each in first-use order."""
    defined = {v for eqn in run for v in eqn.outvars}
    ins: dict[Any, None] = {}
    for eqn in run:
        for v in eqn.invars:
            if not isinstance(v, jcore.Literal) and v not in defined:
                ins.setdefault(v)
    outs = [v for eqn in run for v in eqn.outvars if last.get(v, -1) >= stop]
    return list(ins), outs
