"""Index expressions and the small sympy helpers every other module of the package shares.

This is the bottom layer: it knows nothing about symbol tables, proofs or generated code. A
:class:`Point` or :class:`Range` is a plain sympy expression (or a pair of them) over the
dimension symbols; the table (:mod:`.table`) parses and checks them, the prover (:mod:`.prover`)
reasons about them and :mod:`.codegen` prints them as integer Python.
"""

from __future__ import annotations

import keyword
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import sympy
from sympy.printing.precedence import PRECEDENCE
from sympy.printing.str import StrPrinter

from jaxrl_sym.errors import SymbolError

__all__ = [
    "PARSE_FUNCS",
    "RESERVED",
    "Hyp",
    "IndexExpr",
    "Point",
    "Range",
    "as_expr",
    "index_parts",
    "is_int",
    "num_den",
    "rel_hyps",
    "substitute",
    "validate_name",
]

# Function names accepted by the expression parser (both the paper's and JAX's spellings).
PARSE_FUNCS: Mapping[str, Callable[..., sympy.Expr]] = MappingProxyType(
    {
        "max": sympy.Max,
        "Max": sympy.Max,
        "min": sympy.Min,
        "Min": sympy.Min,
        "mod": sympy.Mod,
        "Mod": sympy.Mod,
        "floor": sympy.floor,
        "ceiling": sympy.ceiling,
        "ceil": sympy.ceiling,
        "floordiv": lambda a, b: sympy.floor(a / b),
        "abs": sympy.Abs,
        "Abs": sympy.Abs,
    }
)
# Names the generated code needs for itself; a dimension may not shadow them.
RESERVED = frozenset(PARSE_FUNCS) | {"True", "False", "None"}

Hyp = tuple[sympy.Expr, bool]  # (e, strict): e >= 0, or e > 0 when strict


# =========================================================================== small helpers


def is_int(v: object) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def validate_name(name: str) -> None:
    if (
        not isinstance(name, str)
        or not name.isidentifier()
        or keyword.iskeyword(name)
        or name.startswith("_")
        or name in RESERVED
    ):
        raise SymbolError(
            f"invalid dimension name {name!r}: use an identifier that is not a Python keyword, "
            f"does not start with '_' and is not one of {', '.join(sorted(RESERVED))}"
        )


def rel_hyps(rel: sympy.Basic) -> list[Hyp]:
    """A relation as ``e >= 0`` / ``e > 0`` facts (``!=`` says nothing usable: [])."""
    if rel is sympy.true:
        return []
    if rel is sympy.false:
        return [(sympy.Integer(-1), False)]
    d = rel.lhs - rel.rhs
    if isinstance(rel, sympy.GreaterThan):
        return [(d, False)]
    if isinstance(rel, sympy.StrictGreaterThan):
        return [(d, True)]
    if isinstance(rel, sympy.LessThan):
        return [(-d, False)]
    if isinstance(rel, sympy.StrictLessThan):
        return [(-d, True)]
    if isinstance(rel, sympy.Eq):
        return [(d, False), (-d, False)]
    return []


def num_den(x: sympy.Expr) -> tuple[sympy.Expr, sympy.Expr]:
    """``x`` as ``num/den`` with a positive denominator where it is a number."""
    num, den = sympy.fraction(sympy.together(x))
    if den.is_Number and den < 0:
        num, den = -num, -den
    return num, den


def as_expr(v: object, what: str) -> sympy.Expr:
    if is_int(v):
        return sympy.Integer(int(v))  # type: ignore[call-overload]
    if isinstance(v, sympy.Expr):
        return v
    raise SymbolError(f"{what} must be a sympy expression or an int, got {v!r}")


# =========================================================================== index expressions


class _IndexPrinter(StrPrinter):
    """Paper-style printing: ``max(0,t-w+1)``, ``t-(t mod b)``; no spaces except around mod."""

    def _print_Max(self, e: sympy.Max) -> str:
        return "max(" + ",".join(self._print(a) for a in e.args) + ")"

    def _print_Min(self, e: sympy.Min) -> str:
        return "min(" + ",".join(self._print(a) for a in e.args) + ")"

    def _print_Mod(self, e: sympy.Mod) -> str:
        a, m = (self.parenthesize(x, PRECEDENCE["Mul"]) for x in e.args)
        return f"({a}\x00{m})"


def _fmt(e: sympy.Expr) -> str:
    return _IndexPrinter().doprint(e).replace(" ", "").replace("\x00", " mod ")


@dataclass(frozen=True)
class Point:
    """A single index, e.g. ``t`` (same position) or ``t-1`` (the previous one)."""

    expr: sympy.Expr

    def __post_init__(self) -> None:
        object.__setattr__(self, "expr", as_expr(self.expr, "Point.expr"))

    def __str__(self) -> str:
        return _fmt(self.expr)


@dataclass(frozen=True)
class Range:
    """A half-open range ``[start, stop)``, e.g. ``max(0,t-w+1):t+1`` for a sliding window."""

    start: sympy.Expr
    stop: sympy.Expr

    def __post_init__(self) -> None:
        object.__setattr__(self, "start", as_expr(self.start, "Range.start"))
        object.__setattr__(self, "stop", as_expr(self.stop, "Range.stop"))

    def length(self) -> sympy.Expr:
        """``stop - start``, expanded (``Mod(t,b)+1`` for a block)."""
        return sympy.expand(self.stop - self.start)

    def __str__(self) -> str:
        return f"{_fmt(self.start)}:{_fmt(self.stop)}"


IndexExpr = Point | Range


def substitute(ix: IndexExpr, mapping: Mapping[str | sympy.Symbol, sympy.Expr | int]) -> IndexExpr:
    """Simultaneously replace symbols (by name or symbol) in an index expression."""
    subs = {}
    for k, v in mapping.items():
        key = sympy.Symbol(k, integer=True) if isinstance(k, str) else k
        subs[key] = as_expr(v, f"substitute() value for {k}")
    if isinstance(ix, Point):
        return Point(ix.expr.subs(subs, simultaneous=True))
    return Range(ix.start.subs(subs, simultaneous=True), ix.stop.subs(subs, simultaneous=True))


def index_parts(ix: IndexExpr) -> tuple[sympy.Expr, ...]:
    """The expressions an index is made of: ``(expr,)`` for a Point, ``(start, stop)``."""
    if isinstance(ix, Point):
        return (ix.expr,)
    if isinstance(ix, Range):
        return (ix.start, ix.stop)
    raise SymbolError(f"expected a Point or Range, got {ix!r}")
