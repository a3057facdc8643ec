"""Length profiles (``jaxrl_sym.workloads``) and the suite's trace scenario at tiny sizes: the
JSONL loader rejects bad rows naming file and line, idle fraction matches hand-computed cases,
and a real replay's idle positions agree with the oracle counts. No timing is asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench import plots, suite_child, suite_report, suite_trace
from bench import suite_padding as sp
from jaxrl_sym.errors import InputError
from jaxrl_sym.workloads import (
    builtin_profiles,
    fixed_shape_positions,
    growing,
    idle_fraction,
    load_trace,
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
