"""Integer code generation: sympy expressions printed ONCE into plain Python, then ``exec``'d.

:func:`compile_int` / :func:`compile_numpy` print the expressions into plain Python source
(``%``, ``//``, ``max``, ``min``) and ``exec`` it, so the decode loop never touches a sympy
object. Python's ``//`` and ``%`` floor exactly like sympy's ``floor`` and ``Mod``, for every
sign, which is what makes the compiled code agree with sympy everywhere.

All this module needs of a symbol table is that it can parse an expression string
(:class:`ExprParser`), so the table can compile its own constraint checker without a cycle.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import Any, Protocol

import numpy as np
import sympy
from sympy.printing.printer import Printer

from jaxrl_sym.errors import SymbolError
from jaxrl_sym.symbols.expressions import (
    IndexExpr,
    Point,
    Range,
    as_expr,
    index_parts,
    num_den,
    validate_name,
)

__all__ = [
    "CompiledFn",
    "ExprParser",
    "build",
    "compile_index",
    "compile_int",
    "compile_numpy",
    "evaluate_index",
]


class CompiledFn(Protocol):
    """A generated function of int arguments; ``.source`` holds its Python source."""

    source: str
    args: tuple[str, ...]

    def __call__(self, *args: Any) -> tuple[Any, ...]: ...


class ExprParser(Protocol):
    """What code generation needs of a :class:`~jaxrl_sym.symbols.SymbolTable`: parsing
    expression strings such as ``"max(0, t - w + 1)"``."""

    def expr(self, text: str) -> sympy.Expr: ...


class _CodePrinter(Printer):
    """Prints sympy integer expressions as plain Python (or numpy) source.

    Every compound is parenthesised so Python precedence never matters. Modes: ``int`` (Python
    ints only; a rational anywhere outside floor/ceiling/Mod is an error), ``numpy`` (the same
    but ``max``/``min``/``abs`` vectorised) and ``exact`` (rationals as ``Fraction``; used for
    checking constraints and searching counterexamples, never on a hot path).
    """

    printmethod = "_jaxrl_sym_code"

    def __init__(self, mode: str, names: Mapping[str, str]) -> None:
        super().__init__()
        self._mode = mode
        self._names = names

    def emptyPrinter(self, expr: Any) -> str:
        raise SymbolError(
            f"cannot compile {expr} ({type(expr).__name__}) to integer code; supported: + - * "
            "**n, floor, ceiling, Mod, Max, Min, Abs and comparisons"
        )

    def _p(self, e: Any) -> str:
        return self._print(e)

    def _print_Symbol(self, e: sympy.Symbol) -> str:
        name = self._names.get(e.name)
        if name is None:
            raise SymbolError(
                f"expression uses {e.name!r}, which is not among the arguments "
                f"({', '.join(self._names) or 'none'})"
            )
        return name

    def _print_Integer(self, e: sympy.Integer) -> str:
        v = int(e)
        return str(v) if v >= 0 else f"({v})"

    def _print_Rational(self, e: sympy.Rational) -> str:
        if self._mode == "exact":
            return f"_F({int(e.p)}, {int(e.q)})"
        raise SymbolError(
            f"rational {e} in integer code: the expression is not integer arithmetic; "
            "use floor(a/b) (a // b) or Mod for division"
        )

    def _print_Add(self, e: sympy.Add) -> str:
        first, *rest = e.args
        out = self._p(first)
        for a in rest:  # "t - w", not "t + (-w)": one bytecode op fewer per term
            out += f" - {self._p(-a)}" if a.could_extract_minus_sign() else f" + {self._p(a)}"
        return f"({out})"

    def _print_Mul(self, e: sympy.Mul) -> str:
        coeff, rest = e.as_coeff_Mul()
        if coeff == -1:
            return f"(-{self._p(rest)})"
        return "(" + " * ".join(self._p(a) for a in e.args) + ")"

    def _print_Pow(self, e: sympy.Pow) -> str:
        if e.exp.is_Integer and int(e.exp) > 0:
            return f"({self._p(e.base)} ** {int(e.exp)})"
        if e.exp.is_Integer and self._mode == "exact":
            return f"(_F(1) / ({self._p(e.base)} ** {-int(e.exp)}))"
        raise SymbolError(f"power {e} in integer code: only positive integer exponents")

    def _print_Mod(self, e: sympy.Mod) -> str:
        a, m = e.args
        return f"({self._p(a)} % {self._p(m)})"

    def _print_floor(self, e: sympy.floor) -> str:
        num, den = num_den(e.args[0])
        if den == 1:
            return self._p(num)
        return f"({self._p(num)} // {self._p(den)})"

    def _print_ceiling(self, e: sympy.ceiling) -> str:
        num, den = num_den(e.args[0])
        if den == 1:
            return self._p(num)
        return f"(-({self._p(-num)} // {self._p(den)}))"

    def _minmax(self, e: sympy.Basic, py: str, vec: str) -> str:
        args = [self._p(a) for a in e.args]
        if self._mode != "numpy":
            return f"{py}({', '.join(args)})"
        out = args[-1]
        for a in reversed(args[:-1]):
            out = f"{vec}({a}, {out})"
        return out

    def _print_Max(self, e: sympy.Max) -> str:
        return self._minmax(e, "max", "_np.maximum")

    def _print_Min(self, e: sympy.Min) -> str:
        return self._minmax(e, "min", "_np.minimum")

    def _print_Abs(self, e: sympy.Abs) -> str:
        return f"{'_np.abs' if self._mode == 'numpy' else 'abs'}({self._p(e.args[0])})"

    def _print_Relational(self, e: sympy.Rel) -> str:
        return f"({self._p(e.lhs)} {e.rel_op} {self._p(e.rhs)})"

    def _print_BooleanTrue(self, e: Any) -> str:
        return "True"

    def _print_BooleanFalse(self, e: Any) -> str:
        return "False"


def _bad_dtype(dtype: Any) -> None:
    raise SymbolError(f"compiled numpy index code needs integer arrays, got dtype {dtype}")


def _numpy_prologue(args: Sequence[str]) -> list[str]:
    """Source lines that set ``_z``: a zero of the arguments' broadcast shape and int dtype."""
    if not args:
        lines = ["    _z = _np.zeros((), dtype=_np.int64)"]
    else:
        sig = ", ".join(args)
        # Python ints are left as they are: they stay "weak" (NEP 50), so int32 rows
        # combined with a Python-int window size stay int32.
        lines = []
        for a in args:
            lines.append(f"    if isinstance({a}, (list, tuple)):")
            lines.append(f"        {a} = _np.asarray({a})")
        lines.append(f"    _dt = _np.result_type({sig})")
        shapes = ", ".join(f"_np.shape({a})" for a in args)
        lines.append(f"    _z = _np.zeros(_np.broadcast_shapes({shapes}), dtype=_dt)")
    lines.append("    if _z.dtype.kind not in 'iu':")
    lines.append("        _bad_dtype(_z.dtype)")
    return lines


