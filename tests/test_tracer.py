"""Tracer, PDG and storage plan: structure, printing, and clear errors for bad input."""

from __future__ import annotations

from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_sym.errors import (
    InputError,
    NonCausalMixingError,
    PatternError,
    SymbolError,
    UnsupportedPrimitiveError,
)
from jaxrl_sym.generation import GenerationConfig
from jaxrl_sym.models.lm import DecoderLM, preset
from jaxrl_sym.ops.attention import Block, Causal, Linear, Window, attend, parse_pattern
from jaxrl_sym.passes.generation import add_generation_loop
from jaxrl_sym.passes.storage import plan_storage
from jaxrl_sym.passes.stores import FIXED, GROWING, SLOT, STATE
from jaxrl_sym.runtime.engine import SymbolicLM
from jaxrl_sym.runtime.options import EngineOptions
from jaxrl_sym.symbols import Point
from jaxrl_sym.tracer.trace import SeqInput, trace_function, trace_model

X = [SeqInput("x", "B, T, 8", jnp.float32)]


def _trace(fn, patterns=None):
    return trace_function(lambda w, x: fn(x), {}, X, patterns=patterns or (Causal(),))


def _tiny(patterns):
    cfg = replace(preset("tiny"), patterns=patterns)
    return DecoderLM(cfg, rngs=nnx.Rngs(0))


def test_model_pdg_has_attention_edges_with_pattern_ranges() -> None:
    prog, _, _ = trace_model(_tiny((Window(3), Block(4))))
    pdg = prog.pdg
    table = pdg.symbols
    t = table.sym("t")
    ranges = {str(e.index[1]) for e in pdg.ranged_edges()}
    assert ranges == {"max(0,t-w+1):t+1", "t-(t mod b):t+1"}
    assert prog.binding_dict == {"w": 3, "b": 4}
    att = [n for n in pdg.nodes if n.op == "sym_attention"]
    assert len(att) == 2 and all(n.domain == ("r", "t") for n in att)
    # position-wise edges are points
    assert any(e.index == (Point(table.sym("r")), Point(t)) for e in pdg.edges)
    assert pdg.stats()["static_nodes"] > 0  # weights live outside the domain


def test_generation_loop_is_a_cycle_with_lag_one_and_plan_is_per_pattern() -> None:
    prog, _, _ = trace_model(_tiny((Causal(), Linear())))
    gen = add_generation_loop(prog.pdg)
    fb = [e for e in gen.edges if e.kind == "feedback"]
    assert len(fb) == 1 and str(fb[0].index[1]) == "t-1"
    assert gen.topo_order()  # feedback edges do not block scheduling
    plan = plan_storage(gen)
    assert [s.kind for s in plan.stores] == [GROWING, STATE, SLOT]
    assert "geometric" in plan.to_text()
    fixed = plan_storage(gen, max_len=64)
    assert [s.kind for s in fixed.stores] == [FIXED, STATE, SLOT]


def test_text_and_dot_outputs() -> None:
    prog, _, _ = trace_model(_tiny((Window(3), Causal())))
    text = prog.pdg.to_text()
    assert "sym_attention Window(size=3)" in text and "max(0,t-w+1):t+1" in text
    dot = add_generation_loop(prog.pdg).to_dot()
    assert dot.startswith("digraph PDG") and "style=dashed" in dot and "t-1" in dot


def test_position_wise_function_traces() -> None:
    prog = _trace(lambda x: jnp.tanh(x) * 2.0 + jnp.sum(x, axis=-1, keepdims=True))
    assert all(n.domain in ((), ("r", "t")) for n in prog.pdg.nodes)


@pytest.mark.parametrize(
    ("fn", "needle"),
    [
        (lambda x: jnp.cumsum(x, axis=1), "cumsum"),
        (lambda x: jnp.sum(x, axis=1), "reduce_sum"),
        (lambda x: x[:, 1:], "sequence dimension T"),
        (lambda x: jnp.flip(x, axis=1), "rev"),
        (lambda x: jnp.einsum("btd,bsd->bts", x, x), "two axes of extent T"),
        (lambda x: x.reshape(-1, 8), "extent B*T"),
        (lambda x: x + jnp.arange(x.shape[1])[None, :, None], "iota"),
        (lambda x: jnp.sum(x, axis=0), "batch dimension B"),
    ],
)
def test_non_incremental_ops_are_rejected_with_source_line(fn, needle) -> None:
    with pytest.raises((NonCausalMixingError, UnsupportedPrimitiveError)) as err:
        _trace(fn)
    msg = str(err.value)
    assert needle in msg
    assert "test_tracer.py" in msg  # the user's source line


