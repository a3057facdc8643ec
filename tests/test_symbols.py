"""Tests for the symbolic layer: parsing, printing, proving, classification, code generation."""

from __future__ import annotations

import copy
import pickle
from typing import Any

import numpy as np
import pytest
import sympy
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl_sym.errors import SymbolError
from jaxrl_sym.symbols import (
    AccessSummary,
    Point,
    Range,
    SymbolTable,
    classify_access,
    compile_index,
    compile_int,
    compile_jax,
    compile_numpy,
    evaluate_index,
    is_monotone,
    parse_index,
    substitute,
)

TABLE = SymbolTable.create("t, T, B, w, b")
t, T, B, w, b = (TABLE.sym(n) for n in ("t", "T", "B", "w", "b"))

WINDOW = Range(sympy.Max(0, t - w + 1), t + 1)
BLOCK = Range(t - sympy.Mod(t, b), t + 1)
BLOCK_FLOOR = Range(b * sympy.floor(t / b), t + 1)
WINDOW_MIN = Range(t + 1 - sympy.Min(t + 1, w), t + 1)


def _eq(a: sympy.Expr, c: sympy.Expr) -> bool:
    return sympy.simplify(a - c) == 0


# --------------------------------------------------------------------------- table basics


def test_create_default_bounds_and_overrides() -> None:
    assert [(d.name, d.min_value, d.max_value) for d in TABLE.dims] == [
        ("t", 0, None),
        ("T", 1, None),
        ("B", 1, None),
        ("w", 1, None),
        ("b", 1, None),
    ]
    tb = SymbolTable.create("t, w, k", bounds={"w": (2, 64), "k": (-3, None)})
    assert (tb["w"].min_value, tb["w"].max_value, tb["k"].min_value) == (2, 64, -3)
    assert tb.names == ("t", "w", "k")
    assert str(tb["t"]) == "t"
    assert tb.sym("t") == sympy.Symbol("t", integer=True)
    assert "t" in tb and "x" not in tb


def test_create_parses_constraints_and_chains() -> None:
    tb = SymbolTable.create("t, T, w", ["0 <= t <= T - 1", "T >= w", "T == 2*w"])
    assert tb.constraints == (
        sympy.Le(0, tb.sym("t")),
        sympy.Le(tb.sym("t"), tb.sym("T") - 1),
        sympy.Ge(tb.sym("T"), tb.sym("w")),
        sympy.Eq(tb.sym("T"), 2 * tb.sym("w")),
    )


@pytest.mark.parametrize(
    ("spec", "constraints", "bounds", "match"),
    [
        ("t, T", ["t <= Q"], None, "'Q'"),
        ("t, t", [], None, "declared twice"),
        ("t, max", [], None, "invalid dimension name 'max'"),
        ("t, _x", [], None, "invalid dimension name '_x'"),
        ("t", [], {"w": (1, None)}, "undeclared dimension"),
        ("t", ["t + 1"], None, "no comparison"),
        ("t", ["1 < 0"], None, "always false"),
        ("t", [], {"t": (5, 2)}, "empty range"),
    ],
)
def test_create_errors(spec, constraints, bounds, match) -> None:
    with pytest.raises(SymbolError, match=match):
        SymbolTable.create(spec, constraints, bounds)


def test_unknown_dimension_lookup() -> None:
    with pytest.raises(SymbolError, match=r"unknown dimension 'x'.*t, T, B, w, b"):
        TABLE["x"]


# --------------------------------------------------------------------------- parsing


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("t - (t mod b)", t - sympy.Mod(t, b)),
        ("t - t mod b", t - sympy.Mod(t, b)),
        ("(t + 1) mod b", sympy.Mod(t + 1, b)),
        ("max(0, t-w+1)", sympy.Max(0, t - w + 1)),
        ("t // 2", sympy.floor(t / 2)),
        ("min(t, w)", sympy.Min(t, w)),
        ("Mod(t, b)", sympy.Mod(t, b)),
        ("mod(T, 4)", sympy.Mod(T, 4)),
        ("floor(t/b)", sympy.floor(t / b)),
        ("floordiv(T + 1, 2)", sympy.floor((T + 1) / 2)),
        ("ceiling(t/b)", sympy.ceiling(t / b)),
        ("2*t**2 - 1", 2 * t**2 - 1),
        ("7", sympy.Integer(7)),
    ],
)
def test_expr_parsing(text: str, expected: sympy.Expr) -> None:
    assert TABLE.expr(text) == expected


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("t + x", "unknown symbol 'x'"),
        ("foo(t)", "unknown symbol 'foo'"),
        ("__import__('os')", "unknown symbol '__import__'"),
        ("t.real", "operator '.'"),
        ("1.5 * t", "integer literals"),
        ("t <= T", "is a relation"),
        ("max + 1", "is a function"),
        ("t +", "cannot parse"),
        ("", "empty"),
    ],
)
def test_expr_errors(text: str, match: str) -> None:
    with pytest.raises(SymbolError, match=match):
        TABLE.expr(text)


