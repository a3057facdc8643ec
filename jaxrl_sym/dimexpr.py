"""The one place that turns JAX symbolic dimensions into sympy expressions.

JAX represents a symbolic dimension as the private ``jax._src.export.shape_poly._DimExpr``: a sum
of ``(term, coefficient)`` pairs, each term a product of ``(factor, exponent)`` pairs, each factor
either a variable or an operation (``floordiv``, ``mod``, ``max``, ``min``) over nested
expressions. We walk that structure instead of parsing ``str(d)`` because the structure is exact
and its operations have documented semantics (floordiv/mod floor like Python, i.e. like sympy's
``floor``/``Mod``). Keeping the private import here means a JAX upgrade breaks one module; if the
private attributes ever disappear we fall back to parsing the printed form, which JAX keeps
parseable (it is what ``jax.export.symbolic_shape`` reads).
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable

import sympy
from jax._src.export import shape_poly as _shape_poly  # private; used in this module only

from jaxrl_sym.errors import SymbolError
from jaxrl_sym.symbols import SymbolTable

__all__ = ["is_symbolic", "shape_to_sympy", "to_sympy"]

_DimExpr = _shape_poly._DimExpr


def is_symbolic(d: object) -> bool:
    """True for a JAX symbolic dimension (anything that is not a plain int)."""
    return isinstance(d, _DimExpr)


def to_sympy(d: int | _DimExpr, table: SymbolTable) -> sympy.Expr:
    """Convert an int or a JAX symbolic dimension into a sympy expression over ``table``.

    Every dimension variable must be declared in ``table``: a shape mentioning an undeclared
    name means the model and the table disagree, which we report instead of inventing a symbol.
    """
    if isinstance(d, numbers.Integral) and not isinstance(d, bool):
        return sympy.Integer(int(d))
    if not isinstance(d, _DimExpr):
        raise SymbolError(
            f"expected an int or a JAX symbolic dimension, got {d!r} ({type(d).__name__})"
        )
    try:
        return _walk_expr(d, table, d)
    except AttributeError:  # pragma: no cover - only if JAX reshapes its private classes
        return _parse_str(d, table)


def shape_to_sympy(shape: Iterable[int | _DimExpr], table: SymbolTable) -> tuple[sympy.Expr, ...]:
    """:func:`to_sympy` over every dimension of a shape."""
    return tuple(to_sympy(d, table) for d in shape)


def _var(name: str, table: SymbolTable, whole: object) -> sympy.Symbol:
    if name not in table:
        raise SymbolError(
            f"symbolic dimension {name!r} (in {whole}) is not declared in the symbol table; "
            f"declared: {', '.join(table.names)}"
        )
    return table.sym(name)


def _walk_expr(e: _DimExpr, table: SymbolTable, whole: object) -> sympy.Expr:
    total: sympy.Expr = sympy.Integer(0)
    for term, coeff in e._sorted_terms:
        prod: sympy.Expr = sympy.Integer(int(coeff))
        for factor, exp in term._factors:
            prod = prod * _walk_factor(factor, table, whole) ** int(exp)
        total = total + prod
    return total


def _operand(o: object, table: SymbolTable, whole: object) -> sympy.Expr:
    if isinstance(o, _DimExpr):
        return _walk_expr(o, table, whole)
    if isinstance(o, numbers.Integral) and not isinstance(o, bool):
        return sympy.Integer(int(o))
    raise SymbolError(f"unexpected operand {o!r} in symbolic dimension {whole}")


def _walk_factor(f: object, table: SymbolTable, whole: object) -> sympy.Expr:
    var = f.var  # type: ignore[attr-defined]
    if var is not None:
        return _var(var, table, whole)
    op = f.operation  # type: ignore[attr-defined]
    args = [_operand(o, table, whole) for o in f.operands]  # type: ignore[attr-defined]
    if op == _shape_poly._DimFactor.FLOORDIV:
        a, b = args
        return sympy.floor(a / b)
    if op == _shape_poly._DimFactor.MOD:
        a, b = args
        return sympy.Mod(a, b)
    if op == _shape_poly._DimFactor.MAX:
        return sympy.Max(*args)
    if op == _shape_poly._DimFactor.MIN:
        return sympy.Min(*args)
    raise SymbolError(f"unsupported operation {op!r} in symbolic dimension {whole}")


def _parse_str(d: object, table: SymbolTable) -> sympy.Expr:
    """Fallback: parse JAX's printed form (``mod(T, 4)``, ``floordiv(T + 1, 2)``, ``T^2``).

    ``table.expr`` understands every operation JAX prints; only ``^`` (JAX's power) needs
    translating to ``**``. Unknown names are rejected there, naming the name.
    """
    text = str(d).replace("^", "**")
    return table.expr(text)
