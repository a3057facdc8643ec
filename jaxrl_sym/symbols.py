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
"""

from __future__ import annotations

import io
import itertools
import keyword
import math
import numbers
import tokenize
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from types import MappingProxyType
from typing import Any, Protocol

import numpy as np
import sympy
from sympy.parsing.sympy_parser import auto_number, parse_expr
from sympy.printing.precedence import PRECEDENCE
from sympy.printing.printer import Printer
from sympy.printing.str import StrPrinter

from jaxrl_sym.errors import SymbolError

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
    "compile_numpy",
    "evaluate_index",
    "is_monotone",
    "parse_index",
    "substitute",
]

# Window/block sizes, the batch and the length are counts of something that exists, so >= 1 by
# default; everything else (iterators such as ``t``) starts at 0.
_DEFAULT_MIN_ONE = frozenset({"w", "b", "B", "T"})

# Function names accepted by the expression parser (both the paper's and JAX's spellings).
_PARSE_FUNCS: Mapping[str, Callable[..., sympy.Expr]] = MappingProxyType(
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
_RESERVED = frozenset(_PARSE_FUNCS) | {"True", "False", "None"}
_ALLOWED_OPS = frozenset(
    {"+", "-", "*", "/", "//", "%", "**", "(", ")", ",", "<", ">", "<=", ">=", "==", "!="}
)
_COMPARISONS = frozenset({"<", ">", "<=", ">=", "==", "!="})

# Prover limits: beyond them it answers "unknown" instead of running away.
_MAX_LEAVES = 256
_FM_LIMIT = 4000
_MAX_PRODUCTS = 400
_MAX_COUNTEREXAMPLE_TRIES = 4096
_COUNTEREXAMPLE_OFFSETS = (0, 1, 2, 3, 4, 5, 7, 8, 12)


# =========================================================================== dimensions


@dataclass(frozen=True)
class Dim:
    """One symbolic dimension with its declared integer bounds.

    Bounds live here (not in sympy assumptions) because the prover and :meth:`SymbolTable.check`
    need exact integer bounds such as ``w >= 1``, which sympy assumptions cannot state.
    """

    name: str
    sym: sympy.Symbol
    min_value: int = 0
    max_value: int | None = None

    def __post_init__(self) -> None:
        if self.sym.name != self.name or not self.sym.is_integer:
            raise SymbolError(
                f"Dim {self.name!r}: sym must be sympy.Symbol({self.name!r}, integer=True), "
                f"got {self.sym!r}"
            )
        if self.max_value is not None and self.max_value < self.min_value:
            raise SymbolError(
                f"Dim {self.name!r}: empty range {self.min_value} <= {self.name} <= "
                f"{self.max_value}"
            )

    def __str__(self) -> str:
        return self.name


_Hyp = tuple[sympy.Expr, bool]  # (e, strict): e >= 0, or e > 0 when strict


@dataclass(frozen=True)
class SymbolTable:
    """The dimensions of one traced model plus the relations between them.

    A table is immutable and cheap to pass around; everything symbolic (parsing, proving,
    classification) is a question asked *of a table*, because the answer depends on its bounds
    (``t - w + 1 >= 0`` is unknown, ``Max(0, t - w + 1) <= t`` needs ``w >= 1``).
    """

    dims: tuple[Dim, ...]
    constraints: tuple[sympy.Basic, ...] = ()
    _by_name: dict[str, Dim] = field(init=False, repr=False, compare=False, hash=False)
    _checker: Callable[..., tuple[Any, ...]] = field(
        init=False, repr=False, compare=False, hash=False
    )

    def __post_init__(self) -> None:
        by_name: dict[str, Dim] = {}
        for d in self.dims:
            _validate_name(d.name)
            if d.name in by_name:
                raise SymbolError(f"dimension {d.name!r} is declared twice")
            by_name[d.name] = d
        object.__setattr__(self, "_by_name", by_name)
        syms = {d.sym for d in self.dims}
        for c in self.constraints:
            if not isinstance(c, sympy.Rel):
                raise SymbolError(f"constraint {c} is not a relation (<, <=, >, >=, ==, !=)")
            unknown = sorted(str(s) for s in c.free_symbols if s not in syms)
            if unknown:
                raise SymbolError(
                    f"constraint {c} uses undeclared symbol(s) {', '.join(unknown)}; "
                    f"declared: {', '.join(self.names)}"
                )
        # Compiled once so that check() (called on every request) touches no sympy object.
        checker = _build(self, list(self.constraints), self.names, mode="exact")
        object.__setattr__(self, "_checker", checker)

    def __reduce__(self) -> tuple[type[SymbolTable], tuple[Any, ...]]:
        """Pickle/deepcopy by the declared fields; the compiled checker is rebuilt."""
        return (SymbolTable, (self.dims, self.constraints))

    # ------------------------------------------------------------------ construction
    @staticmethod
    def create(
        spec: str,
        constraints: Sequence[str | sympy.Basic] = (),
        bounds: Mapping[str, tuple[int, int | None]] | None = None,
    ) -> SymbolTable:
        """Build a table from ``"t, T, B, w, b"``, relation strings and bound overrides.

        Default lower bounds: ``w``, ``b``, ``B``, ``T`` >= 1 (sizes and lengths are counts of
        something that exists), every other dimension >= 0. ``bounds`` maps a name to
        ``(min, max)`` (``max`` may be None). A constraint string may chain comparisons
        (``"0 <= t <= T - 1"``), which adds one relation per link.
        """
        names = [n for n in spec.replace(",", " ").split() if n]
        if not names:
            raise SymbolError(f"SymbolTable.create({spec!r}): no dimension names given")
        bounds = dict(bounds or {})
        unknown = sorted(set(bounds) - set(names))
        if unknown:
            raise SymbolError(
                f"bounds given for undeclared dimension(s) {', '.join(unknown)}; "
                f"declared: {', '.join(names)}"
            )
        dims = []
        for n in names:
            _validate_name(n)
            lo, hi = bounds.get(n, (1 if n in _DEFAULT_MIN_ONE else 0, None))
            if not _is_int(lo) or (hi is not None and not _is_int(hi)):
                raise SymbolError(f"bounds for {n!r} must be ints, got {(lo, hi)!r}")
            dims.append(
                Dim(n, sympy.Symbol(n, integer=True), int(lo), None if hi is None else int(hi))
            )
        base = SymbolTable(tuple(dims))
        rels: list[sympy.Basic] = []
        for c in constraints:
            parsed = base._relations(c) if isinstance(c, str) else [c]
            for r in parsed:
                if r is sympy.true:
                    continue
                if r is sympy.false:
                    raise SymbolError(f"constraint {c!r} is always false")
                rels.append(r)
        return SymbolTable(tuple(dims), tuple(rels))

    # ------------------------------------------------------------------ lookup
    @property
    def names(self) -> tuple[str, ...]:
        """Dimension names in declaration order."""
        return tuple(d.name for d in self.dims)

    def __getitem__(self, name: str) -> Dim:
        try:
            return self._by_name[name]
        except KeyError:
            raise SymbolError(
                f"unknown dimension {name!r}; declared: {', '.join(self.names)}"
            ) from None

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def sym(self, name: str) -> sympy.Symbol:
        """The sympy symbol of dimension ``name``."""
        return self[name].sym

    # ------------------------------------------------------------------ parsing
    def expr(self, text: str) -> sympy.Expr:
        """Parse an integer expression: ``t - (t mod b)``, ``max(0, t-w+1)``, ``t // 2``, ...

        Every name must be a declared dimension or one of the known functions, so a typo is an
        error naming it instead of silently becoming a fresh sympy symbol.
        """
        toks = self._tokens(text)
        if any(t.string in _COMPARISONS for t in toks):
            raise SymbolError(f"{text!r} is a relation, expected an expression")
        e = self._parse_tokens(toks, text)
        if not isinstance(e, sympy.Expr):
            raise SymbolError(f"{text!r} does not parse to an expression (got {e!r})")
        return e

    def _relations(self, text: str) -> list[sympy.Basic]:
        """Parse ``a <= b`` (or a chain ``a <= b < c``) into one relation per link."""
        toks = self._tokens(text)
        parts: list[list[tokenize.TokenInfo]] = [[]]
        ops: list[str] = []
        depth = 0
        for tok in toks:
            if tok.string == "(":
                depth += 1
            elif tok.string == ")":
                depth -= 1
            if depth == 0 and tok.string in _COMPARISONS:
                ops.append(tok.string)
                parts.append([])
            else:
                parts[-1].append(tok)
        if not ops:
            raise SymbolError(f"constraint {text!r} has no comparison (<, <=, >, >=, ==, !=)")
        sides = [self._parse_tokens(p, text) for p in parts]
        rel = {
            "<": sympy.Lt,
            "<=": sympy.Le,
            ">": sympy.Gt,
            ">=": sympy.Ge,
            "==": sympy.Eq,
            "!=": sympy.Ne,
        }
        return [rel[op](a, b) for op, a, b in zip(ops, sides, sides[1:], strict=False)]

    def _tokens(self, text: str) -> list[tokenize.TokenInfo]:
        """Tokenize and validate: only declared names, known functions, ints and arithmetic."""
        if not isinstance(text, str):
            raise SymbolError(f"expected an expression string, got {text!r}")
        try:
            raw = list(tokenize.generate_tokens(io.StringIO(text.strip()).readline))
        except (tokenize.TokenError, SyntaxError) as e:
            raise SymbolError(f"cannot parse {text!r}: {e}") from None
        skip = {tokenize.NEWLINE, tokenize.NL, tokenize.ENDMARKER, tokenize.INDENT, tokenize.DEDENT}
        toks = [t for t in raw if t.type not in skip]
        out: list[tokenize.TokenInfo] = []
        for i, tok in enumerate(toks):
            nxt = toks[i + 1].string if i + 1 < len(toks) else None
            if tok.type == tokenize.NAME:
                prev = out[-1] if out else None
                if tok.string == "mod" and prev is not None and _ends_operand(prev):
                    # Infix ``x mod y`` == Python's ``x % y`` (same precedence as ``*``).
                    out.append(tok._replace(type=tokenize.OP, string="%"))
                    continue
                if tok.string in _PARSE_FUNCS:
                    if nxt != "(":
                        raise SymbolError(f"in {text!r}: {tok.string!r} is a function; call it")
                elif tok.string not in self._by_name:
                    raise SymbolError(
                        f"unknown symbol {tok.string!r} in {text!r}; declared dimensions: "
                        f"{', '.join(self.names)}"
                    )
            elif tok.type == tokenize.NUMBER:
                if not tok.string.isdigit():
                    raise SymbolError(
                        f"in {text!r}: only integer literals are allowed, got {tok.string!r}"
                    )
            elif tok.type == tokenize.OP:
                if tok.string not in _ALLOWED_OPS:
                    raise SymbolError(f"in {text!r}: operator {tok.string!r} is not allowed")
            else:
                raise SymbolError(f"in {text!r}: unexpected {tok.string!r}")
            out.append(tok)
        if not out:
            raise SymbolError("empty expression")
        return out

    def _parse_tokens(self, toks: Sequence[tokenize.TokenInfo], text: str) -> Any:
        src = " ".join(t.string for t in toks)
        if not src:
            raise SymbolError(f"cannot parse {text!r}: empty side")
        local: dict[str, Any] = {d.name: d.sym for d in self.dims}
        local.update(_PARSE_FUNCS)
        try:
            return parse_expr(
                src,
                local_dict=local,
                global_dict={"Integer": sympy.Integer, "__builtins__": {}},
                transformations=(auto_number,),
            )
        except SymbolError:
            raise
        except Exception as e:  # SyntaxError, TypeError from sympy, ZeroDivision...
            raise SymbolError(f"cannot parse {text!r}: {type(e).__name__}: {e}") from None

    # ------------------------------------------------------------------ checking values
    def check(self, values: Mapping[str, int]) -> None:
        """Raise :class:`SymbolError` unless ``values`` is a valid assignment of every dim."""
        unknown = sorted(set(values) - set(self._by_name))
        if unknown:
            raise SymbolError(
                f"value given for undeclared dimension(s) {', '.join(unknown)}; "
                f"declared: {', '.join(self.names)}"
            )
        args = []
        for d in self.dims:
            if d.name not in values:
                raise SymbolError(f"missing value for dimension {d.name!r}")
            v = values[d.name]
            if not _is_int(v):
                raise SymbolError(
                    f"dimension {d.name!r} must be an int, got {v!r} ({type(v).__name__})"
                )
            v = int(v)
            if v < d.min_value:
                raise SymbolError(f"dimension {d.name!r}={v} violates {d.name} >= {d.min_value}")
            if d.max_value is not None and v > d.max_value:
                raise SymbolError(f"dimension {d.name!r}={v} violates {d.name} <= {d.max_value}")
            args.append(v)
        try:
            ok = self._checker(*args)
        except ZeroDivisionError:
            ok = None
        for i, c in enumerate(self.constraints):
            if ok is None or not ok[i]:
                used = ", ".join(f"{s}={values[str(s)]}" for s in sorted(c.free_symbols, key=str))
                raise SymbolError(f"constraint {c} is violated by {used}")

    # ------------------------------------------------------------------ reasoning
    def _hyps(self, relax: str | None = None) -> list[_Hyp]:
        """Bounds and constraints as ``e >= 0`` facts.

        ``relax`` drops every upper limit on that dimension (its ``max_value`` and every
        constraint that mentions it): "how large can this get *however far t runs*".
        """
        out: list[_Hyp] = []
        rsym = self.sym(relax) if relax is not None else None
        for d in self.dims:
            out.append((d.sym - d.min_value, False))
            if d.max_value is not None and d.sym != rsym:
                out.append((d.max_value - d.sym, False))
        for c in self.constraints:
            if rsym is not None and rsym in c.free_symbols:
                continue
            out.extend(_rel_hyps(c))
        return out

    def _check_symbols(self, e: sympy.Basic, what: str) -> None:
        syms = {d.sym for d in self.dims}
        unknown = sorted(str(s) for s in e.free_symbols if s not in syms)
        if unknown:
            raise SymbolError(
                f"{what} {e} uses undeclared symbol(s) {', '.join(unknown)}; "
                f"declared: {', '.join(self.names)}"
            )

    def prove(self, rel: sympy.Basic | bool) -> bool | None:
        """Is ``rel`` true for every integer assignment allowed by the bounds and constraints?

        True: proven. False: refuted by a concrete admissible counterexample (so the claim "for
        all values" is false, not necessarily every instance). None: neither proof nor
        counterexample found. It never guesses: a None is the honest answer for anything beyond
        linear arithmetic over Max/Min/Mod/floor.
        """
        rel = sympy.sympify(rel)
        if rel is sympy.true:
            return True
        if rel is sympy.false:
            return False if self._find_counterexample(sympy.false) is not None else None
        if not isinstance(rel, sympy.Rel):
            raise SymbolError(f"prove() expects a relation, got {rel!r}")
        self._check_symbols(rel, "relation")
        prover = _Prover(self._hyps())
        d = rel.lhs - rel.rhs
        if isinstance(rel, sympy.Ne):
            proven = prover.entails(d, strict=True) or prover.entails(-d, strict=True)
        else:
            proven = all(prover.entails(e, strict=s) for e, s in _rel_hyps(rel))
        if proven:
            return True
        return False if self._find_counterexample(rel) is not None else None

    def _find_counterexample(self, rel: sympy.Basic) -> dict[str, int] | None:
        """Search small admissible assignments for one where ``rel`` is false.

        Only the dims that ``rel`` touches (closed under shared constraints) are enumerated: the
        others can take any admissible value independently.
        """
        syms = set(rel.free_symbols)
        cons: list[sympy.Basic] = []
        changed = True
        while changed:
            changed = False
            for c in self.constraints:
                if c not in cons and c.free_symbols & syms:
                    cons.append(c)
                    syms |= c.free_symbols
                    changed = True
        dims = [d for d in self.dims if d.sym in syms]
        per = max(2, int(_MAX_COUNTEREXAMPLE_TRIES ** (1 / max(1, len(dims)))))
        grids = []
        for d in dims:
            vals = [d.min_value + o for o in _COUNTEREXAMPLE_OFFSETS[:per]]
            if d.max_value is not None:
                vals = [v for v in vals if v <= d.max_value] + [d.max_value]
            grids.append(sorted(set(vals)))
        fn = _build(self, [rel, *cons], [d.name for d in dims], mode="exact")
        for combo in itertools.islice(itertools.product(*grids), _MAX_COUNTEREXAMPLE_TRIES):
            try:
                out = fn(*combo)
            except ZeroDivisionError:
                continue
            if all(out[1:]) and not out[0]:
                return {d.name: v for d, v in zip(dims, combo, strict=True)}
        return None

    def upper_bound(self, expr: sympy.Expr | int, *, free: str) -> sympy.Expr | None:
        """The maximum over all admissible values of ``free`` of ``expr``, in the other dims.

        None when no bound independent of ``free`` could be established (it grows with
        ``free``, or the proof is beyond the prover). A returned bound is exact: it is proven to
        be an upper bound and is attained at an admissible witness value of ``free``.
        """
        expr = sympy.sympify(expr)
        self._check_symbols(expr, "expression")
        return _upper_bound(self._hyps(), expr, self.sym(free))


def _is_int(v: object) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _validate_name(name: str) -> None:
    if (
        not isinstance(name, str)
        or not name.isidentifier()
        or keyword.iskeyword(name)
        or name.startswith("_")
        or name in _RESERVED
    ):
        raise SymbolError(
            f"invalid dimension name {name!r}: use an identifier that is not a Python keyword, "
            f"does not start with '_' and is not one of {', '.join(sorted(_RESERVED))}"
        )


def _ends_operand(tok: tokenize.TokenInfo) -> bool:
    """True if ``tok`` can end an operand, so a following ``mod`` is the infix operator."""
    if tok.type == tokenize.NAME:
        return tok.string not in _PARSE_FUNCS
    return tok.type == tokenize.NUMBER or tok.string == ")"


def _rel_hyps(rel: sympy.Basic) -> list[_Hyp]:
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


# =========================================================================== the prover
#
# Goal: decide "hyps => g >= 0" soundly. We show that hyps + (g < 0) has no integer solution:
#   1. case-split every Max/Min (innermost first) into its branches;
#   2. replace floor(n/d) by a fresh integer q with d*q <= n <= d*q + d - 1 (d >= 1 proven), and
#      Mod(n, d) by n - d*q; add cheap facts about q (sign, monotonicity between quotients of
#      the same divisor);
#   3. read the result as linear arithmetic over monomials (b*q is one variable), add pairwise
#      products of linear facts that only create monomials already present (degree-2
#      Positivstellensatz; this is what proves b*q1 >= b*q2 from q1 >= q2 and b >= 1);
#   4. Fourier-Motzkin elimination, tightening each derived constraint over the integers.
# Each step only adds implied facts, so "infeasible" is a proof; anything else is "unknown".

_Mono = tuple[int, ...]
_Poly = dict[_Mono, Fraction]
_Key = tuple[tuple[_Mono, int], ...]
_INFEASIBLE = "infeasible"
_TRIVIAL = "trivial"


class _Linearizer:
    """Maps sympy polynomials to dicts over monomials of atom ids; tracks integrality."""

    def __init__(self) -> None:
        self.ids: dict[sympy.Basic, int] = {}
        self.integer: list[bool] = []

    def atom(self, e: sympy.Basic) -> int:
        i = self.ids.get(e)
        if i is None:
            i = self.ids[e] = len(self.integer)
            self.integer.append(bool(e.is_integer))
        return i

    def poly(self, e: sympy.Basic) -> _Poly:
        if e.is_Rational:
            return {(): Fraction(int(e.p), int(e.q))} if e != 0 else {}
        if e.is_Add:
            out: _Poly = {}
            for a in e.args:
                _padd_into(out, self.poly(a))
            return out
        if e.is_Mul:
            acc: _Poly = {(): Fraction(1)}
            for a in e.args:
                acc = _pmul(acc, self.poly(a))
            return acc
        if e.is_Pow and e.exp.is_Integer and int(e.exp) > 0:
            base = self.poly(e.base)
            acc = {(): Fraction(1)}
            for _ in range(int(e.exp)):
                acc = _pmul(acc, base)
            return acc
        return {(self.atom(e),): Fraction(1)}

    def is_int(self, m: _Mono) -> bool:
        return all(self.integer[i] for i in m)


def _padd_into(acc: _Poly, p: _Poly, k: Fraction | int = 1) -> None:
    for m, c in p.items():
        v = acc.get(m, Fraction(0)) + k * c
        if v:
            acc[m] = v
        else:
            acc.pop(m, None)


def _pmul(a: _Poly, b: _Poly) -> _Poly:
    out: _Poly = {}
    for ma, ca in a.items():
        for mb, cb in b.items():
            m = tuple(sorted(ma + mb))
            v = out.get(m, Fraction(0)) + ca * cb
            if v:
                out[m] = v
            else:
                out.pop(m, None)
    return out


def _normalize(
    coeffs: Mapping[_Mono, Fraction], const: Fraction, strict: bool, lin: _Linearizer
) -> tuple[_Key, Fraction, bool] | str:
    """Scale to primitive integer coefficients; over integer monomials, round the constant."""
    coeffs = {m: c for m, c in coeffs.items() if c}
    if not coeffs:
        return _INFEASIBLE if const < 0 or (const == 0 and strict) else _TRIVIAL
    den = math.lcm(*(c.denominator for c in coeffs.values()))
    ints = {m: int(c * den) for m, c in coeffs.items()}
    g = math.gcd(*ints.values())
    ints = {m: v // g for m, v in ints.items()}
    const = const * Fraction(den, g)
    if all(lin.is_int(m) for m in ints):
        # sum(a_i x_i) is an integer S: S + c > 0 <=> S + ceil(c) - 1 >= 0; S + c >= 0 <=>
        # S + floor(c) >= 0.
        const = Fraction(math.ceil(const) - 1) if strict else Fraction(math.floor(const))
        strict = False
    return tuple(sorted(ints.items())), const, strict


def _fm_infeasible(polys: Sequence[tuple[_Poly, bool]], lin: _Linearizer) -> bool | None:
    """Fourier-Motzkin: True if the system ``p >= 0 (> 0 if strict)`` has no integer solution.

    False: the rational relaxation is feasible (not proven); None: gave up (too large).
    """
    state: dict[_Key, tuple[Fraction, bool]] = {}

    def add(into: dict[_Key, tuple[Fraction, bool]], n: tuple[_Key, Fraction, bool]) -> None:
        key, c, s = n
        old = into.get(key)
        if old is None or c < old[0] or (c == old[0] and s and not old[1]):
            into[key] = (c, s)

    for p, strict in polys:
        n = _normalize({m: c for m, c in p.items() if m}, p.get((), Fraction(0)), strict, lin)
        if n == _INFEASIBLE:
            return True
        if n != _TRIVIAL:
            add(state, n)  # type: ignore[arg-type]
    while True:
        count: dict[_Mono, list[int]] = {}
        for key in state:
            for m, c in key:
                count.setdefault(m, [0, 0])[0 if c > 0 else 1] += 1
        if not count:
            return False
        var = min(count, key=lambda m: (count[m][0] * count[m][1] - sum(count[m]), m))
        pos, neg = [], []
        nxt: dict[_Key, tuple[Fraction, bool]] = {}
        for key, (c, s) in state.items():
            coef = dict(key).get(var, 0)
            if coef > 0:
                pos.append((dict(key), c, s))
            elif coef < 0:
                neg.append((dict(key), c, s))
            else:
                nxt[key] = (c, s)
        for kp, cp, sp in pos:
            a = kp[var]
            for kn, cn, sn in neg:
                b = -kn[var]
                coeffs: dict[_Mono, Fraction] = {}
                for m, v in kp.items():
                    if m != var:
                        coeffs[m] = coeffs.get(m, Fraction(0)) + b * v
                for m, v in kn.items():
                    if m != var:
                        coeffs[m] = coeffs.get(m, Fraction(0)) + a * v
                n = _normalize(coeffs, b * cp + a * cn, sp or sn, lin)
                if n == _INFEASIBLE:
                    return True
                if n != _TRIVIAL:
                    add(nxt, n)  # type: ignore[arg-type]
            if len(nxt) > _FM_LIMIT:
                return None
        state = nxt


class _Prover:
    """Proves ``hyps => goal`` by refuting ``hyps + not goal``; see the comment block above."""

    def __init__(self, hyps: Sequence[_Hyp]) -> None:
        self.hyps = list(hyps)
        self._leaves = 0

    def entails(self, goal: sympy.Expr, *, strict: bool = False) -> bool:
        """True if ``goal >= 0`` (``> 0`` when strict) is proven under the hypotheses."""
        goal = sympy.sympify(goal)
        if goal.is_Number:
            return bool(goal > 0 or (goal == 0 and not strict))
        system = [*self.hyps, (-goal, not strict)]
        system = [(_abs_to_max(e), s) for e, s in system]
        self._leaves = 0
        return self._split(system)

    def _split(self, system: list[_Hyp]) -> bool:
        atom = _innermost_minmax(system)
        if atom is None:
            self._leaves += 1
            return self._leaves <= _MAX_LEAVES and self._leaf(system)
        args = atom.args
        for i, a in enumerate(args):
            # Branch i: the Max (Min) is args[i], i.e. args[i] >= (<=) every other argument.
            case = [
                ((a - o) if isinstance(atom, sympy.Max) else (o - a), False)
                for j, o in enumerate(args)
                if j != i
            ]
            branch = [(e.xreplace({atom: a}), s) for e, s in system] + case
            if not self._split(branch):
                return False
        return True

    def _linear_entails(self, goal: sympy.Expr) -> bool:
        """Cheap check (no splitting/lowering) used to validate divisors."""
        lin = _Linearizer()
        polys = [
            (lin.poly(e), s)
            for e, s in self.hyps
            if not e.has(sympy.Max, sympy.Min, sympy.floor, sympy.ceiling, sympy.Mod)
        ]
        polys.append((lin.poly(-goal), True))
        return _fm_infeasible(polys, lin) is True

    def _leaf(self, system: list[_Hyp]) -> bool:
        low = _Lowering(self)
        hyps = [(low.rw(e), s) for e, s in system]
        hyps += low.side
        lin = _Linearizer()
        polys = [(lin.poly(e), s) for e, s in hyps]
        # Facts about the quotients, each proven from the system itself (sound to add).
        axioms: list[tuple[_Poly, bool]] = []

        def implied(p: _Poly) -> bool:  # does the system imply p >= 0?
            neg = {m: -c for m, c in p.items()}
            return _fm_infeasible([*polys, (neg, True)], lin) is True

        quots = [(lin.poly(n), lin.poly(d), lin.poly(q)) for n, d, q in low.divs]
        for pn, pd, pq in quots:
            if implied(pn):  # n >= 0  =>  q >= 0
                axioms.append((pq, False))
            upper = dict(pd)
            _padd_into(upper, {(): Fraction(-1)})
            _padd_into(upper, pn, -1)
            if implied(upper):  # n <= d - 1  =>  q <= 0
                axioms.append(({m: -c for m, c in pq.items()}, False))
        for (pn1, pd1, pq1), (pn2, pd2, pq2) in itertools.combinations(quots, 2):
            if pd1 != pd2:
                continue
            diff_n = dict(pn1)
            _padd_into(diff_n, pn2, -1)
            diff_q = dict(pq1)
            _padd_into(diff_q, pq2, -1)
            if implied(diff_n):  # same divisor: floor is monotone in the numerator
                axioms.append((diff_q, False))
            if implied({m: -c for m, c in diff_n.items()}):
                axioms.append(({m: -c for m, c in diff_q.items()}, False))
        polys += axioms
        polys += _products(polys)
        return _fm_infeasible(polys, lin) is True


def _products(polys: Sequence[tuple[_Poly, bool]]) -> list[tuple[_Poly, bool]]:
    """Products of two linear facts whose degree-2 monomials already occur in the system."""
    nonlinear = {m for p, _ in polys for m in p if len(m) >= 2}
    if not nonlinear:
        return []
    linear = [
        (p, s)
        for p, s in polys
        if p and all(len(m) <= 1 for m in p) and any(len(m) == 1 for m in p)
    ]
    out: list[tuple[_Poly, bool]] = []
    for (p1, s1), (p2, s2) in itertools.combinations(linear, 2):
        v1 = [m for m in p1 if m]
        v2 = [m for m in p2 if m]
        if all(tuple(sorted(a + b)) in nonlinear for a in v1 for b in v2):
            out.append((_pmul(p1, p2), s1 and s2))
            if len(out) >= _MAX_PRODUCTS:
                break
    return out


class _Lowering:
    """Rewrites floor/ceiling/Mod into fresh integer quotients with their defining facts."""

    def __init__(self, prover: _Prover) -> None:
        self.prover = prover
        self.divs: list[tuple[sympy.Expr, sympy.Expr, sympy.Dummy]] = []
        self.side: list[_Hyp] = []
        self._keys: dict[tuple[sympy.Expr, sympy.Expr], sympy.Dummy] = {}

    def rw(self, e: sympy.Expr) -> sympy.Expr:
        if not e.has(sympy.floor, sympy.ceiling, sympy.Mod):
            return e
        args = [self.rw(a) for a in e.args]
        if isinstance(e, sympy.Mod):
            a, m = args
            q = self.quotient(a, m)
            return a - m * q if q is not None else sympy.Mod(a, m)
        if isinstance(e, sympy.floor | sympy.ceiling):
            num, den = _num_den(args[0])
            if isinstance(e, sympy.ceiling):
                q = self.quotient(-num, den)
                return -q if q is not None else sympy.ceiling(args[0])
            q = self.quotient(num, den)
            return q if q is not None else sympy.floor(args[0])
        return e.func(*args)

    def quotient(self, num: sympy.Expr, den: sympy.Expr) -> sympy.Expr | None:
        """A fresh integer q = floor(num/den), or None if den >= 1 cannot be shown."""
        if den.is_Number and den < 0:
            num, den = -num, -den
        if den == 1:
            return num if num.is_integer else None
        if not ((den.is_Integer and den > 0) or self.prover._linear_entails(den - 1)):
            return None
        key = (sympy.expand(num), sympy.expand(den))
        q = self._keys.get(key)
        if q is None:
            q = self._keys[key] = sympy.Dummy("q", integer=True)
            self.divs.append((num, den, q))
            self.side += [(num - den * q, False), (den * q + den - 1 - num, False)]
        return q


def _num_den(x: sympy.Expr) -> tuple[sympy.Expr, sympy.Expr]:
    """``x`` as ``num/den`` with a positive denominator where it is a number."""
    num, den = sympy.fraction(sympy.together(x))
    if den.is_Number and den < 0:
        num, den = -num, -den
    return num, den


def _abs_to_max(e: sympy.Expr) -> sympy.Expr:
    if not e.has(sympy.Abs):
        return e
    return e.replace(sympy.Abs, lambda x: sympy.Max(x, -x))


def _innermost_minmax(system: Sequence[_Hyp]) -> sympy.Basic | None:
    best = None
    for e, _ in system:
        for a in e.atoms(sympy.Max, sympy.Min):
            if not any(x.has(sympy.Max, sympy.Min) for x in a.args) and (
                best is None or sympy.default_sort_key(a) < sympy.default_sort_key(best)
            ):
                best = a
    return best


# --------------------------------------------------------------------------- upper bounds


def _linear_in(e: sympy.Expr, t: sympy.Symbol) -> tuple[sympy.Expr, sympy.Expr] | None:
    """``e == c*t + r`` with a number ``c`` and ``r`` free of ``t``; None if not of that form."""
    c = sympy.Integer(0)
    rest = []
    for term in sympy.Add.make_args(sympy.expand(e)):
        if not term.has(t):
            rest.append(term)
            continue
        k, m = term.as_coeff_Mul()
        if m != t:
            return None
        c += k
    return c, sympy.Add(*rest)


def _witnesses(
    expr: sympy.Expr, t: sympy.Symbol, lows: Sequence[sympy.Expr], highs: Sequence[sympy.Expr]
) -> list[sympy.Expr]:
    """Values of ``t`` where a piecewise expression can peak: its breakpoints and bounds."""
    base: list[sympy.Expr] = []
    for atom in sorted(expr.atoms(sympy.Max, sympy.Min), key=sympy.default_sort_key):
        for a, b in itertools.combinations(atom.args, 2):
            lin = _linear_in(a - b, t)
            if lin is None or lin[0] == 0:
                continue
            sol = -lin[1] / lin[0]
            base += [sol] if abs(lin[0]) == 1 else [sympy.floor(sol), sympy.ceiling(sol)]
    divs = sorted(expr.atoms(sympy.floor, sympy.ceiling, sympy.Mod), key=sympy.default_sort_key)
    for atom in divs:
        num, den = atom.args if isinstance(atom, sympy.Mod) else _num_den(atom.args[0])
        lin = _linear_in(num, t)
        if den.has(t) or lin is None or lin[0] != 1:
            continue
        d = lin[1]
        # Where the remainder is largest (den - 1) and where the quotient steps (remainder 0).
        base += [den - 1 - d, sympy.Mod(-1 - d, den), den - d, sympy.Mod(-d, den)]
    cands = [*base, *lows, *highs]
    cands += [sympy.Min(w, h) for w in base for h in highs]
    cands += [sympy.Max(w, lo) for w in base for lo in lows]
    out: list[sympy.Expr] = []
    for c in cands:
        if not c.has(t) and c not in out:
            out.append(c)
    return out


def _resolve(e: sympy.Expr, prover: _Prover) -> sympy.Expr:
    """Simplify Max/Min/floor/Mod whose branch or quotient the hypotheses decide."""
    if not e.has(sympy.Max, sympy.Min, sympy.floor, sympy.ceiling, sympy.Mod):
        return e
    args = [_resolve(a, prover) for a in e.args]
    if isinstance(e, sympy.Max | sympy.Min):
        sign = 1 if isinstance(e, sympy.Max) else -1
        for a in args:
            if all(prover.entails(sign * (a - o)) for o in args if o is not a):
                return a
        return e.func(*args)
    if isinstance(e, sympy.Mod | sympy.floor):
        # _num_den makes a numeric floor divisor positive; a Mod divisor keeps its sign (the
        # remainder takes it), so a negative one is simply left alone.
        num, den = args if isinstance(e, sympy.Mod) else _num_den(args[0])
        if (den.is_Integer and den > 0) or (not den.is_Number and prover.entails(den - 1)):
            for k in (0, -1, 1):
                if prover.entails(num - k * den) and prover.entails(k * den + den - 1 - num):
                    return num - k * den if isinstance(e, sympy.Mod) else sympy.Integer(k)
    return e.func(*args)


def _upper_bound(hyps: Sequence[_Hyp], expr: sympy.Expr, t: sympy.Symbol) -> sympy.Expr | None:
    """Max of ``expr`` over admissible ``t``: prove ``expr <= expr(W)`` for an admissible W."""
    if not expr.has(t):
        return expr
    with_t = [(e, s) for e, s in hyps if e.has(t)]
    rest = _Prover([(e, s) for e, s in hyps if not e.has(t)])
    lows, highs = [], []
    for e, _ in with_t:
        lin = _linear_in(e, t)
        if lin is not None and lin[0] in (1, -1):
            (lows if lin[0] == 1 else highs).append(-lin[1] / lin[0])
    full = _Prover(hyps)
    for w in _witnesses(expr, t, lows, highs):
        if not all(rest.entails(e.xreplace({t: w}), strict=s) for e, s in with_t):
            continue  # t = w is not admissible for every value of the other dims
        # Resolving first matters: Mod(-1, b) is b - 1 only once its quotient is pinned.
        cand = _resolve(expr.xreplace({t: w}), rest)
        if cand.has(t):
            continue
        if full.entails(cand - expr):
            return cand
    return None


# =========================================================================== index expressions


def _as_expr(v: object, what: str) -> sympy.Expr:
    if _is_int(v):
        return sympy.Integer(int(v))  # type: ignore[call-overload]
    if isinstance(v, sympy.Expr):
        return v
    raise SymbolError(f"{what} must be a sympy expression or an int, got {v!r}")


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
        object.__setattr__(self, "expr", _as_expr(self.expr, "Point.expr"))

    def __str__(self) -> str:
        return _fmt(self.expr)


@dataclass(frozen=True)
class Range:
    """A half-open range ``[start, stop)``, e.g. ``max(0,t-w+1):t+1`` for a sliding window."""

    start: sympy.Expr
    stop: sympy.Expr

    def __post_init__(self) -> None:
        object.__setattr__(self, "start", _as_expr(self.start, "Range.start"))
        object.__setattr__(self, "stop", _as_expr(self.stop, "Range.stop"))

    def length(self) -> sympy.Expr:
        """``stop - start``, expanded (``Mod(t,b)+1`` for a block)."""
        return sympy.expand(self.stop - self.start)

    def __str__(self) -> str:
        return f"{_fmt(self.start)}:{_fmt(self.stop)}"


IndexExpr = Point | Range


def parse_index(table: SymbolTable, text: str) -> IndexExpr:
    """``"t"``, ``"t-1"`` -> Point; ``"0:t+1"``, ``"max(0,t-w+1):t+1"`` -> Range.

    An empty start (``":t+1"``) means 0, as in a Python slice.
    """
    parts: list[str] = [""]
    depth = 0
    for ch in text:
        depth += ch == "("
        depth -= ch == ")"
        if ch == ":" and depth == 0:
            parts.append("")
        else:
            parts[-1] += ch
    if len(parts) == 1:
        return Point(table.expr(parts[0]))
    if len(parts) == 2:
        start = parts[0].strip() or "0"
        if not parts[1].strip():
            raise SymbolError(f"index {text!r}: a range needs an explicit stop")
        return Range(table.expr(start), table.expr(parts[1]))
    raise SymbolError(f"index {text!r}: expected 'expr' or 'start:stop' (no step)")


def substitute(ix: IndexExpr, mapping: Mapping[str | sympy.Symbol, sympy.Expr | int]) -> IndexExpr:
    """Simultaneously replace symbols (by name or symbol) in an index expression."""
    subs = {}
    for k, v in mapping.items():
        key = sympy.Symbol(k, integer=True) if isinstance(k, str) else k
        subs[key] = _as_expr(v, f"substitute() value for {k}")
    if isinstance(ix, Point):
        return Point(ix.expr.subs(subs, simultaneous=True))
    return Range(ix.start.subs(subs, simultaneous=True), ix.stop.subs(subs, simultaneous=True))


def _parts(ix: IndexExpr) -> tuple[sympy.Expr, ...]:
    if isinstance(ix, Point):
        return (ix.expr,)
    if isinstance(ix, Range):
        return (ix.start, ix.stop)
    raise SymbolError(f"expected a Point or Range, got {ix!r}")


def is_monotone(table: SymbolTable, ix: IndexExpr, free: str) -> bool | None:
    """Do the index's bounds never move backwards as ``free`` advances (``ix(t+1) >= ix(t)``)?

    True/False/None with :meth:`SymbolTable.prove`'s meaning (False: a counterexample exists).
    """
    t = table.sym(free)
    answers = [table.prove(sympy.Ge(e.xreplace({t: t + 1}), e)) for e in _parts(ix)]
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
    for e in _parts(ix):
        table._check_symbols(e, "index")
    if isinstance(ix, Point):
        lag = sympy.expand(t - ix.expr)
        return AccessSummary("point", sympy.Integer(1), int(lag) if lag.is_Integer else None)
    hyps = table._hyps(relax=free)
    bound = _upper_bound(hyps, ix.length(), t)
    prover = _Prover(hyps)

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


# =========================================================================== code generation


class CompiledFn(Protocol):
    """A generated function of int arguments; ``.source`` holds its Python source."""

    source: str
    args: tuple[str, ...]

    def __call__(self, *args: Any) -> tuple[Any, ...]: ...


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
        num, den = _num_den(e.args[0])
        if den == 1:
            return self._p(num)
        return f"({self._p(num)} // {self._p(den)})"

    def _print_ceiling(self, e: sympy.ceiling) -> str:
        num, den = _num_den(e.args[0])
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


def _build(
    table: SymbolTable, exprs: Sequence[Any], args: Sequence[str], *, mode: str
) -> CompiledFn:
    """Print ``exprs`` once, ``exec`` the source, return the function (see compile_int)."""
    args = list(args)
    if len(set(args)) != len(args):
        raise SymbolError(f"duplicate argument names in {args}")
    for a in args:
        _validate_name(a)
    items = []
    for e in exprs:
        if isinstance(e, str):
            e = table.expr(e)
        items.append(e if isinstance(e, sympy.Basic) else _as_expr(e, "compiled expression"))
    printer = _CodePrinter(mode, {a: a for a in args})
    body = [printer.doprint(e) for e in items]
    sig = ", ".join(args)
    lines = [f"def _jaxrl_sym_compiled({sig}):"]
    if mode == "numpy":
        if args:
            # Python ints are left as they are: they stay "weak" (NEP 50), so int32 rows
            # combined with a Python-int window size stay int32.
            for a in args:
                lines.append(f"    if isinstance({a}, (list, tuple)):")
                lines.append(f"        {a} = _np.asarray({a})")
            lines.append(f"    _dt = _np.result_type({sig})")
            shapes = ", ".join(f"_np.shape({a})" for a in args)
            lines.append(f"    _z = _np.zeros(_np.broadcast_shapes({shapes}), dtype=_dt)")
        else:
            lines.append("    _z = _np.zeros((), dtype=_np.int64)")
        lines.append("    if _z.dtype.kind not in 'iu':")
        lines.append("        _bad_dtype(_z.dtype)")
        body = [f"{b} + _z" for b in body]
    tail = "," if len(body) == 1 else ""
    lines.append(f"    return ({', '.join(body)}{tail})")
    src = "\n".join(lines) + "\n"
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
        "_np": np,
        "_bad_dtype": _bad_dtype,
    }
    exec(compile(src, f"<jaxrl_sym {mode} code>", "exec"), ns)
    fn = ns["_jaxrl_sym_compiled"]
    fn.source = src
    fn.args = tuple(args)
    fn.exprs = tuple(items)
    return fn


def compile_int(
    table: SymbolTable, exprs: Sequence[sympy.Expr | str | int], args: Sequence[str]
) -> CompiledFn:
    """Compile expressions ONCE into a plain-Python function of int args returning int tuple.

    This is the per-decode-step path: the returned function is ``max``/``min``/``//``/``%``
    over Python ints, with no sympy object in sight. Python's ``//`` and ``%`` floor for every
    sign of numerator and divisor, exactly like sympy's ``floor`` and ``Mod``, so results match
    sympy for all integer inputs (``Mod(-3, 4) == 1 == -3 % 4``). Division by zero raises
    ZeroDivisionError. ``fn.source`` is the generated code.
    """
    return _build(table, exprs, args, mode="int")


def compile_numpy(
    table: SymbolTable, exprs: Sequence[sympy.Expr | str | int], args: Sequence[str]
) -> CompiledFn:
    """Like :func:`compile_int`, vectorised over integer numpy arrays (one value per row).

    Arguments broadcast together; every output has the broadcast shape (constants included) and
    the arguments' integer dtype. numpy's ``//`` and ``%`` floor like Python's; a zero divisor
    gives 0 with a RuntimeWarning instead of raising.
    """
    return _build(table, exprs, args, mode="numpy")


def compile_index(table: SymbolTable, ix: IndexExpr, args: Sequence[str]) -> CompiledFn:
    """Compile an index to a function returning ``(start, stop)`` (a Point ``p`` is p:p+1)."""
    if isinstance(ix, Point):
        return compile_int(table, [ix.expr, ix.expr + 1], args)
    return compile_int(table, [ix.start, ix.stop], args)


def evaluate_index(
    table: SymbolTable, ix_or_fn: IndexExpr | CompiledFn, values: Mapping[str, int]
) -> tuple[int, int]:
    """Convenience (not for hot loops unless given a compiled fn): ``(start, stop)`` as ints."""
    if isinstance(ix_or_fn, Point | Range):
        names = sorted({str(s) for e in _parts(ix_or_fn) for s in e.free_symbols})
        fn: CompiledFn = compile_index(table, ix_or_fn, names)
    else:
        fn = ix_or_fn
    missing = [a for a in fn.args if a not in values]
    if missing:
        raise SymbolError(f"evaluate_index: missing value(s) for {', '.join(missing)}")
    start, stop = fn(*(values[a] for a in fn.args))
    return int(start), int(stop)