def _exec(src: str, mode: str, array_module: Any = np) -> Any:
    """Run the generated source in a namespace holding only what it may call."""
    ns: dict[str, Any] = {
        "__builtins__": {
            "max": max,
            "min": min,
            "abs": abs,
            "isinstance": isinstance,
            "list": list,
            "tuple": tuple,
        },
        "_F": Fraction,
        "_np": array_module,
        "_bad_dtype": _bad_dtype,
    }
    exec(compile(src, f"<jaxrl_sym {mode} code>", "exec"), ns)
    return ns["_jaxrl_sym_compiled"]


def build(table: ExprParser, exprs: Sequence[Any], args: Sequence[str], *, mode: str,
          array_module: Any = np) -> CompiledFn:
    """Print ``exprs`` once, ``exec`` the source, return the function (see compile_int).
    ``array_module`` is what numpy-mode code calls as ``_np`` (numpy, or jax.numpy)."""
    args = list(args)
    if len(set(args)) != len(args):
        raise SymbolError(f"duplicate argument names in {args}")
    for a in args:
        validate_name(a)
    items = []
    for e in exprs:
        if isinstance(e, str):
            e = table.expr(e)
        items.append(e if isinstance(e, sympy.Basic) else as_expr(e, "compiled expression"))
    printer = _CodePrinter(mode, {a: a for a in args})
    body = [printer.doprint(e) for e in items]
    lines = [f"def _jaxrl_sym_compiled({', '.join(args)}):"]
    if mode == "numpy":
        lines += _numpy_prologue(args)
        body = [f"{b} + _z" for b in body]
    tail = "," if len(body) == 1 else ""
    lines.append(f"    return ({', '.join(body)}{tail})")
    src = "\n".join(lines) + "\n"
    fn = _exec(src, mode, array_module)
    fn.source = src
    fn.args = tuple(args)
    return fn