@pytest.mark.parametrize(
    "text",
    [
        "t",
        "t-1",
        "0:t+1",
        "max(0,t-w+1):t+1",
        "t-(t mod b):t+1",
        "b*floor(t/b):t+1",
        "min(w,t+1):T",
        "((t+1) mod b)",
        "(t mod (2*b))",
    ],
)
def test_index_print_parse_round_trip(text: str) -> None:
    ix = parse_index(TABLE, text)
    assert str(ix) == text
    assert parse_index(TABLE, str(ix)) == ix


def test_parse_index_shapes_and_hashing() -> None:
    assert parse_index(TABLE, "t") == Point(t)
    assert parse_index(TABLE, "t - 1") == Point(t - 1)
    assert parse_index(TABLE, "max(0, t-w+1) : t+1") == WINDOW
    assert parse_index(TABLE, "t-(t mod b):t+1") == BLOCK
    assert parse_index(TABLE, ":t+1") == Range(0, t + 1)
    assert len({WINDOW, parse_index(TABLE, "max(0,t-w+1):t+1"), BLOCK}) == 2
    assert str(Point(-sympy.Mod(t, b))) == "-(t mod b)"
    with pytest.raises(SymbolError, match="no step"):
        parse_index(TABLE, "0:t:2")
    with pytest.raises(SymbolError, match="explicit stop"):
        parse_index(TABLE, "0:")
    with pytest.raises(SymbolError, match="sympy expression or an int"):
        Point("t")  # type: ignore[arg-type]


def test_range_length_and_substitute() -> None:
    assert _eq(WINDOW.length(), t + 1 - sympy.Max(0, t - w + 1))
    assert BLOCK.length() == sympy.Mod(t, b) + 1
    shifted = substitute(WINDOW, {"t": t + 1})
    assert shifted == Range(sympy.Max(0, t - w + 2), t + 2)
    assert substitute(Point(t - 1), {t: 5}) == Point(4)
    # simultaneous: swapping does not chain
    assert substitute(Range(t, w), {"t": w, "w": t}) == Range(w, t)


# --------------------------------------------------------------------------- check()


def test_check_accepts_valid_values() -> None:
    tb = SymbolTable.create("t, T, w", ["t <= T - 1", "w <= T"])
    tb.check({"t": 0, "T": 4, "w": 4})
    tb.check({"t": np.int64(3), "T": 4, "w": 1})


@pytest.mark.parametrize(
    ("values", "match"),
    [
        ({"t": 0, "T": 4}, "missing value for dimension 'w'"),
        ({"t": 0, "T": 4, "w": 0}, r"'w'=0 violates w >= 1"),
        ({"t": 0, "T": 4.0, "w": 1}, "dimension 'T' must be an int"),
        ({"t": True, "T": 4, "w": 1}, "dimension 't' must be an int"),
        ({"t": 4, "T": 4, "w": 1}, r"constraint t <= T - 1 is violated by T=4, t=4"),
        ({"t": 0, "T": 4, "w": 5}, r"constraint w <= T is violated by T=4, w=5"),
        ({"t": 0, "T": 4, "w": 1, "q": 2}, "undeclared dimension.*q"),
    ],
)
def test_check_errors_name_the_dim(values, match) -> None:
    tb = SymbolTable.create("t, T, w", ["t <= T - 1", "w <= T"])
    with pytest.raises(SymbolError, match=match):
        tb.check(values)


def test_check_max_bound() -> None:
    tb = SymbolTable.create("w", bounds={"w": (1, 8)})
    with pytest.raises(SymbolError, match=r"'w'=9 violates w <= 8"):
        tb.check({"w": 9})


# --------------------------------------------------------------------------- prove()


