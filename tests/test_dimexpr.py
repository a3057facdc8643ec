"""Tests for JAX symbolic dimension -> sympy conversion, on real ``jax.make_jaxpr`` outputs."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import sympy
from jax import export

from jaxrl_sym.dimexpr import _parse_str, is_symbolic, shape_to_sympy, to_sympy
from jaxrl_sym.errors import SymbolError
from jaxrl_sym.symbols import SymbolTable, compile_int

TABLE = SymbolTable.create("B, T")
B, T = TABLE.sym("B"), TABLE.sym("T")
JB, JT = export.symbolic_shape("B, T")


def _out_shape(f: Callable[[jax.Array], jax.Array]) -> tuple:
    """The symbolic output shape JAX infers for ``f`` on a (B, T, 4) input."""
    closed = jax.make_jaxpr(f)(jax.ShapeDtypeStruct((JB, JT, 4), jnp.float32))
    (out,) = closed.jaxpr.outvars
    return out.aval.shape


def _same(a: tuple[sympy.Expr, ...], b: tuple[sympy.Expr, ...]) -> bool:
    return len(a) == len(b) and all(sympy.simplify(x - y) == 0 for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize(
    ("f", "expected"),
    [
        (lambda x: x[:, 1:], (B, T - 1, 4)),
        (lambda x: jnp.concatenate([x, x], axis=1), (B, 2 * T, 4)),
        (lambda x: x.reshape(JB * JT, 4), (B * T, 4)),
        (lambda x: x.reshape(JB, -1), (B, 4 * T)),
        (lambda x: jnp.pad(x, ((0, 0), (0, 3), (0, 0))), (B, T + 3, 4)),
        (lambda x: jnp.pad(x, ((0, 0), (0, (-JT) % 4), (0, 0))), (B, T + sympy.Mod(-T, 4), 4)),
        (lambda x: x[:, ::2], (B, sympy.floor((T + 1) / 2), 4)),
        (lambda x: x[:, :5], (B, sympy.Min(T, 5), 4)),
        (lambda x: x[:, -3:], (B, T - sympy.Max(0, T - 3), 4)),
        (lambda x: x, (B, T, 4)),
    ],
)
def test_shapes_from_make_jaxpr(f, expected) -> None:
    shape = _out_shape(f)
    got = shape_to_sympy(shape, TABLE)
    assert _same(got, expected), (shape, got)
    # The structural walk and the printed form agree (the fallback path stays honest).
    parsed = tuple(_parse_str(d, TABLE) if is_symbolic(d) else sympy.Integer(d) for d in shape)
    assert _same(parsed, expected)


@pytest.mark.parametrize(
    ("d", "expected"),
    [
        (JT - 1, T - 1),
        (2 * JT, 2 * T),
        (JT // 2, sympy.floor(T / 2)),
        (JT % 4, sympy.Mod(T, 4)),
        (jax.core.max_dim(JT, 3), sympy.Max(T, 3)),
        (jax.core.min_dim(JT, JB), sympy.Min(T, B)),
        ((JT + 1) // 2 * 3 - JB, 3 * sympy.floor((T + 1) / 2) - B),
        (JT * JT * JB, B * T**2),
        (3 * JT - 2 * JB + 7, 3 * T - 2 * B + 7),
        (JT - JT, sympy.Integer(0)),
        (5, sympy.Integer(5)),
        (np.int64(7), sympy.Integer(7)),
    ],
)
def test_to_sympy_operations(d, expected) -> None:
    got = to_sympy(d, TABLE)
    assert sympy.simplify(got - expected) == 0
    assert is_symbolic(d) == (not isinstance(d, int | np.integer))


def test_converted_dims_evaluate_like_jax() -> None:
    """Compiled conversions agree with Python's floor semantics, which JAX's dims follow."""
    dims = [JT - 1, JT // 2, JT % 4, (-JT) % 4, jax.core.max_dim(JT - 3, 0), (JT + 1) // 2 * JB]
    fn = compile_int(TABLE, [to_sympy(d, TABLE) for d in dims], ["B", "T"])
    for bv in (1, 2, 3):
        for tv in range(1, 12):
            want = (tv - 1, tv // 2, tv % 4, (-tv) % 4, max(tv - 3, 0), (tv + 1) // 2 * bv)
            assert fn(bv, tv) == want


def test_unknown_symbol_names_the_name_and_table() -> None:
    (s,) = export.symbolic_shape("S")
    with pytest.raises(SymbolError, match=r"'S'.*declared: B, T"):
        to_sympy(s + 1, TABLE)
    with pytest.raises(SymbolError, match="unknown symbol 'S'"):
        _parse_str(s + 1, TABLE)


def test_rejects_non_dimensions() -> None:
    with pytest.raises(SymbolError, match="expected an int or a JAX symbolic dimension"):
        to_sympy(2.5, TABLE)  # type: ignore[arg-type]
    with pytest.raises(SymbolError, match="expected an int"):
        to_sympy(True, TABLE)  # type: ignore[arg-type]
    assert not is_symbolic(3)
    assert is_symbolic(JT)
