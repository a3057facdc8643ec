"""The memory ledger: its arithmetic, XLA's program sizes as it reads them, and its agreement
with what an RL step actually holds on this machine (RSS sampled during the step)."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from jaxrl_sym.runtime.memory.ledger import KINDS, Buffer, Ledger, Moment, ProgramSize, tree_nbytes

ROOT = Path(__file__).resolve().parent.parent

buffers = st.lists(st.builds(Buffer, st.text(min_size=1, max_size=8), st.sampled_from(KINDS),
                             st.integers(0, 1 << 40)), max_size=6)


@given(st.lists(st.tuples(st.sampled_from(["generation", "reference", "update"]), buffers),
                min_size=1, max_size=8))
def test_peak_is_the_largest_sum_and_kinds_add_up(moments: list) -> None:
    ms = tuple(Moment(stage, f"m{i}", tuple(bs)) for i, (stage, bs) in enumerate(moments))
    ledger = Ledger("toy", ms)
    totals = [sum(b.nbytes for b in bs) for _, bs in moments]
    assert ledger.peak().total == max(totals)
    for m in ms:
        assert sum(m.by_kind().values()) == m.total
    stages = ledger.stage_peaks()
    for stage, m in stages.items():
        assert m.total == max(t for (s, _), t in zip(moments, totals, strict=True) if s == stage)
    assert ledger.to_dict()["peak"]["total"] == max(totals)


def test_bad_buffers_are_refused() -> None:
    with pytest.raises(ValueError, match="kind"):
        Buffer("x", "cache", 1)
    with pytest.raises(ValueError, match="negative"):
        Buffer("x", "store", -1)
    with pytest.raises(ValueError, match="no moments"):
        Ledger("empty", ()).peak()


def test_program_size_reads_xla_and_counts_aliased_outputs_once() -> None:
    """Arguments and outputs are exact byte counts of the shapes (numpy's arithmetic); a donated
    argument's aliased output is not a second allocation."""
    x = jax.ShapeDtypeStruct((256, 128), jnp.float32)
    size = ProgramSize.of("f", jax.jit(lambda a: (a @ a.T).sum()).lower(x).compile())
    assert size.args == 256 * 128 * 4 and size.out == 4
    assert size.flops >= 2 * 256 * 256 * 128 * 0.9
    donated = jax.jit(lambda a: a * 2, donate_argnums=0).lower(x).compile()
    d = ProgramSize.of("g", donated)
    fresh = {b.kind: b.nbytes for b in d.buffers()}["program_out"]
    assert d.alias in (0, d.out) and fresh == d.out - d.alias
    assert tree_nbytes({"a": np.zeros((3, 5), np.float16), "b": [x]}) == 30 + 256 * 128 * 4


# --------------------------------------------------------------------------- generation ledger


def _engine_view(m: dict) -> int:
    """A ledger moment as the engine's own meter counts it (weights, stores, the running
    program's temporaries; a growth's new store and a prompt cache's entries too: the meter
    counts them as held once the program ran), without other outputs, batch or host lists."""
    kinds = m["by_kind"]
    fresh = m["stage"] == "grow" or m.get("what", "").startswith("prompt_cache")
    out = kinds.get("program_out", 0) if fresh else 0
    return kinds.get("weights", 0) + kinds.get("store", 0) + kinds.get("program_temp", 0) + out


def _request() -> tuple:
    """A tiny model and a request whose rows end at different limits (the growing stores
    double once)."""
    from jaxrl_sym import GenerationConfig
    from jaxrl_sym.models.lm import init_model, preset

    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 50, size=n, dtype=np.int32) for n in (3, 9, 5, 12)]
    return init_model(preset("tiny"), 0), prompts, GenerationConfig(max_new_tokens=(40, 150,
                                                                                      7, 90))


def test_sym_generation_ledger_follows_the_engine() -> None:
    """The generation ledger walks the same dispatches, stores and programs as a real run: its
    largest moment, counted as the engine's own meter counts, is the meter's peak of a real
    generation; the dispatches and decode steps are what the engine ran."""
    from jaxrl_sym import SymbolicLM
    from jaxrl_sym.runtime.memory.ledger_generation import sym_ledger

    model, prompts, cfg = _request()
    lm = SymbolicLM(model)
    gl = sym_ledger(lm.plan, lm.leaves, prompts, cfg)
    res = lm.generate(prompts, cfg)
    # XLA's output size may count the output tuple's pointer table (8 bytes a leaf): a grow's
    # new store is then 24 bytes more in the ledger than the engine's exact array bytes
    ledger_peak = max(_engine_view({"stage": m.stage, "by_kind": m.by_kind()})
                      for m in gl.ledger.moments)
    assert 0 <= ledger_peak - res.stats["accounted_peak_bytes"] <= 8 * 16, \
        gl.ledger.to_dict()["peak"]
    decode = [r for r in gl.runs if r.stage == "decode"]
    # whole checks of the tiling's base: the last check may run past the longest row
    over = sum(r.steps for r in decode) - (max(cfg.max_new_tokens) - 1)
    assert 0 <= over < lm.plan.tiling.base, over
    # the engine also ran its hoist and init programs, which the ledger lists as buffers
    assert gl.dispatches + 2 == res.stats["dispatches"]