@pytest.mark.parametrize(
    "rel",
    [
        sympy.Gt(t + 1, t),
        sympy.Le(sympy.Max(0, t - w + 1), t),
        sympy.Ge(sympy.Max(0, t - w + 1), t - w + 1),
        sympy.Lt(sympy.Mod(t, b), b),
        sympy.Ge(sympy.Mod(t, b), 0),
        sympy.Le(sympy.floor(t / b), t),
        sympy.Le(b * sympy.floor(t / b), t),
        sympy.Eq(b * sympy.floor(t / b), t - sympy.Mod(t, b)),
        sympy.Eq(sympy.Mod(t, 2) + sympy.Mod(t + 1, 2), 1),
        sympy.Le(t + 1 - sympy.Max(0, t - w + 1), w),
        sympy.Eq(t + 1 - sympy.Max(0, t - w + 1), sympy.Min(t + 1, w)),
        sympy.Ge(t + 1 - sympy.Mod(t + 1, b), t - sympy.Mod(t, b)),
        sympy.Ge(sympy.floor(t / 2), 0),
        sympy.Ne(sympy.Mod(t, b), b),
        sympy.Ge(sympy.Abs(t - w), 0),
        sympy.Ge(T * B, 1 - t),
    ],
)
def test_prove_true(rel) -> None:
    assert TABLE.prove(rel) is True


@pytest.mark.parametrize(
    "rel",
    [
        sympy.Ge(t, 1),  # t = 0
        sympy.Ge(sympy.Mod(t + 1, b), sympy.Mod(t, b)),  # wraps at t = b - 1
        sympy.Le(t - w + 1, 0),
        sympy.Eq(sympy.Max(0, t - w + 1), t - w + 1),
        sympy.Ne(sympy.Mod(t, b), 0),
    ],
)
def test_prove_false(rel) -> None:
    assert TABLE.prove(rel) is False


@pytest.mark.parametrize(
    "rel",
    [
        sympy.Ge(t**2, t),  # true, but needs more than products of linear facts
        sympy.Le(t, 1000),  # false only beyond the counterexample search
    ],
)
def test_prove_unknown(rel) -> None:
    assert TABLE.prove(rel) is None


def test_prove_uses_constraints_and_rejects_unknown_symbols() -> None:
    tb = SymbolTable.create("t, T, w", ["t <= T - 1", "w <= T"])
    tt, TT, ww = tb.sym("t"), tb.sym("T"), tb.sym("w")
    assert tb.prove(sympy.Lt(tt, TT)) is True
    assert tb.prove(sympy.Le(sympy.Max(0, tt - ww + 1) + ww, TT + tt)) is True
    assert TABLE.prove(sympy.Lt(t, T)) is False  # no such constraint in TABLE
    with pytest.raises(SymbolError, match=r"undeclared symbol.*z"):
        TABLE.prove(sympy.Ge(sympy.Symbol("z", integer=True), 0))


# --------------------------------------------------------------------------- upper_bound()


@pytest.mark.parametrize(
    ("expr", "expected"),
    [
        ((t + 1) - sympy.Max(0, t - w + 1), w),
        (sympy.Mod(t, b) + 1, b),
        (t + 1, None),
        (sympy.Integer(1), sympy.Integer(1)),
        (sympy.Min(t + 1, w), w),
        (t + 1 - b * sympy.floor(t / b), b),
        (w - t, w),
        (sympy.Mod(t + 3, b), b - 1),
        (sympy.Min(t, w - 1), w - 1),
    ],
)
def test_upper_bound_examples(expr, expected) -> None:
    got = TABLE.upper_bound(expr, free="t")
    if expected is None:
        assert got is None
    else:
        assert got is not None and _eq(got, expected)


def test_upper_bound_respects_constraints() -> None:
    tb = SymbolTable.create("t, T, w", ["t <= T - 1", "w <= T"])
    tt, TT, ww = tb.sym("t"), tb.sym("T"), tb.sym("w")
    assert tb.upper_bound(tt + 1, free="t") == TT
    assert tb.upper_bound(sympy.Min(tt + 1, ww), free="t") == ww


# --------------------------------------------------------------------------- classification


