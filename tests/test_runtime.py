"""The symbolic runtime against the padded baseline (the oracle): tokens and logits.

Property-based over prompt lengths, per-row limits, EOS positions, batch sizes, windows and
blocks. Engines are built once per model (tracing + compiling dominate); hypothesis then varies
the request, and shape buckets keep recompiles rare.
"""

from __future__ import annotations

from dataclasses import replace
from functools import cache

import numpy as np
import pytest
from flax import nnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxrl_sym.baselines.padded import padded_generate
from jaxrl_sym.generation import GenerationConfig
from jaxrl_sym.models.lm import DecoderLM, LMConfig, preset
from jaxrl_sym.ops.attention import Block, Causal, Linear, Window
from jaxrl_sym.passes.stores import BLOCK, RING, SLOT
from jaxrl_sym.runtime.engine import SymbolicLM
from jaxrl_sym.runtime.options import EngineOptions

PATTERNS = {
    "full": (Causal(),) * 2,
    "window": (Window(3),) * 2,
    "block": (Block(4),) * 2,
    "linear": (Linear(),) * 2,
    "mixed": (Window(2), Causal()),
}


@cache
def model_and_engine(kind: str, seed: int = 0) -> tuple[DecoderLM, SymbolicLM]:
    cfg = replace(preset("tiny"), patterns=PATTERNS[kind])
    model = DecoderLM(cfg, rngs=nnx.Rngs(seed))
    # compact_min_rows=1: these batches are small, and compaction must still be exercised
    return model, SymbolicLM(model, EngineOptions(min_capacity=4, compact_min_rows=1))


def _compare(kind: str, prompts, cfg: GenerationConfig):
    model, engine = model_and_engine(kind)
    sym = engine.generate(prompts, cfg)
    pad = padded_generate(model, prompts, cfg)
    for i, (a, b) in enumerate(zip(sym.tokens, pad.tokens, strict=True)):
        assert np.array_equal(a, b), f"row {i}: sym {a} vs padded {b}"
        np.testing.assert_allclose(sym.logprobs[i], pad.logprobs[i], atol=1e-4)
        if cfg.return_logits:
            np.testing.assert_allclose(sym.logits[i], pad.logits[i], atol=1e-4, rtol=0)
    return sym, pad


def _eos_for(kind: str, prompts, limit: int) -> int:
    """A token greedy decoding emits at different steps in different rows (so rows end apart)."""
    _, engine = model_and_engine(kind)
    free = engine.generate(prompts, GenerationConfig(max_new_tokens=limit))
    firsts: dict[int, set[int]] = {}
    for toks in free.tokens:
        seen: set[int] = set()
        for j, t in enumerate(toks.tolist()):
            if t not in seen:
                firsts.setdefault(t, set()).add(j)
                seen.add(t)
    return max(firsts, key=lambda t: (len(firsts[t]), -min(firsts[t])))