def compile_int(
    table: ExprParser, exprs: Sequence[sympy.Expr | str | int], args: Sequence[str]
) -> CompiledFn:
    """Compile expressions ONCE into a plain-Python function of int args returning int tuple.

    This is the per-decode-step path: the returned function is ``max``/``min``/``//``/``%``
    over Python ints, with no sympy object in sight. Python's ``//`` and ``%`` floor for every
    sign of numerator and divisor, exactly like sympy's ``floor`` and ``Mod``, so results match
    sympy for all integer inputs (``Mod(-3, 4) == 1 == -3 % 4``). Division by zero raises
    ZeroDivisionError. ``fn.source`` is the generated code.
    """
    return build(table, exprs, args, mode="int")


def compile_numpy(
    table: ExprParser, exprs: Sequence[sympy.Expr | str | int], args: Sequence[str]
) -> CompiledFn:
    """Like :func:`compile_int`, vectorised over integer numpy arrays (one value per row).

    Arguments broadcast together; every output has the broadcast shape (constants included) and
    the arguments' integer dtype. numpy's ``//`` and ``%`` floor like Python's; a zero divisor
    gives 0 with a RuntimeWarning instead of raising.
    """
    return build(table, exprs, args, mode="numpy")


def compile_jax(
    table: ExprParser, exprs: Sequence[sympy.Expr | str | int], args: Sequence[str]
) -> CompiledFn:
    """:func:`compile_numpy`'s code over ``jax.numpy``: for a value a jitted program computes
    from device scalars (a live-slot count from the step's write index), traced once with the
    program. Same source as the host's numpy version, so host and device agree by construction.
    """
    import jax.numpy as jnp  # here: the symbols layer needs JAX only for this

    return build(table, exprs, args, mode="numpy", array_module=jnp)


def compile_index(table: ExprParser, ix: IndexExpr, args: Sequence[str]) -> CompiledFn:
    """Compile an index to a function returning ``(start, stop)`` (a Point ``p`` is p:p+1)."""
    if isinstance(ix, Point):
        return compile_int(table, [ix.expr, ix.expr + 1], args)
    return compile_int(table, [ix.start, ix.stop], args)


def evaluate_index(
    table: ExprParser, ix_or_fn: IndexExpr | CompiledFn, values: Mapping[str, int]
) -> tuple[int, int]:
    """Convenience (not for hot loops unless given a compiled fn): ``(start, stop)`` as ints."""
    if isinstance(ix_or_fn, Point | Range):
        names = sorted({str(s) for e in index_parts(ix_or_fn) for s in e.free_symbols})
        fn: CompiledFn = compile_index(table, ix_or_fn, names)
    else:
        fn = ix_or_fn
    missing = [a for a in fn.args if a not in values]
    if missing:
        raise SymbolError(f"evaluate_index: missing value(s) for {', '.join(missing)}")
    start, stop = fn(*(values[a] for a in fn.args))
    return int(start), int(stop)