@pytest.mark.parametrize(
    ("ix", "expected"),
    [
        (Point(t), AccessSummary("point", sympy.Integer(1), 0)),
        (Point(t - 1), AccessSummary("point", sympy.Integer(1), 1)),
        (Point(sympy.Integer(0)), AccessSummary("point", sympy.Integer(1), None)),
        (Range(0, t + 1), AccessSummary("prefix", None, None)),
        (Range(0, t), AccessSummary("prefix", None, None)),
        (WINDOW, AccessSummary("window", w, None)),
        (WINDOW_MIN, AccessSummary("window", w, None)),
        (Range(sympy.Max(0, t - 3), t + 1), AccessSummary("window", sympy.Integer(4), None)),
        (Range(sympy.Max(0, t - w + 1), t), AccessSummary("window", w - 1, None)),
        (BLOCK, AccessSummary("block", b, None)),
        (BLOCK_FLOOR, AccessSummary("block", b, None)),
        (Range(t - sympy.Mod(t, 4), t + 1), AccessSummary("block", sympy.Integer(4), None)),
        (Range(4 * sympy.floor(t / 4), t + 1), AccessSummary("block", sympy.Integer(4), None)),
        (Range(sympy.Mod(t, b), t + 1), AccessSummary("general", None, None)),
        (Range(t - 3, t + 1), AccessSummary("general", sympy.Integer(4), None)),
        (Range(0, sympy.Min(t + 1, w)), AccessSummary("general", w, None)),
        (Range(0, T), AccessSummary("general", T, None)),
    ],
)
def test_classify_access(ix, expected) -> None:
    got = classify_access(TABLE, ix, "t")
    assert (got.kind, got.lag) == (expected.kind, expected.lag)
    if expected.bound is None:
        assert got.bound is None
    else:
        assert got.bound is not None and _eq(got.bound, expected.bound)


def test_classify_prefix_despite_length_constraint() -> None:
    tb = SymbolTable.create("t, T, w", ["t <= T - 1", "w <= T"])
    tt, ww = tb.sym("t"), tb.sym("w")
    assert classify_access(tb, Range(0, tt + 1), "t").kind == "prefix"
    assert classify_access(tb, Range(sympy.Max(0, tt - ww + 1), tt + 1), "t") == AccessSummary(
        "window", ww, None
    )


def test_classify_parsed_equivalent_forms() -> None:
    block = [
        parse_index(TABLE, s)
        for s in ("t-(t mod b):t+1", "b*(t//b):t+1", "t - Mod(t, b):t+1", "b*floordiv(t, b):t+1")
    ]
    assert {classify_access(TABLE, ix, "t") for ix in block} == {AccessSummary("block", b, None)}


@pytest.mark.parametrize(
    ("ix", "expected"),
    [
        (WINDOW, True),
        (BLOCK, True),
        (BLOCK_FLOOR, True),
        (Range(0, t + 1), True),
        (Point(t - 1), True),
        (Range(sympy.Mod(t, b), t + 1), False),
        (Point(T - t), False),
        (Point(t**2 - 3 * t), False),  # dips from t = 0 to t = 1
        (Point(t**3), None),  # true, but 3t^2 + 3t + 1 >= 0 is beyond the linear prover
    ],
)
def test_is_monotone(ix, expected) -> None:
    assert is_monotone(TABLE, ix, "t") is expected


# --------------------------------------------------------------------------- compilation


def test_compile_int_source_is_plain_python() -> None:
    fn = compile_int(TABLE, [WINDOW.start, BLOCK.start, sympy.floor(t / b), 3], ["t", "w", "b"])
    assert fn(5, 3, 4) == (3, 4, 1, 3)
    assert fn.args == ("t", "w", "b")
    for word in ("Max", "Mod", "floor", "sympy", "Integer"):
        assert word not in fn.source
    assert "%" in fn.source and "//" in fn.source and "max(" in fn.source
    consts = fn.__code__.co_consts
    assert all(c is None or isinstance(c, int | str) for c in consts)
    assert all(type(v).__module__.split(".")[0] != "sympy" for v in fn.__globals__.values())


def test_compile_int_floor_semantics_for_negative_numerators() -> None:
    fn = compile_int(TABLE, [sympy.Mod(t, 4), sympy.floor(t / 4), sympy.ceiling(t / 4)], ["t"])
    assert fn(-3) == (1, -1, 0)
    assert sympy.Mod(-3, 4) == 1 == -3 % 4


def test_compile_int_errors() -> None:
    with pytest.raises(SymbolError, match="not integer arithmetic"):
        compile_int(TABLE, [t / 2], ["t"])
    with pytest.raises(SymbolError, match="'w', which is not among the arguments"):
        compile_int(TABLE, [t + w], ["t"])
    with pytest.raises(SymbolError, match="duplicate"):
        compile_int(TABLE, [t], ["t", "t"])
    with pytest.raises(SymbolError, match="cannot compile"):
        compile_int(TABLE, [sympy.sin(t)], ["t"])