def test_unsupported_primitive_is_named() -> None:
    # feature-axis scans and sorts are position-wise: accepted
    _trace(lambda x: jax.lax.cummax(x, axis=2) + jax.lax.sort(x, dimension=2))
    with pytest.raises(UnsupportedPrimitiveError, match="cummax"):
        _trace(lambda x: jax.lax.cummax(x, axis=1))
    with pytest.raises(UnsupportedPrimitiveError, match=r"'top_k'.*no rule"):
        _trace(lambda x: jax.lax.top_k(x, 2)[0])


def test_attention_op_argument_errors() -> None:
    q = jnp.zeros((1, 4, 4, 8))
    pos = jnp.zeros((1, 4), jnp.int32)
    with pytest.raises(PatternError, match="window must be an int >= 1"):
        Window(0)
    with pytest.raises(PatternError, match="block size"):
        Block(-2)
    with pytest.raises(PatternError, match="unknown attention pattern"):
        parse_pattern("dilated:2")
    with pytest.raises(InputError, match="'q' must be a floating dtype"):
        attend(q.astype(jnp.int32), q, q, Causal(), q_positions=pos, kv_positions=pos)
    with pytest.raises(InputError, match="'kv_positions' must be int32"):
        attend(q, q, q, Causal(), q_positions=pos, kv_positions=pos.astype(jnp.float32))
    with pytest.raises(InputError, match="not a multiple"):
        attend(q, q[:, :, :3], q[:, :, :3], Causal(), q_positions=pos, kv_positions=pos)


def test_mismatched_symbols_and_bad_shapes() -> None:
    with pytest.raises(SymbolError, match="use B, T or integers"):
        trace_function(lambda w, x: x, {}, [SeqInput("x", "B, L, 8", jnp.float32)])
    # two sequence inputs whose lengths disagree cannot be added position-wise
    with pytest.raises(SymbolError, match="T - 1"):
        trace_function(lambda w, x, y: x + y[:, :-1], {},
                       [SeqInput("x", "B, T", jnp.float32), SeqInput("y", "B, T", jnp.float32)])


def test_symbol_values_checked_against_constraints() -> None:
    prog, _, _ = trace_model(_tiny((Window(2), Causal())))
    table = prog.pdg.symbols
    table.check({"r": 0, "t": 3, "B": 2, "T": 4, "w": 2})
    with pytest.raises(SymbolError, match="t"):
        table.check({"r": 0, "t": 4, "B": 2, "T": 4, "w": 2})
    with pytest.raises(SymbolError, match="w"):
        table.check({"r": 0, "t": 1, "B": 2, "T": 4, "w": 0})


def test_generation_input_errors() -> None:
    engine = SymbolicLM(_tiny((Window(2), Window(2))), EngineOptions(min_capacity=4))
    ok = np.arange(3, dtype=np.int32)
    with pytest.raises(InputError, match="prompt 1 is empty"):
        engine.generate([ok, np.zeros(0, np.int32)], GenerationConfig(max_new_tokens=2))
    with pytest.raises(InputError, match=r"prompt 0 has 3 tokens.*exceeds max_len=4"):
        engine.generate([ok], GenerationConfig(max_new_tokens=2, max_len=4))
    with pytest.raises(InputError, match="prompt 0 has dtype float"):
        engine.generate([ok.astype(np.float32)], GenerationConfig(max_new_tokens=2))
    with pytest.raises(InputError, match="outside"):
        engine.generate([ok + 1000], GenerationConfig(max_new_tokens=2))
    with pytest.raises(InputError, match="max_new_tokens"):
        engine.generate([ok, ok], GenerationConfig(max_new_tokens=(1, 2, 3)))
