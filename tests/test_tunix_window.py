"""Tunix's ring-cached Gemma 4 as the window/mixed peer (:mod:`jaxrl_sym.baselines.tunix_gemma4`).

Its weights are Tunix's random init (Gemma 4's block is not ours), so there is no token check
against our systems. What must hold for the speed comparison to mean anything: the peer really
keeps a ring smaller than the sequence in its local layers, decodes every row to its own limit,
and its ring decode computes what Tunix's full-size, window-masked cache computes on the same
weights (greedy tokens equal). Tests that run Tunix skip where it is not installed.
"""

from __future__ import annotations

from dataclasses import replace

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl_sym.baselines.tunix import tunix_available
from jaxrl_sym.baselines.tunix_gemma4 import TunixGemma4System, layer_kinds, ring_slots
from jaxrl_sym.errors import InputError
from jaxrl_sym.generation import GenerationConfig
from jaxrl_sym.models import LMConfig, init_model, preset
from jaxrl_sym.ops.attention import Block, Causal, Window

WINDOW, N = 8, 16  # 8 prompt slots + 16 new tokens: 24 positions through an 8-slot ring


def _model(mixed: bool) -> object:
    cfg = preset("tiny")
    pats = (LMConfig.mixed(WINDOW, n_layers=cfg.n_layers).patterns if mixed
            else (Window(WINDOW),) * cfg.n_layers)
    return init_model(replace(cfg, patterns=pats), seed=0)


def _randomise_mlp(system: TunixGemma4System) -> None:
    """Tunix initialises Gemma 4's MLP kernels to zero; random ones make the greedy tokens
    depend on every layer (a stronger oracle check). Done before the first call builds the
    Sampler, which captures the weights."""
    rng = np.random.default_rng(1)  # numpy: no eager JAX ops to compile
    for layer in system.tmodel.layers:
        for lin in (layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
            w = lin.kernel
            w.set_value(jnp.asarray(0.2 * rng.standard_normal(w.shape), w.dtype))


@pytest.fixture(scope="module")
def systems() -> dict[str, TunixGemma4System]:
    if not tunix_available():
        pytest.skip("google-tunix is not installed")
    out = {}
    for name, ring in (("ring", True), ("full", False)):
        out[name] = TunixGemma4System(_model(mixed=True), seed=3, ring=ring)
        _randomise_mlp(out[name])
    return out


@settings(max_examples=2, deadline=None)
@given(lens=st.lists(st.integers(5, 8), min_size=3, max_size=3),
       limits=st.lists(st.integers(1, N), min_size=2, max_size=2), seed=st.integers(0, 99))
def test_ring_decode_equals_full_cache_and_row_limits(systems, lens, limits, seed) -> None:
    """Every row gets exactly its limit, local layers hold an 8-slot ring while 24 positions
    pass, and the tokens equal Tunix's full-size masked cache on the same weights."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, 64, n).astype(np.int32) for n in lens]
    cfg = GenerationConfig(max_new_tokens=(N, *limits))  # the longest fixed: no new compiles
    ring = systems["ring"](prompts, cfg)
    full = systems["full"](prompts, cfg)
    assert [len(t) for t in ring.tokens] == [N, *limits]
    slots = ring.stats["ring_slots"]
    assert slots == [WINDOW, ring.stats["cache_size"]]  # mixed: local ring, global full
    assert ring.stats["cache_size"] == 8 + N > WINDOW
    assert ring_slots(systems["full"].tmodel, full.stats["cache_size"]) == [8 + N, 8 + N]
    for a, b in zip(ring.tokens, full.tokens, strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(ring.logprobs, full.logprobs, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-4)


def test_layer_kinds_and_refusals() -> None:
    """Window/mixed map to Gemma 4's local/global layers; what it cannot express is refused
    with the flag to change."""
    assert layer_kinds(_model(mixed=True)) == ((True, False), WINDOW)
    cfg = preset("tiny")
    with pytest.raises(InputError, match="--systems tunix"):
        layer_kinds(init_model(replace(cfg, patterns=(Causal(),) * cfg.n_layers)))
    with pytest.raises(InputError, match="Block"):
        layer_kinds(init_model(replace(cfg, patterns=(Block(4), Window(4)))))
    with pytest.raises(InputError, match="one --window"):
        layer_kinds(init_model(replace(cfg, patterns=(Window(4), Window(8)))))
