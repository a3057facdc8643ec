"""How an index reads along the free dimension, decided by proof: what storage planning asks.

Planning needs to *reason* about index expressions (how many keys does a query read at most?
does the read range move forward with ``t``?). These questions are answered here with the
table's hypotheses and the prover, never by looking at how an index is spelled.
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy

from jaxrl_sym.symbols.expressions import IndexExpr, Point, index_parts
from jaxrl_sym.symbols.prover import Prover, upper_bound
from jaxrl_sym.symbols.table import SymbolTable

__all__ = ["AccessSummary", "classify_access", "is_monotone"]


def is_monotone(table: SymbolTable, ix: IndexExpr, free: str) -> bool | None:
    """Do the index's bounds never move backwards as ``free`` advances (``ix(t+1) >= ix(t)``)?

    True/False/None with :meth:`SymbolTable.prove`'s meaning (False: a counterexample exists).
    """
    t = table.sym(free)
    answers = [table.prove(sympy.Ge(e.xreplace({t: t + 1}), e)) for e in index_parts(ix)]
    if any(a is False for a in answers):
        return False
    return True if all(answers) else None


@dataclass(frozen=True)
class AccessSummary:
    """How an edge reads its producer along ``free``; what the storage planner sizes buffers by.

    kind: ``point`` | ``prefix`` | ``window`` | ``block`` | ``general``.
    bound: the most elements read at once (None: grows with ``free``).
    lag: for points, ``free - index`` when that is a constant (0 for ``t``, 1 for ``t-1``).
    """

    kind: str
    bound: sympy.Expr | None
    lag: int | None


def classify_access(table: SymbolTable, ix: IndexExpr, free: str) -> AccessSummary:
    """Classify an index by proof, never by its spelling.

    With ``s = stop`` moving in lockstep with ``free`` (``stop - free`` constant) and
    ``L = max over free of (stop - start)``:

    * prefix: ``start == 0`` and L unbounded;
    * window: ``start == max(0, stop - L)`` -- the last L elements;
    * block: ``start == (s-1) - ((s-1) mod L)`` -- the aligned block of size L holding ``s-1``;
    * general otherwise (bound = L when it exists).

    L is computed with every upper limit on ``free`` dropped, so ``0:t+1`` is a prefix even
    when the table says ``t <= T - 1``.
    """
    t = table.sym(free)
    for e in index_parts(ix):
        table.check_symbols(e, "index")
    if isinstance(ix, Point):
        lag = sympy.expand(t - ix.expr)
        return AccessSummary("point", sympy.Integer(1), int(lag) if lag.is_Integer else None)
    hyps = table.hyps(relax=free)
    bound = upper_bound(hyps, ix.length(), t)
    prover = Prover(hyps)

    def same(a: sympy.Expr, b: sympy.Expr) -> bool:
        d = a - b
        return prover.entails(d) and prover.entails(-d)

    if sympy.expand(ix.stop - t).is_Integer:
        if bound is None:
            if same(ix.start, sympy.Integer(0)):
                return AccessSummary("prefix", None, None)
        else:
            if prover.entails(bound) and same(ix.start, sympy.Max(0, ix.stop - bound)):
                return AccessSummary("window", bound, None)
            last = ix.stop - 1
            if prover.entails(bound - 1) and same(ix.start, last - sympy.Mod(last, bound)):
                return AccessSummary("block", bound, None)
    return AccessSummary("general", bound, None)
