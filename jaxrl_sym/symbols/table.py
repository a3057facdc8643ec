"""The symbol table: declared dimensions, their bounds and the relations between them.

Everything symbolic is a question asked *of a table*, because the answer depends on its bounds:
parsing (only declared names), checking concrete values (with a checker compiled once by
:mod:`.codegen`), proving relations and computing upper bounds (delegated to :mod:`.prover`).
"""

from __future__ import annotations

import io
import itertools
import tokenize
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import sympy
from sympy.parsing.sympy_parser import auto_number, parse_expr

from jaxrl_sym.errors import SymbolError
from jaxrl_sym.symbols import prover
from jaxrl_sym.symbols.codegen import build
from jaxrl_sym.symbols.expressions import (
    PARSE_FUNCS,
    Hyp,
    IndexExpr,
    Point,
    Range,
    is_int,
    rel_hyps,
    validate_name,
)

__all__ = ["Dim", "SymbolTable", "parse_index"]

# Window/block sizes, the batch and the length are counts of something that exists, so >= 1 by
# default; everything else (iterators such as ``t``) starts at 0.
_DEFAULT_MIN_ONE = frozenset({"w", "b", "B", "T"})

_ALLOWED_OPS = frozenset(
    {"+", "-", "*", "/", "//", "%", "**", "(", ")", ",", "<", ">", "<=", ">=", "==", "!="}
)
_COMPARISONS = frozenset({"<", ">", "<=", ">=", "==", "!="})
_RELATIONS: Mapping[str, Callable[[Any, Any], sympy.Basic]] = MappingProxyType(
    {"<": sympy.Lt, "<=": sympy.Le, ">": sympy.Gt, ">=": sympy.Ge, "==": sympy.Eq, "!=": sympy.Ne}
)

# Counterexample search limits (prove() answers None rather than search further).
_MAX_COUNTEREXAMPLE_TRIES = 4096
_COUNTEREXAMPLE_OFFSETS = (0, 1, 2, 3, 4, 5, 7, 8, 12)


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
            validate_name(d.name)
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
        checker = build(self, list(self.constraints), self.names, mode="exact")
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
            validate_name(n)
            lo, hi = bounds.get(n, (1 if n in _DEFAULT_MIN_ONE else 0, None))
            if not is_int(lo) or (hi is not None and not is_int(hi)):
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
        return [_RELATIONS[op](a, b) for op, a, b in zip(ops, sides, sides[1:], strict=False)]

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
                if tok.string in PARSE_FUNCS:
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
        local.update(PARSE_FUNCS)
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
            if not is_int(v):
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
    def hyps(self, relax: str | None = None) -> list[Hyp]:
        """Bounds and constraints as ``e >= 0`` facts, the prover's hypotheses.

        ``relax`` drops every upper limit on that dimension (its ``max_value`` and every
        constraint that mentions it): "how large can this get *however far t runs*".
        """
        out: list[Hyp] = []
        rsym = self.sym(relax) if relax is not None else None
        for d in self.dims:
            out.append((d.sym - d.min_value, False))
            if d.max_value is not None and d.sym != rsym:
                out.append((d.max_value - d.sym, False))
        for c in self.constraints:
            if rsym is not None and rsym in c.free_symbols:
                continue
            out.extend(rel_hyps(c))
        return out

    def check_symbols(self, e: sympy.Basic, what: str) -> None:
        """Raise :class:`SymbolError` if ``e`` mentions a symbol that is not a declared dim."""
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
        self.check_symbols(rel, "relation")
        p = prover.Prover(self.hyps())
        d = rel.lhs - rel.rhs
        if isinstance(rel, sympy.Ne):
            proven = p.entails(d, strict=True) or p.entails(-d, strict=True)
        else:
            proven = all(p.entails(e, strict=s) for e, s in rel_hyps(rel))
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
        fn = build(self, [rel, *cons], [d.name for d in dims], mode="exact")
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
        self.check_symbols(expr, "expression")
        return prover.upper_bound(self.hyps(), expr, self.sym(free))


def _ends_operand(tok: tokenize.TokenInfo) -> bool:
    """True if ``tok`` can end an operand, so a following ``mod`` is the infix operator."""
    if tok.type == tokenize.NAME:
        return tok.string not in PARSE_FUNCS
    return tok.type == tokenize.NUMBER or tok.string == ")"


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