def test_compile_accepts_strings_and_single_output() -> None:
    fn = compile_int(TABLE, ["t - (t mod b)"], ["t", "b"])
    assert fn(7, 4) == (4,)


def test_compile_numpy_broadcasts_and_checks_dtype() -> None:
    fn = compile_numpy(TABLE, [WINDOW.start, 1], ["t", "w"])
    starts, ones = fn(np.arange(6, dtype=np.int32), 3)
    assert starts.tolist() == [0, 0, 0, 1, 2, 3] and starts.dtype == np.int32
    assert ones.tolist() == [1] * 6
    with pytest.raises(SymbolError, match="integer arrays"):
        fn(np.arange(3.0), 3)


def test_compile_index_and_evaluate_index() -> None:
    fn = compile_index(TABLE, WINDOW, ["t", "w"])
    assert fn(5, 3) == (3, 6)
    assert evaluate_index(TABLE, fn, {"t": 1, "w": 3}) == (0, 2)
    assert evaluate_index(TABLE, BLOCK, {"t": 9, "b": 4}) == (8, 10)
    assert evaluate_index(TABLE, Point(t - 1), {"t": 9}) == (8, 9)
    with pytest.raises(SymbolError, match="missing value"):
        evaluate_index(TABLE, fn, {"t": 1})


def test_table_hashable_equal_and_picklable() -> None:
    a = SymbolTable.create("t, w", ["w <= 9"])
    c = SymbolTable.create("t, w", ["w <= 9"])
    assert a == c and hash(a) == hash(c)
    d = pickle.loads(pickle.dumps(a))
    assert d == a and copy.deepcopy(a) == a
    with pytest.raises(SymbolError, match="w <= 9"):
        d.check({"t": 0, "w": 10})


# --------------------------------------------------------------------------- properties

_EXPRS = [
    sympy.Max(0, t - w + 1),
    t - sympy.Mod(t, b),
    b * sympy.floor(t / b),
    sympy.Mod(t - w + 1, b),
    sympy.floor((t - w + 1) / b),
    sympy.floor((t + 1) / 2),
    sympy.ceiling((t - w) / b),
    sympy.Min(t + 1, w) - sympy.Mod(t, 3),
    sympy.Max(t - w + 1, sympy.Mod(t, b), -5),
    (t + 1) - sympy.Max(0, t - w + 1),
    2 * sympy.Mod(3 * t - 1, b) - sympy.floor(-t / 3),
    sympy.Abs(t - w) * 2,
]
_ints = st.integers(-50, 50)
_nonzero = st.integers(-12, 12).filter(lambda v: v != 0)


@pytest.fixture(scope="module")
def compiled_exprs() -> tuple[Any, Any]:
    """Compiled once per module, like the runtime does: hypothesis only calls them."""
    args = ["t", "w", "b"]
    return compile_int(TABLE, _EXPRS, args), compile_numpy(TABLE, _EXPRS, args)


@settings(max_examples=120, deadline=None)
@given(tv=_ints, wv=_ints, bv=_nonzero)
def test_compile_int_matches_sympy(compiled_exprs, tv: int, wv: int, bv: int) -> None:
    got = compiled_exprs[0](tv, wv, bv)
    want = tuple(int(e.subs({t: tv, w: wv, b: bv})) for e in _EXPRS)
    assert got == want
    assert all(type(v) is int for v in got)


@settings(max_examples=60, deadline=None)
@given(
    ts=st.lists(_ints, min_size=1, max_size=8),
    wv=_ints,
    bs=st.lists(_nonzero, min_size=1, max_size=1),
)
def test_compile_numpy_matches_compile_int(
    compiled_exprs, ts: list[int], wv: int, bs: list[int]
) -> None:
    fi, fv = compiled_exprs
    out = fv(np.array(ts, dtype=np.int64), wv, bs[0])
    for i, tv in enumerate(ts):
        assert tuple(int(col[i]) for col in out) == fi(tv, wv, bs[0])


def test_compile_jax_matches_compile_int_inside_jit(compiled_exprs) -> None:
    """The device copy (a step program's live-slot count) is the same code over jax.numpy:
    traced once, it agrees with the host's integer code for every input."""
    import jax
    import jax.numpy as jnp

    fj = jax.jit(compile_jax(TABLE, _EXPRS, ["t", "w", "b"]))
    ts = np.arange(-20, 21, dtype=np.int32)
    for wv, bv in ((3, 4), (-2, 5), (7, -3)):
        out = fj(jnp.asarray(ts), jnp.int32(wv), jnp.int32(bv))
        assert all(o.dtype == jnp.int32 for o in out)
        for i, tv in enumerate(ts):
            assert tuple(int(col[i]) for col in out) == compiled_exprs[0](int(tv), wv, bv)