@pytest.mark.parametrize("kind", list(PATTERNS))
def test_greedy_matches_padded_with_eos_and_ragged_prompts(kind: str) -> None:
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 64, size=n).astype(np.int32) for n in (3, 7, 5, 12, 4)]
    eos = _eos_for(kind, prompts, 14)
    cfg = GenerationConfig(max_new_tokens=(14, 9, 14, 11, 6), eos_id=eos, return_logits=True)
    sym, _ = _compare(kind, prompts, cfg)
    lengths = {len(t) for t in sym.tokens}
    assert len(lengths) > 1, "rows should end at different steps"
    # exact lengths: no row carries tokens past its EOS or limit
    for t, lim in zip(sym.tokens, cfg.max_new_tokens, strict=True):
        assert len(t) <= lim
        assert eos not in t[:-1].tolist()


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kind=st.sampled_from(sorted(PATTERNS)),
    lens=st.lists(st.integers(1, 11), min_size=1, max_size=5),
    limit=st.integers(1, 12),
    seed=st.integers(0, 2**16),
    temperature=st.sampled_from([0.0, 0.8]),
)
def test_property_sym_equals_padded(kind, lens, limit, seed, temperature) -> None:
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, 64, size=n).astype(np.int32) for n in lens]
    limits = tuple(int(x) for x in rng.integers(1, limit + 1, size=len(lens)))
    cfg = GenerationConfig(max_new_tokens=limits, temperature=temperature, seed=seed,
                           eos_id=int(rng.integers(0, 64)), return_logits=True)
    _compare(kind, prompts, cfg)


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(window=st.integers(1, 6), block=st.integers(1, 6), n=st.integers(1, 9))
def test_property_window_and_block_sizes(window: int, block: int, n: int) -> None:
    cfg = replace(preset("tiny"), n_layers=2, patterns=(Window(window), Block(block)))
    model = DecoderLM(cfg, rngs=nnx.Rngs(3))
    engine = SymbolicLM(model, EngineOptions(min_capacity=2, compact_min_rows=1))
    prompts = [np.arange(n, dtype=np.int32) % 64, (np.arange(n + 2, dtype=np.int32) * 7) % 64]
    gcfg = GenerationConfig(max_new_tokens=8, return_logits=True)
    sym = engine.generate(prompts, gcfg)
    pad = padded_generate(model, prompts, gcfg)
    for a, b, la, lb in zip(sym.tokens, pad.tokens, sym.logits, pad.logits, strict=True):
        assert np.array_equal(a, b)
        np.testing.assert_allclose(la, lb, atol=1e-4, rtol=0)
    kinds = {s.kind for s in engine.plan.stores}
    assert {RING, BLOCK, SLOT} <= kinds


def test_stores_are_exact_size_not_max_len() -> None:
    _, engine = model_and_engine("window")
    specs = {s.kind.name: s.capacity for s in engine.specs.values()}
    assert specs == {"ring": 3}
    _, engine = model_and_engine("block")
    assert {s.capacity for s in engine.specs.values()} == {4}
    _, engine = model_and_engine("linear")
    assert {s.kind.name for s in engine.specs.values()} == {"state"}


def test_growth_and_compaction_happen_and_compile_count_is_logarithmic() -> None:
    _, engine = model_and_engine("full")
    prompts = [np.arange(3, dtype=np.int32)] * 4
    cfg = GenerationConfig(max_new_tokens=(40, 3, 3, 2))
    before = dict(engine.cache.compiled)
    r = engine.generate(prompts, cfg)
    new = [k[0] for k in engine.cache.compiled if k not in before]
    assert "grow" in new and "compact" in new
    # capacities 8,16,32,64 and batches 4,1: far fewer programs than the 40 steps
    assert r.stats["program_compiles"] <= 14
    # tiles of 8 decode steps: one dispatch (and one host sync) per tile, not per token
    assert 40 // engine.plan.tiling.base <= r.stats["dispatches"] < 40


def test_decode_tiles_give_the_tokens_of_single_steps() -> None:
    """Rows ending (EOS or limit) inside a tile, compaction and growth between tiles: a tiled
    run must return exactly what one dispatch per token returns."""
    model, _ = model_and_engine("full")
    prompts = [np.arange(1, 4, dtype=np.int32), np.arange(2, 9, dtype=np.int32),
               np.arange(5, 7, dtype=np.int32)]
    cfg = GenerationConfig(max_new_tokens=(37, 11, 5), eos_id=7, temperature=1.0, seed=3,
                           return_logits=True)
    runs = [SymbolicLM(model, EngineOptions(min_capacity=8, decode_tile=t, compact_min_rows=1))
            .generate(prompts, cfg) for t in (1, 8)]
    assert runs[1].stats["dispatches"] < runs[0].stats["dispatches"]
    for a, b, la, lb, ga, gb in zip(runs[0].tokens, runs[1].tokens, runs[0].logprobs,
                                    runs[1].logprobs, runs[0].logits, runs[1].logits,
                                    strict=True):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_allclose(la, lb, atol=1e-5)
        np.testing.assert_allclose(ga, gb, atol=1e-5)


def test_mixed_config_helper_interleaves() -> None:
    cfg = LMConfig.mixed(4, n_layers=4)
    assert [type(p).__name__ for p in cfg.layer_patterns()] == ["Window", "Causal"] * 2