def test_padded_generation_ledger_is_its_accounted_bytes() -> None:
    """padded's ledger is padded_generate's accounted bytes (weights, inputs, MAX_LEN caches
    and outputs, XLA's temporaries); XLA also counts its output tuple's pointer table."""
    from jaxrl_sym import padded_generate
    from jaxrl_sym.baselines.padded_ledger import padded_ledger

    model, prompts, cfg = _request()
    pad = padded_ledger(model, prompts, cfg)
    measured = padded_generate(model, prompts, cfg).stats["accounted_bytes"]
    assert 0 <= pad.ledger.peak().total - measured <= 8 * 16, (pad.ledger.peak(), measured)
    assert [r.steps for r in pad.runs] == [1, max(cfg.max_new_tokens) - 1]


def test_the_ledgers_stores_are_the_bytes_their_shapes_hold() -> None:
    """An oracle outside the library: every moment's store bytes summed by hand from the
    model's config (per layer: keys and values of ``n_kv_heads x head_dim`` float32 and an int32
    position per slot, at the group's rows x capacity the moment names; the feedback edge's one
    int32 token per row), and the weights from the parameters' own shapes. Where the ledger met
    the process's RSS (within 7% on three models, ``bench/results/cpu/ledger_models.md``) is a
    benchmark, ``python -m bench project --measure``: an RSS band cannot be a test."""
    import re

    from jaxrl_sym import SymbolicLM
    from jaxrl_sym.runtime.memory.ledger_generation import sym_ledger

    model, prompts, cfg = _request()
    c = model.cfg
    lm = SymbolicLM(model)
    gl = sym_ledger(lm.plan, lm.leaves, prompts, cfg)
    per_slot = c.n_layers * (2 * c.n_kv_heads * c.head_dim * 4 + 4)
    weights = sum(int(np.prod(np.shape(x))) * np.dtype(x.dtype).itemsize for x in lm.leaves)
    shapes = 0
    for m in gl.ledger.moments:
        kinds = m.by_kind()
        assert kinds["weights"] >= weights  # the caller's weights (and hoisted values)
        got = re.fullmatch(r"stores (\d+)x(\d+)", m.what)
        if got:
            rows, cap = map(int, got.groups())
            assert kinds["store"] == rows * cap * per_slot + rows * 4, (m.what, kinds)
            shapes += 1
    assert shapes >= 1


def test_reference_chunks_join_generation_only_after_rows_finished() -> None:
    """The RL step's generation moment over a walk: reference chunks in flight are added only to
    moments after the overlap's first chunk can exist (``chunk_waits_for`` rows finished);
    an estimate (every row to its limit) gets them at its one moment."""
    from jaxrl_sym.rl.step.ledger import _generation_moment
    from jaxrl_sym.runtime.memory.estimate import Estimate
    from jaxrl_sym.runtime.memory.ledger import Buffer, Ledger, moment
    from jaxrl_sym.runtime.memory.ledger_generation import WEIGHTS, GenerationLedger
    from jaxrl_sym.systems.overlap import OVERLAP_ROWS, chunk_waits_for

    held = [Buffer("state", "weights", 100)]
    chunks = [Buffer("chunk 1", "program_temp", 30), Buffer("chunk 2", "program_temp", 30)]
    w = Buffer(WEIGHTS, "weights", 1000)  # the caller's: dropped from the walk's moments
    start = moment("prefill", "p", [w, Buffer("stores", "store", 50)])
    tail = moment("decode", "d", [w, Buffer("stores", "store", 20)])
    need = chunk_waits_for(OVERLAP_ROWS)
    for fin_tail, want in ((need - 1, 150), (need, 180)):
        walk = GenerationLedger(Ledger("sym", (start, tail)), (), 0, 0, (0, fin_tail))
        got = _generation_moment(held, walk, chunks, need)
        assert got.total == want, (fin_tail, got)
    est = Estimate("sym", 1000, 50, 0, 0, 0, "-", "-")
    assert _generation_moment(held, est, chunks, need).total == 100 + 50 + 60


@pytest.mark.parametrize("rows", [3, 4])
def test_refill_ledger_bounds_the_engine_from_above(rows: int) -> None:
    """With refill the ledger walks representative moments (the prompt cache's largest chunk,
    the fill of every row, a decode tile, a refill of every resident row): its largest, as the
    engine's meter counts, is at least the meter's peak of a real run and not far above it
    (the run's refills are smaller or equal)."""
    from jaxrl_sym import GenerationConfig, SymbolicLM
    from jaxrl_sym.models.lm import init_model, preset
    from jaxrl_sym.runtime.options import EngineOptions

    rng = np.random.default_rng(rows)
    prompts = [rng.integers(0, 50, size=n, dtype=np.int32) for n in rng.integers(2, 14, 12)]
    cfg = GenerationConfig(max_new_tokens=tuple(int(x) for x in rng.integers(2, 30, 12)))
    lm = SymbolicLM(init_model(preset("tiny"), 0), EngineOptions(microbatch_rows=rows,
                                                                 refill=True))
    gl = lm.ledger(prompts, cfg)
    stages = [m.stage for m in gl.ledger.moments]
    assert stages[0] == "init" and stages[-2:] == ["decode", "refill"]
    assert stages[1:-2] == ["prefill", "refill"] * ((len(stages) - 3) // 2)
    walked = max(_engine_view({"stage": m.stage, "what": m.what, "by_kind": m.by_kind()})
                 for m in gl.ledger.moments)
    measured = lm.generate(prompts, cfg).stats["accounted_peak_bytes"]
    assert measured <= walked <= 1.25 * measured, (walked, measured)
