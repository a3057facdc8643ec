"""The prover: decides ``hyps => g >= 0`` over the integers, and finds exact upper bounds.

It is deliberately small and honest: linear arithmetic (Fourier-Motzkin with integer tightening)
after case-splitting ``Max``/``Min`` and replacing every ``floor``/``Mod`` by a fresh integer
quotient with its defining inequalities. It answers "unknown" rather than guessing.

It works on bare hypotheses (``(e, strict)`` pairs, see :data:`.expressions.Hyp`), not on a
symbol table: :class:`~jaxrl_sym.symbols.table.SymbolTable` turns its bounds and constraints
into hypotheses and asks.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from fractions import Fraction

import sympy

from jaxrl_sym.symbols.expressions import Hyp, num_den

__all__ = ["Prover", "upper_bound"]

# Prover limits: beyond them it answers "unknown" instead of running away.
_MAX_LEAVES = 256
_FM_LIMIT = 4000
_MAX_PRODUCTS = 400

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
_Row = tuple[dict[_Mono, int], Fraction, bool]  # (coefficients, constant, strict)
_System = dict[_Key, tuple[Fraction, bool]]
_INFEASIBLE = "infeasible"
_TRIVIAL = "trivial"
_GAVE_UP = "gave up"


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


def _fm_add(into: _System, n: tuple[_Key, Fraction, bool]) -> None:
    """Keep the tightest constant per left-hand side (strict wins a tie)."""
    key, c, s = n
    old = into.get(key)
    if old is None or c < old[0] or (c == old[0] and s and not old[1]):
        into[key] = (c, s)


def _fm_infeasible(polys: Sequence[tuple[_Poly, bool]], lin: _Linearizer) -> bool | None:
    """Fourier-Motzkin: True if the system ``p >= 0 (> 0 if strict)`` has no integer solution.

    False: the rational relaxation is feasible (not proven); None: gave up (too large).
    """
    state: _System = {}
    for p, strict in polys:
        n = _normalize({m: c for m, c in p.items() if m}, p.get((), Fraction(0)), strict, lin)
        if n == _INFEASIBLE:
            return True
        if n != _TRIVIAL:
            _fm_add(state, n)  # type: ignore[arg-type]
    while True:
        var = _fm_pick(state)
        if var is None:
            return False
        nxt = _fm_eliminate(state, var, lin)
        if nxt == _INFEASIBLE:
            return True
        if nxt == _GAVE_UP:
            return None
        state = nxt  # type: ignore[assignment]


def _fm_pick(state: _System) -> _Mono | None:
    """The variable whose elimination creates the fewest new constraints (None: none left)."""
    count: dict[_Mono, list[int]] = {}
    for key in state:
        for m, c in key:
            count.setdefault(m, [0, 0])[0 if c > 0 else 1] += 1
    if not count:
        return None
    return min(count, key=lambda m: (count[m][0] * count[m][1] - sum(count[m]), m))


def _fm_eliminate(state: _System, var: _Mono, lin: _Linearizer) -> _System | str:
    """One Fourier-Motzkin step: the system without ``var``, or ``_INFEASIBLE``/``_GAVE_UP``."""
    pos: list[_Row] = []
    neg: list[_Row] = []
    nxt: _System = {}
    for key, (c, s) in state.items():
        coef = dict(key).get(var, 0)
        if coef > 0:
            pos.append((dict(key), c, s))
        elif coef < 0:
            neg.append((dict(key), c, s))
        else:
            nxt[key] = (c, s)
    for row_p in pos:
        for row_n in neg:
            n = _fm_combine(row_p, row_n, var, lin)
            if n == _INFEASIBLE:
                return _INFEASIBLE
            if n != _TRIVIAL:
                _fm_add(nxt, n)  # type: ignore[arg-type]
        if len(nxt) > _FM_LIMIT:
            return _GAVE_UP
    return nxt


def _fm_combine(
    row_p: _Row, row_n: _Row, var: _Mono, lin: _Linearizer
) -> tuple[_Key, Fraction, bool] | str:
    """The positive combination of two rows (``var`` positive in one, negative in the other)
    in which ``var`` cancels, normalized."""
    kp, cp, sp = row_p
    kn, cn, sn = row_n
    a = kp[var]
    b = -kn[var]
    coeffs: dict[_Mono, Fraction] = {}
    for m, v in kp.items():
        if m != var:
            coeffs[m] = coeffs.get(m, Fraction(0)) + b * v
    for m, v in kn.items():
        if m != var:
            coeffs[m] = coeffs.get(m, Fraction(0)) + a * v
    return _normalize(coeffs, b * cp + a * cn, sp or sn, lin)


class Prover:
    """Proves ``hyps => goal`` by refuting ``hyps + not goal``; see the comment block above."""

    def __init__(self, hyps: Sequence[Hyp]) -> None:
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

    def _split(self, system: list[Hyp]) -> bool:
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

    def _leaf(self, system: list[Hyp]) -> bool:
        low = _Lowering(self)
        hyps = [(low.rw(e), s) for e, s in system]
        hyps += low.side
        lin = _Linearizer()
        polys = [(lin.poly(e), s) for e, s in hyps]
        polys += _quotient_axioms(polys, low.divs, lin)
        polys += _products(polys)
        return _fm_infeasible(polys, lin) is True


def _quotient_axioms(
    polys: Sequence[tuple[_Poly, bool]],
    divs: Sequence[tuple[sympy.Expr, sympy.Expr, sympy.Dummy]],
    lin: _Linearizer,
) -> list[tuple[_Poly, bool]]:
    """Facts about the quotients, each proven from the system itself (sound to add)."""
    axioms: list[tuple[_Poly, bool]] = []

    def implied(p: _Poly) -> bool:  # does the system imply p >= 0?
        neg = {m: -c for m, c in p.items()}
        return _fm_infeasible([*polys, (neg, True)], lin) is True

    quots = [(lin.poly(n), lin.poly(d), lin.poly(q)) for n, d, q in divs]
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
    return axioms


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

    def __init__(self, prover: Prover) -> None:
        self.prover = prover
        self.divs: list[tuple[sympy.Expr, sympy.Expr, sympy.Dummy]] = []
        self.side: list[Hyp] = []
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
            num, den = num_den(args[0])
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


def _abs_to_max(e: sympy.Expr) -> sympy.Expr:
    if not e.has(sympy.Abs):
        return e
    return e.replace(sympy.Abs, lambda x: sympy.Max(x, -x))


def _innermost_minmax(system: Sequence[Hyp]) -> sympy.Basic | None:
    best = None
    for e, _ in system:
        for a in e.atoms(sympy.Max, sympy.Min):
            if not any(x.has(sympy.Max, sympy.Min) for x in a.args) and (
                best is None or sympy.default_sort_key(a) < sympy.default_sort_key(best)
            ):
                best = a
    return best


# =========================================================================== upper bounds


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
        num, den = atom.args if isinstance(atom, sympy.Mod) else num_den(atom.args[0])
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


def _resolve(e: sympy.Expr, prover: Prover) -> sympy.Expr:
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
        # num_den makes a numeric floor divisor positive; a Mod divisor keeps its sign (the
        # remainder takes it), so a negative one is simply left alone.
        num, den = args if isinstance(e, sympy.Mod) else num_den(args[0])
        if (den.is_Integer and den > 0) or (not den.is_Number and prover.entails(den - 1)):
            for k in (0, -1, 1):
                if prover.entails(num - k * den) and prover.entails(k * den + den - 1 - num):
                    return num - k * den if isinstance(e, sympy.Mod) else sympy.Integer(k)
    return e.func(*args)


def upper_bound(hyps: Sequence[Hyp], expr: sympy.Expr, t: sympy.Symbol) -> sympy.Expr | None:
    """Max of ``expr`` over admissible ``t``: prove ``expr <= expr(W)`` for an admissible W."""
    if not expr.has(t):
        return expr
    with_t = [(e, s) for e, s in hyps if e.has(t)]
    rest = Prover([(e, s) for e, s in hyps if not e.has(t)])
    lows, highs = [], []
    for e, _ in with_t:
        lin = _linear_in(e, t)
        if lin is not None and lin[0] in (1, -1):
            (lows if lin[0] == 1 else highs).append(-lin[1] / lin[0])
    full = Prover(hyps)
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
