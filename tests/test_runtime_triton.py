"""The runtime's Triton backend (kernels for single-token decode) against the padded baseline.

On CPU the same kernel source runs under Triton's interpreter (slow, so sizes are tiny); on a
GPU it runs through jax-triton.
"""

from __future__ import annotations

import importlib.util
from dataclasses import replace

import numpy as np
import pytest
from flax import nnx

# find_spec, not importorskip: importing triton here would fix it in compiled mode before the
# backend can switch it to the interpreter (see jaxrl_sym.backends.launch).
if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

from jaxrl_sym.baselines.padded import padded_generate
from jaxrl_sym.errors import InputError
from jaxrl_sym.generation import GenerationConfig
from jaxrl_sym.models.lm import DecoderLM, preset
from jaxrl_sym.ops.attention import Block, Causal, Linear, Window
from jaxrl_sym.runtime.engine import SymbolicLM, resolve_backend


def test_triton_backend_matches_padded_on_every_store_kind() -> None:
    cfg = replace(preset("tiny"), n_layers=4, patterns=(Causal(), Window(3), Block(4), Linear()))
    model = DecoderLM(cfg, rngs=nnx.Rngs(5))
    engine = SymbolicLM(model, min_capacity=4, backend="triton")
    assert {s.backend for s in engine.specs.values()} == {"triton"}
    prompts = [np.arange(n, dtype=np.int32) * 5 % 64 for n in (2, 6, 3)]
    gcfg = GenerationConfig(max_new_tokens=(12, 4, 6), return_logits=True)
    sym = engine.generate(prompts, gcfg)
    pad = padded_generate(model, prompts, gcfg)
    for a, b, la, lb in zip(sym.tokens, pad.tokens, sym.logits, pad.logits, strict=True):
        assert np.array_equal(a, b)
        np.testing.assert_allclose(la, lb, atol=1e-4, rtol=0)
    # the growing store outgrew its first capacity (16 slots for an 8-token prompt bucket)
    assert any(k[0] == "grow" for k in engine.cache.compiled)


def test_backend_names() -> None:
    assert resolve_backend("xla") == "xla"
    assert resolve_backend("auto") in ("xla", "triton")
    with pytest.raises(InputError, match="choose 'xla', 'triton' or 'auto'"):
        resolve_backend("cuda")
