"""XLA's cost analysis counts a loop body once; ``loop_aware_cost`` counts each loop XLA proved
a trip count for that many times. Oracle: the matmul flops a test computes from its own shapes
(2·m·k·n per product, times the trips it wrote), not from XLA."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax

from jaxrl_sym.runtime.memory.ledger import ProgramSize
from jaxrl_sym.runtime.memory.loop_cost import loop_aware_cost


def _flops(fn, *args) -> tuple[float, float, ProgramSize]:
    compiled = jax.jit(fn).lower(*args).compile()
    return (loop_aware_cost(compiled)["flops"], ProgramSize.of("p", compiled).flops,
            ProgramSize.of("p", compiled, loops=True))


@settings(max_examples=6, deadline=None)
@given(outer=st.integers(1, 5), inner=st.integers(1, 6), m=st.sampled_from([8, 24]),
       k=st.sampled_from([16, 32]))
def test_nested_static_loops_count_every_trip(outer: int, inner: int, m: int, k: int) -> None:
    x, w = jnp.ones((m, k)), jnp.ones((k, k)) * 0.01

    def fn(x, w):
        body = lambda i, y: lax.fori_loop(0, inner, lambda j, z: jnp.tanh(z @ w), y)
        return lax.fori_loop(0, outer, body, x) @ w  # and one product outside the loops

    once = 2.0 * m * k * k
    full, plain, size = _flops(fn, x, w)
    # up to XLA's few scalar flops (the loop counters' adds), which stay counted once
    assert full == pytest.approx((outer * inner + 1) * once, abs=16)
    assert plain == pytest.approx(2 * once, abs=16)  # XLA alone: each body once
    assert size.flops == full
    if outer * inner > 1:  # the extra trips read their operands again
        assert size.bytes_accessed > ProgramSize.of(
            "p", jax.jit(fn).lower(x, w).compile()).bytes_accessed


def test_a_map_over_blocks_counts_every_block() -> None:
    x, w = jnp.ones((64, 32)), jnp.ones((32, 32))
    fn = lambda x, w: lax.map(lambda b: b @ w, x.reshape(8, 8, 32)).reshape(64, 32)
    full, plain, _ = _flops(fn, x, w)
    assert full == pytest.approx(2.0 * 64 * 32 * 32, abs=16)
    assert plain == pytest.approx(full / 8, abs=16)


def test_a_loop_without_a_proved_trip_count_stays_counted_once() -> None:
    x, w = jnp.ones((16, 32)), jnp.ones((32, 32))

    def fn(x, w, n):
        return lax.while_loop(lambda c: c[0] < n, lambda c: (c[0] + 1, c[1] @ w), (0, x))[1]

    compiled = jax.jit(fn).lower(x, w, 5).compile()
    assert loop_aware_cost(compiled)["flops"] == compiled.cost_analysis()["flops"]
