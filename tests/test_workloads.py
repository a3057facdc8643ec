"""Length profiles (``jaxrl_sym.workloads``) and the suite's trace scenario at tiny sizes: the
JSONL loader rejects bad rows naming file and line, idle fraction matches hand-computed cases,
and a real replay's idle positions agree with the oracle counts. No timing is asserted."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from bench.lib import plots
from bench.lib.suite import suite_child, suite_report, suite_trace
from bench.lib.suite import suite_padding as sp
from jaxrl_sym.errors import InputError
from jaxrl_sym.workloads import (
    REASONING_CAPS,
    Step,
    builtin_profiles,
    fixed_shape_positions,
    growing,
    idle_fraction,
    length_stats,
    load_trace,
    reasoning,
    reasoning_growing,
    reasoning_median,
    reasoning_tail,
    skewed,
)


def _write(tmp_path: Path, lines: list[str]) -> Path:
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


@pytest.mark.parametrize("line, what", [
    ('{"prompt_len": 3}', "'response_len'"),
    ('{"prompt_len": 0, "response_len": 2}', "'prompt_len'"),
    ('{"prompt_len": 2.5, "response_len": 2}', "'prompt_len'"),
    ('{"prompt_len": true, "response_len": 2}', "'prompt_len'"),
    ('{"prompt_len": 2, "response_len": "7"}', "'response_len'"),
    ("[1, 2]", "expected an object"),
    ("{not json", "not valid JSON"),
    ('{"prompt_len": 2, "response_len": 2, "step": -1}', "'step'"),
])
def test_trace_loader_rejects_bad_rows_naming_file_and_line(tmp_path: Path, line: str,
                                                            what: str) -> None:
    p = _write(tmp_path, ['{"prompt_len": 4, "response_len": 5}', "", line])
    with pytest.raises(InputError, match=rf"{p}:3: .*{what}|{p}:3: {what}"):
        load_trace(p, batch=2)


def test_trace_loader_file_level_errors(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="no such file"):
        load_trace(tmp_path / "missing.jsonl", batch=2)
    with pytest.raises(InputError, match="no rows"):
        load_trace(_write(tmp_path, [""]), batch=2)
    mixed = ['{"prompt_len": 1, "response_len": 1, "step": 0}',
             '{"prompt_len": 1, "response_len": 1}']
    with pytest.raises(InputError, match="every row or on none"):
        load_trace(_write(tmp_path, mixed), batch=2)


def test_trace_loader_groups_and_scales(tmp_path: Path) -> None:
    flat = load_trace(_write(tmp_path, [json.dumps({"prompt_len": p, "response_len": r})
                                        for p, r in [(4, 9), (5, 1), (6, 16)]]), batch=2,
                      scale=4)
    assert [(s.prompt_lens, s.response_lens) for s in flat.steps] == [
        ((1, 2), (3, 1)), ((2,), (4,))]  # ceil(x / 4), at least 1; last step smaller
    stepped = load_trace(_write(tmp_path, [
        '{"step": 1, "prompt_len": 2, "response_len": 3}',
        '{"step": 0, "prompt_len": 7, "response_len": 8}',
        '{"step": 1, "prompt_len": 4, "response_len": 5}']), batch=99)
    assert [(s.prompt_lens, s.response_lens) for s in stepped.steps] == [
        ((7,), (8,)), ((2, 4), (3, 5))]


def test_idle_fraction_hand_computed() -> None:
    # prompts 2 and 4, responses 3 and 1: needed (2+3-1) + (4+1-1) = 8 positions.
    # padded: prompt block 2 x 4 = 8, plus 2 rows x (3 - 1) decode steps = 4 -> 12 computed.
    assert fixed_shape_positions([2, 4], [3, 1]) == (8, 12)
    assert idle_fraction(8, 12) == pytest.approx(1 / 3)
    assert idle_fraction(5, 5) == 0.0 and idle_fraction(0, 0) == 0.0


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(1, 60)), min_size=1, max_size=9))
def test_fixed_shape_positions_match_the_padded_count(rows: list[tuple[int, int]]) -> None:
    prompts, limits = [p for p, _ in rows], [r for _, r in rows]
    w = sp.padded_work(prompts, limits, [sp.Layer("full")])
    assert fixed_shape_positions(prompts, limits) == (w.tokens_needed, w.tokens_computed)


def test_profiles_are_deterministic_and_shaped() -> None:
    a = builtin_profiles(batch=5, steps=2, growing_steps=4, scale=8, seed=3)
    b = builtin_profiles(batch=5, steps=2, growing_steps=4, scale=8, seed=3)
    assert [p.digest() for p in a] == [p.digest() for p in b]
    assert [p.name for p in a] == ["math", "code", "chat", "growing"]
    for p in a:
        assert all(len(s.prompt_lens) == len(s.response_lens) == 5 for s in p.steps)
    g = growing(batch=200, steps=3, medians=(10, 100), cap=10_000)
    med = [sorted(s.response_lens)[100] for s in g.steps]
    assert med[0] < med[1] < med[2] and 5 < med[2] / med[0] < 20  # ~10x
    with pytest.raises(InputError, match="unknown"):
        skewed("poetry", batch=2, steps=1)


def test_real_replay_idle_positions(tmp_path: Path) -> None:
    """sym's idle positions come from the engine's own log: its needed positions, summed over
    the replayed steps, must equal the hand count (the padded count is checked above)."""
    steps = [([3, 5, 2], [4, 1, 6]), ([2, 4], [3, 5])]
    cfg = {"preset": "tiny", "seed": 0, "scenario": "trace", "attention": "full", "window": 8,
           "block": 8, "profile": "t", "steps": 2, "system": "sym-xla"}
    needed = sum(fixed_shape_positions(p, r)[0] for p, r in steps)  # 3+4+5+2+... - 1 each
    assert needed == (6 + 5 + 7) + (4 + 8)
    row = {**cfg, "status": "ok", "useful_tokens": 19,
           **suite_child.run_trace({**cfg, "steps": steps, "warm": False})}
    row = suite_trace.finish_row(row, steps)
    assert row["generated_tokens"] == 19
    assert row["needed_positions"] == needed
    assert row["token_positions"] >= needed
    assert row["idle_fraction"] == pytest.approx(1 - needed / row["token_positions"])


def test_trace_rows_render(tmp_path: Path) -> None:
    base = {"scenario": "trace", "steps": 1, "useful_tokens": 10, "max_limit": 6,
            "description": "d", "device": "cpu", "date": "2026-01-01", "preset": "tiny"}
    rows = [{**base, "profile": "math", "system": "padded", "status": "ok",
             "idle_fraction": 0.5, "useful_tokens_per_s": 10.0, "seconds": 1.0,
             "seconds_with_compile": 2.0, "xla_compiles": 2, "peak_bytes": 2**20},
            {**base, "profile": "math", "system": "sym-xla", "status": "error"}]
    md = suite_report.render_markdown(rows)
    assert "| math | 1 | 10 | 6 | padded | 50 |" in md and "**error**" in md
    assert plots.plot_all(rows, tmp_path) == [tmp_path / "trace_idle.png"]


# The reasoning profile. Oracles: tail probabilities from scipy / math.erf on the parameters the
# test passes, statistics from numpy on the returned lengths; nothing is taken from the module.
SIGMA, PROMPT, N = 1.2, (150.0, 0.6, 2048), 4000


def _arrays(step: Step) -> tuple[np.ndarray, np.ndarray]:
    return np.asarray(step.prompt_lens), np.asarray(step.response_lens)


def test_reasoning_caps_are_4k_to_32k() -> None:
    assert REASONING_CAPS == (4096, 8192, 16384, 32768)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), cap=st.sampled_from([4096, 8192, 16384, 32768]),
       frac=st.floats(1 / 64, 1 / 8), rho=st.floats(-0.5, 0.8))
def test_reasoning_realises_the_asked_distribution(seed: int, cap: int, frac: float,
                                                   rho: float) -> None:
    median = frac * cap
    step = reasoning(N, cap=cap, median=median, sigma=SIGMA, correlation=rho, prompt=PROMPT,
                     seed=seed)
    p, r = _arrays(step)
    assert p.shape == r.shape == (N,)
    assert r.min() >= 1 and r.max() <= cap and p.min() >= 1 and p.max() <= PROMPT[2]
    assert all(type(x) is int for x in step.response_lens + step.prompt_lens)
    assert abs(np.median(r) / median - 1) < 0.15
    at_cap = float(np.mean(r == cap))
    tail = float(stats.norm.sf(math.log(cap / median) / SIGMA))  # P(lognormal > cap)
    assert abs(at_cap - tail) <= 4 * math.sqrt(tail * (1 - tail) / N) + 0.003
    corr = float(np.corrcoef(np.log(p), np.log(r))[0, 1])
    assert abs(corr - rho) <= 0.08
    got = length_stats(step, cap=cap)
    assert got.rows == N and got.truncated == at_cap
    assert got.median == float(np.median(r)) and got.mean == pytest.approx(float(r.mean()))
    assert got.p99 == pytest.approx(float(np.percentile(r, 99)))
    assert got.correlation == pytest.approx(corr)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**32 - 2), cap=st.sampled_from([4096, 8192, 16384, 32768]))
def test_reasoning_is_deterministic_per_seed(seed: int, cap: int) -> None:
    a, b = reasoning(500, cap=cap, seed=seed), reasoning(500, cap=cap, seed=seed)
    assert a == b
    c = reasoning(500, cap=cap, seed=seed + 1)
    assert a.prompt_lens != c.prompt_lens and a.response_lens != c.response_lens
    g = reasoning_growing(batch=50, steps=3, cap=cap, seed=seed)
    assert g.digest() == reasoning_growing(batch=50, steps=3, cap=cap, seed=seed).digest()
    assert g.digest() != reasoning_growing(batch=50, steps=3, cap=cap, seed=seed + 1).digest()


@settings(max_examples=20, deadline=None)
@given(median=st.floats(1.0, 1e4), sigma=st.floats(0.1, 3.0),
       cap=st.sampled_from([4096, 8192, 16384, 32768]))
def test_reasoning_tail_is_the_lognormal_tail(median: float, sigma: float, cap: int) -> None:
    z = (math.log(cap) - math.log(median)) / sigma
    assert reasoning_tail(median, sigma, cap) == pytest.approx(
        0.5 * (1 - math.erf(z / math.sqrt(2))), abs=1e-12)


def test_reasoning_defaults_at_16k() -> None:
    """The documented defaults: median cap / 16 = 1024, ~1% truncated (p99 at the cap)."""
    step = reasoning(N, cap=16384, seed=0)
    p, r = _arrays(step)
    assert abs(np.median(r) / 1024 - 1) < 0.15 and abs(np.median(p) / 150 - 1) < 0.15
    assert abs(float(np.mean(r == 16384)) - stats.norm.sf(math.log(16) / 1.2)) < 0.006
    assert abs(float(np.corrcoef(np.log(p), np.log(r))[0, 1]) - 0.3) <= 0.08


@settings(max_examples=20, deadline=None)
@given(steps=st.integers(2, 60), start=st.floats(1.0, 5000.0))
def test_reasoning_schedule_rises_10x_monotonically(steps: int, start: float) -> None:
    meds = [reasoning_median(k, steps, median_start=start) for k in range(steps)]
    assert meds[0] == pytest.approx(start) and meds[-1] == pytest.approx(10 * start)
    assert all(a < b for a, b in itertools.pairwise(meds))
    ratios = [b / a for a, b in itertools.pairwise(meds)]  # geometric: equal ratios
    assert ratios == pytest.approx([10 ** (1 / (steps - 1))] * (steps - 1))


def test_reasoning_growing_realises_the_schedule() -> None:
    prof = reasoning_growing(batch=2000, steps=4, cap=32768, seed=5)
    meds = [float(np.median(s.response_lens)) for s in prof.steps]
    assert all(a < b for a, b in itertools.pairwise(meds))
    assert 10 / 1.3 < meds[-1] / meds[0] < 10 * 1.3
    assert abs(meds[-1] / 2048 - 1) < 0.15  # last step reaches the static default cap / 16
    assert all(max(s.response_lens) <= 32768 and min(s.response_lens) >= 1 for s in prof.steps)


@pytest.mark.parametrize("kw, what", [
    ({"correlation": 1.5}, "correlation"), ({"median": 0.0}, "median"),
    ({"cap": 0}, "cap"), ({"sigma": -1.0}, "sigma"),
])
def test_reasoning_refuses_bad_parameters(kw: dict, what: str) -> None:
    with pytest.raises(InputError, match=what):
        reasoning(10, **kw)
    with pytest.raises(InputError, match="step"):
        reasoning_median(3, 3, median_start=10.0)