@settings(max_examples=50, deadline=None)
@given(
    lens=st.lists(st.integers(1, 300), min_size=1, max_size=20),
    limit=st.integers(1, 2000),
    frac=st.sampled_from([0.0, 0.05, 0.1, 0.5]),
    rows=st.sampled_from([None, 1, 3]),
)
def test_property_microbatches_partition_and_bound_padding(lens, limit, frac, rows) -> None:
    from jaxrl_sym.runtime.engine import microbatches

    limits = [limit] * len(lens)
    groups = microbatches(lens, limits, max_rows=rows, max_pad_fraction=frac)
    assert sorted(i for g in groups for i in g) == list(range(len(lens)))
    for g in groups:
        assert rows is None or len(g) <= rows
        top = max(lens[i] for i in g)
        pad = sum(top - lens[i] for i in g)
        assert pad <= frac * sum(top + limit for _ in g) or len(g) == 1


def test_microbatches_keep_long_generations_together() -> None:
    from jaxrl_sym.runtime.engine import microbatches

    # 16 tokens of prompt padding next to 1024 generated tokens: one group, one set of programs
    assert len(microbatches([8, 24, 9, 22], [1024] * 4, max_rows=None,
                            max_pad_fraction=0.1)) == 1
    # short generations after very different prompts: split
    assert len(microbatches([4, 200], [4, 4], max_rows=None, max_pad_fraction=0.1)) == 2


def test_growth_is_one_store_at_a_time_and_frees_each_old_store() -> None:
    """Growing every layer in one program kept all old and new buffers live together (sym's peak
    was 2x its final store on an H100). Each store now grows in its own program and replaces its
    old buffers at once; the meter sees the transient: at most one old store on top of the new."""
    import gc
    import weakref

    import jax

    from jaxrl_sym.runtime.group.loop import DecodeGroup
    from jaxrl_sym.runtime.metrics import MemoryMeter, tree_bytes

    cfg = replace(preset("tiny"), n_layers=4, patterns=(Causal(),) * 4)
    engine = SymbolicLM(DecoderLM(cfg, rngs=nnx.Rngs(3)),
                        EngineOptions(min_capacity=4, compact_min_rows=1))
    stores = jax.jit(engine.builder.init_stores, static_argnums=(0, 1))(2, 8)
    stores = {n: {k: (a + 1 if k != "pos" else a.at[:, :3].set(np.arange(3)))
                  for k, a in s.items()} for n, s in stores.items()}
    expect = {n: {k: np.array(a, copy=True) for k, a in s.items()} for n, s in stores.items()}
    one_old = max(tree_bytes(s) for s in stores.values())
    # the growing stores' arrays (the feedback edge's slot store does not grow)
    refs = [weakref.ref(a) for n, s in stores.items() if n in engine.plan.growing
            for a in s.values()]
    assert len(refs) == 4 * 3
    meter = MemoryMeter()
    prompts = [np.arange(3, dtype=np.int32)] * 2
    group = DecodeGroup(engine.plan, engine.cache, [0, 1], prompts, np.array([5, 5]),
                        GenerationConfig(max_new_tokens=5), meter, weights_bytes=0)
    group.stores = stores
    meter.samples.clear()
    meter.peak = 0
    del stores
    group.grow(16)
    stores = group.stores
    gc.collect()
    assert len(engine.plan.growing) == 4 and group.capacity == 16
    assert all(r() is None for r in refs)  # nothing keeps an old store alive
    temp = max(v for k, v in engine.cache.temp_bytes.items() if k[0] == "grow")
    assert meter.peak <= tree_bytes(stores) + one_old + temp
    assert len(meter.samples) == 4  # one observation per store program
    for n in engine.plan.growing:
        s = stores[n]
        assert s["pos"].shape[1] == 16 and s["k"].shape[2] == 16  # k: [B, Hkv, C, D]
        np.testing.assert_array_equal(np.asarray(s["k"])[:, :, :8], expect[n]["k"])
        np.testing.assert_array_equal(np.asarray(s["pos"])[:, 8:], -1)
