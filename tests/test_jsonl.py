"""Strict JSON out (issue 29): no record this package prints or logs holds a bare NaN or
Infinity, which are not JSON; checked with a parser that refuses them."""

from __future__ import annotations

import json
import math
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from jaxrl_sym.jsonl import dumps


def _strict(text: str) -> Any:
    def refuse(name: str) -> Any:
        raise ValueError(f"not JSON: {name}")

    return json.loads(text, parse_constant=refuse)


records = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner,
                                                                max_size=4),
    max_leaves=20)


@given(records)
def test_dumps_is_strict_json_and_keeps_every_finite_value(obj: Any) -> None:
    back = _strict(dumps(obj))

    def same(a: Any, b: Any) -> bool:
        if isinstance(a, float) and not math.isfinite(a):
            return b is None
        if isinstance(a, dict):
            return set(a) == set(b) and all(same(a[k], b[k]) for k in a)
        if isinstance(a, list | tuple):
            return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
        return a == b

    assert same(obj, back)


def test_metrics_with_nulls_read_back_and_plot(tmp_path) -> None:
    """Metrics lines now carry null where a value was not finite: reading and plotting a run
    with such lines works (the plot leaves the gap)."""
    from jaxrl_sym.rl.run.plot import plot_run, read_metrics

    m = tmp_path / "m.jsonl"
    rows = [{"step": k, "reward": 0.1 * k, "kl": float("nan") if k == 2 else 0.01 * k,
             "exact_match": 0.0, "response_len": 3.0, "entropy": 1.0, "loss": 0.5,
             "grad_norm": float("inf") if k == 3 else 1.0,
             "seconds": {"generation": 0.1, "update": 0.2}} for k in range(1, 5)]
    m.write_text("".join(dumps(r) + "\n" for r in rows))
    back = read_metrics(m)
    assert back[1]["kl"] is None and back[2]["grad_norm"] is None and back[3]["kl"] == 0.04
    out = plot_run(back, str(tmp_path / "p.png"), "nulls")
    assert (tmp_path / "p.png").stat().st_size > 0 and out == str(tmp_path / "p.png")


# ------------------------------------------------------------------ JSON lines in


@given(st.lists(st.dictionaries(st.text(max_size=4), st.text(max_size=8), max_size=3),
                min_size=1, max_size=5), st.booleans())
def test_read_lines_returns_what_json_wrote(tmp_path_factory, recs, crlf: bool) -> None:
    """Any strings, U+2028/U+2029/U+0085 included (JSON lets them stand unescaped and
    ``splitlines`` broke lines at them), come back as the stdlib wrote them."""
    from jaxrl_sym.jsonl import read_lines

    path = tmp_path_factory.mktemp("jl") / "r.jsonl"
    end = "\r\n" if crlf else "\n"
    path.write_bytes((end.join(json.dumps(r, ensure_ascii=False) for r in recs) + end)
                     .encode())
    got = read_lines(path, "test file")
    assert [json.loads(line) for _, line in got] == recs
    assert [n for n, _ in got] == list(range(1, len(recs) + 1))


def test_unicode_line_separator_inside_a_prompt_loads(tmp_path) -> None:
    from jaxrl_sym.rl.tasks.text_tasks import load_problems

    path = tmp_path / "t.jsonl"
    path.write_text('{"prompt": "two\u2028lines\u0085and\u2029more", "answer": 4}\n\n'
                    '{"prompt": "b", "answer": 2}\n', encoding="utf-8")
    probs = load_problems(path)
    assert [p.prompt for p in probs] == ["two\u2028lines\u0085and\u2029more", "b"]


def test_bytes_that_are_not_utf8_name_file_line_and_column(tmp_path) -> None:
    import pytest

    from jaxrl_sym.errors import InputError
    from jaxrl_sym.rl.tasks.text_tasks import load_problems
    from jaxrl_sym.workloads import load_trace

    task = tmp_path / "t.jsonl"
    task.write_bytes(b'{"prompt": "a", "answer": 1}\n{"prompt": "caf\xe9", "answer": 2}\n')
    with pytest.raises(InputError, match=r"t\.jsonl:2: bytes that are not UTF-8 at column 16 "
                                         r".*save the task file as UTF-8"):
        load_problems(task)
    trace = tmp_path / "tr.jsonl"
    trace.write_bytes(b'\xff{"prompt_len": 2, "response_len": 3}\n')
    with pytest.raises(InputError, match=r"tr\.jsonl:1: bytes that are not UTF-8 .*--trace"):
        load_trace(trace, batch=1)
