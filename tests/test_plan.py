"""EngineOptions and GenerationPlan: the knobs as one JAX-free object, the plan as one frozen
object every group reads — speculation planned in, not patched afterwards."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from dataclasses import replace

import pytest
from flax import nnx

from jaxrl_sym.errors import InputError
from jaxrl_sym.models.lm import DecoderLM, preset
from jaxrl_sym.ops.attention import Block, Causal, Linear, Window
from jaxrl_sym.passes.stores import BLOCK, GROWING, RING, SLOT, STORE_KINDS, CannotSpeculate
from jaxrl_sym.runtime.engine import SymbolicLM
from jaxrl_sym.runtime.options import EngineOptions, Speculation
from jaxrl_sym.runtime.plan import GenerationPlan, compile_generation
from jaxrl_sym.runtime.policy import Compaction, Tiling
from jaxrl_sym.runtime.speculative.lm import SpeculativeLM
from jaxrl_sym.tracer.trace import trace_model


def _model(*patterns) -> nnx.Module:
    tiny = preset("tiny")
    return DecoderLM(replace(tiny, n_layers=len(patterns), patterns=patterns), rngs=nnx.Rngs(0))


def test_engine_options_import_without_jax() -> None:
    code = ("import sys; from jaxrl_sym.runtime.options import EngineOptions; "
            "EngineOptions(decode_tile=4); print('jax' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_engine_options_refuse_bad_knobs_by_name() -> None:
    for bad, name in ((dict(decode_tile=0), "decode_tile"),
                      (dict(decode_tile=8, max_decode_tile=4), "max_decode_tile"),
                      (dict(compact_at=0), "compact_at"), (dict(compact_min_rows=0),
                                                           "compact_min_rows"),
                      (dict(prefill="rect"), "prefill"), (dict(backend="tpu"), "backend")):
        with pytest.raises(InputError, match=name):
            EngineOptions(**bad)
    with pytest.raises(InputError, match="speculate"):
        Speculation(0)
    with pytest.raises(InputError, match="verify_tile"):
        Speculation(2, verify_tile=0)


def test_options_make_the_policies() -> None:
    opts = EngineOptions(decode_tile=4, compact_at=0.5, compact_min_rows=2, compact_early=True)
    # on the CPU a loop test costs nothing, on a GPU each is a host round-trip; early
    # compaction ends the tile on device, so it does not shrink while rows end
    assert opts.tiling() == Tiling(4, 64, 1, shrink=False)
    assert EngineOptions(decode_tile=4).tiling() == Tiling(4, 64, 1)
    assert opts.tiling("gpu") == Tiling(4, 64, 4, shrink=False)
    assert opts.replace(decode_check=2).tiling("gpu") == Tiling(4, 64, 2, shrink=False)
    assert EngineOptions(decode_tile=1).tiling("gpu") == Tiling(1, 1, 1, shrink=False)
    assert opts.compaction() == Compaction(0.5, 2, True)
    assert Speculation(5, adaptive=True).ks == (1, 2, 4, 5)
    assert Speculation(5).ks == (5,)


def test_knobs_come_only_in_an_options_object() -> None:
    m = _model(Causal())
    lm = SymbolicLM(m, EngineOptions(min_capacity=4, decode_tile=2))
    assert lm.options == EngineOptions(min_capacity=4, decode_tile=2)
    assert isinstance(lm.plan, GenerationPlan) and lm.plan.options is lm.options
    assert SymbolicLM(m).options == EngineOptions()
    with pytest.raises(TypeError, match="min_capacity"):  # no knob one by one
        SymbolicLM(m, min_capacity=4)
    with pytest.raises(TypeError, match="min_capcity"):  # a misspelled knob, by name
        EngineOptions(min_capcity=4)
    with pytest.raises(InputError, match=r"options=.*EngineOptions"):
        SymbolicLM(m, {"min_capacity": 4})
    spec = SpeculativeLM(m, EngineOptions(min_capacity=4), speculation=Speculation(2, True))
    assert spec.plan.speculation == Speculation(2, True) and spec.options.min_capacity == 4
    with pytest.raises(TypeError, match="speculate"):  # its knobs only in a Speculation
        SpeculativeLM(m, speculate=2)
    with pytest.raises(InputError, match="speculation=2: give a Speculation"):
        SpeculativeLM(m, speculation=2)


def test_the_plan_names_store_kinds_as_objects() -> None:
    plan = compile_generation(trace_model(_model(Window(3), Block(4), Causal()))[0])
    assert [s.kind for s in plan.stores] == [RING, BLOCK, GROWING, SLOT]
    assert all(s.kind in STORE_KINDS for s in plan.specs.values())
    assert plan.growing and plan.growing_need is not None and plan.speculation is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.row_multiple = 2  # type: ignore[misc]


def test_speculation_is_planned_in() -> None:
    program = trace_model(_model(Window(3), Block(4), Causal()))[0]
    plain = compile_generation(program)
    spec = compile_generation(program, speculation=Speculation(2))
    caps = lambda plan: {s.kind.name: s.capacity for s in plan.specs.values()}
    assert caps(plain) == {"ring": 3, "block": 4, "growing": None}
    assert caps(spec) == {"ring": 5, "block": 6, "growing": None}
    assert spec.builder.specs == spec.specs  # the step programs run the planned stores
    linear = trace_model(_model(Linear()))[0]
    with pytest.raises(CannotSpeculate, match="roll back"):
        compile_generation(linear, speculation=Speculation(2))
