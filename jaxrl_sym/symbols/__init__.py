"""The symbolic layer: dimensions, index expressions, a small prover, and integer code generation.

Why this exists: the tracer describes every data dependence with an index expression over symbolic
dimensions (``t`` the position, ``T`` the length, ``w`` a window, ``b`` a block, ...). Planning
needs to *reason* about those expressions (how many keys does a query read at most? does the
read range move forward with ``t``?), and the per-step runtime needs to *evaluate* them millions
of times.

The two needs are kept apart on purpose:

* sympy is used at build time only: parsing, :meth:`SymbolTable.prove`,
  :meth:`SymbolTable.upper_bound`, :func:`classify_access`. The prover is deliberately small and
  honest: linear arithmetic (Fourier-Motzkin with integer tightening) after case-splitting
  ``Max``/``Min`` and replacing every ``floor``/``Mod`` by a fresh integer quotient with its
  defining inequalities. It answers ``None`` rather than guessing.
* :func:`compile_int` / :func:`compile_numpy` print the expressions ONCE into plain Python source
  (``%``, ``//``, ``max``, ``min``) and ``exec`` it, so the decode loop never touches a sympy
  object. Python's ``//`` and ``%`` floor exactly like sympy's ``floor`` and ``Mod``, for every
  sign, which is what makes the compiled code agree with sympy everywhere.

Modules, each depending only on those above it:

* :mod:`.expressions` -- ``Point``/``Range`` index expressions and shared sympy helpers;
* :mod:`.prover` -- the prover and exact upper bounds, over bare hypotheses;
* :mod:`.codegen` -- ``compile_int``/``compile_numpy``/``compile_jax``/``compile_index``/
  ``evaluate_index``;
* :mod:`.table` -- ``Dim``, ``SymbolTable`` (parsing, checking, proving) and ``parse_index``;
* :mod:`.access` -- ``classify_access``/``is_monotone``: what storage planning asks.
"""

from jaxrl_sym.symbols.access import AccessSummary, classify_access, is_monotone
from jaxrl_sym.symbols.codegen import (
    CompiledFn,
    compile_index,
    compile_int,
    compile_jax,
    compile_numpy,
    evaluate_index,
)
from jaxrl_sym.symbols.expressions import IndexExpr, Point, Range, substitute
from jaxrl_sym.symbols.table import Dim, SymbolTable, parse_index

__all__ = [
    "AccessSummary",
    "CompiledFn",
    "Dim",
    "IndexExpr",
    "Point",
    "Range",
    "SymbolTable",
    "classify_access",
    "compile_index",
    "compile_int",
    "compile_jax",
    "compile_numpy",
    "evaluate_index",
    "is_monotone",
    "parse_index",
    "substitute",
]