_BOUNDED = [
    (WINDOW, "window"),
    (WINDOW_MIN, "window"),
    (Range(sympy.Max(0, t - w + 1), t), "window"),
    (BLOCK, "block"),
    (BLOCK_FLOOR, "block"),
    (Range(t - sympy.Mod(t, 4), t + 1), "block"),
]


@pytest.fixture(scope="module")
def bounded_fns() -> list[Any]:
    """(start, stop, length, classified bound) of each bounded access, compiled once."""
    fns = []
    for ix, kind in _BOUNDED:
        summary = classify_access(TABLE, ix, "t")
        assert summary.kind == kind
        fns.append(
            compile_int(TABLE, [ix.start, ix.stop, ix.length(), summary.bound], ["t", "w", "b"])
        )
    return fns


@settings(max_examples=200, deadline=None)
@given(tv=st.integers(0, 200), wv=st.integers(1, 40), bv=st.integers(1, 40))
def test_range_lengths_match_brute_force_and_bound(bounded_fns, tv: int, wv: int, bv: int) -> None:
    for fn in bounded_fns:
        start, stop, length, bound = fn(tv, wv, bv)
        assert length == len(range(start, stop))
        assert 0 <= start <= stop and stop in (tv, tv + 1)
        assert length <= bound


@pytest.mark.parametrize(("ix", "witness"), [(WINDOW, w - 1), (BLOCK, b - 1), (BLOCK_FLOOR, b - 1)])
def test_bounds_are_attained(ix, witness) -> None:
    """The classified bound is the exact maximum, not just an upper bound."""
    bound = classify_access(TABLE, ix, "t").bound
    fn = compile_int(TABLE, [ix.length().xreplace({t: witness}), bound], ["w", "b"])
    for wv in range(1, 9):
        for bv in range(1, 9):
            length, bnd = fn(wv, bv)
            assert length == bnd


def _exprs() -> st.SearchStrategy[sympy.Expr]:
    """Random integer expressions over t, w, b with the operators the prover models."""
    leaves = st.sampled_from([t, w, b, sympy.Integer(0), sympy.Integer(1), sympy.Integer(-2)])
    divisors = st.sampled_from([b, w, sympy.Integer(3)])

    def extend(inner: st.SearchStrategy[sympy.Expr]) -> st.SearchStrategy[sympy.Expr]:
        return st.one_of(
            st.builds(lambda x, y: x + y, inner, inner),
            st.builds(lambda x, y: x - y, inner, inner),
            st.builds(lambda k, x: k * x, st.integers(-2, 2), inner),
            st.builds(sympy.Max, inner, inner),
            st.builds(sympy.Min, inner, inner),
            st.builds(sympy.Mod, inner, divisors),
            st.builds(lambda x, d: sympy.floor(x / d), inner, divisors),
        )

    return st.recursive(leaves, extend, max_leaves=5)


@pytest.fixture(scope="module")
def grid() -> list[tuple[int, int, int]]:
    """Admissible (t, w, b) values covering the prover's counterexample search range."""
    return [(tv, wv, bv) for tv in range(14) for wv in range(1, 15) for bv in range(1, 15)]


@settings(max_examples=80, deadline=None)
@given(lhs=_exprs(), rhs=_exprs(), op=st.sampled_from([sympy.Ge, sympy.Le, sympy.Eq]))
def test_prove_is_sound(grid, lhs: sympy.Expr, rhs: sympy.Expr, op) -> None:
    """True is never claimed for a relation with a counterexample; False always has one."""
    rel = op(lhs, rhs)
    if rel in (sympy.true, sympy.false):
        return
    verdict = TABLE.prove(rel)
    diff = compile_int(TABLE, [lhs - rhs], ["t", "w", "b"])
    holds = {sympy.Ge: lambda d: d >= 0, sympy.Le: lambda d: d <= 0, sympy.Eq: lambda d: d == 0}
    ok = all(holds[op](diff(*v)[0]) for v in grid)
    if verdict is True:
        assert ok, rel
    elif verdict is False:
        assert not ok, rel
