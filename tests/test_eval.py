"""``jaxrl-sym eval``: greedy completions are the plain model's (re-run on the whole sequence,
``zoo.naive_generate``), the rewards are the user's function's values on them, pass@k is the
count over subsets, and bad flags are refused before the model is loaded."""

from __future__ import annotations

import itertools
import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from jaxrl_sym.cli import main
from jaxrl_sym.rl.run.evaluate import EvalConfig, pass_at_k
from tests.zoo import naive_generate

MODEL = Path(__file__).parent / "fixtures" / "text" / "chatml_qwen2"
ROWS = [{"question": f"What is {a} + {b}?", "answer": f"{a} and {b} make {a + b}.\n#### {a + b}"}
        for a, b in [(3, 4), (12, 5), (9, 30)]]
REWARD = '''
import json

def score(prompts, completions, answer, **fields):
    with open("calls.jsonl", "a") as f:
        f.write(json.dumps({"completions": completions, "answer": answer}) + "\\n")
    return [float(len(c) % 3) for c in completions]
'''


@given(st.integers(1, 8).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n),
                                                      st.integers(1, n))))
def test_pass_at_k_counts_the_subsets_with_a_correct_sample(nck: tuple[int, int, int]) -> None:
    n, c, k = nck
    right = [i < c for i in range(n)]
    subsets = list(itertools.combinations(right, k))
    assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))


def test_pass_at_k_ks() -> None:
    assert EvalConfig(samples=8).ks() == [1, 2, 4, 8]
    assert EvalConfig(samples=5).ks() == [1, 2, 4, 5]
    assert EvalConfig().ks() == []


@pytest.fixture
def cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    yield tmp_path
    sys.modules.pop("ev_rec", None)


def test_greedy_is_the_plain_models_and_the_reward_is_yours(
        cwd: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (cwd / "ev_rec.py").write_text(REWARD)
    rc = main(["eval", "--model", str(MODEL), "--dataset", "d.jsonl", "--reward", "ev_rec:score",
               "--max-new-tokens", "5", "--samples", "2", "--rows", "rows.jsonl"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    summary = json.loads(out.out.strip().splitlines()[-1])
    rows = [json.loads(line) for line in (cwd / "rows.jsonl").read_text().splitlines()]
    assert summary["rows"] == len(rows) == len(ROWS) and summary["system"] == "sym"

    from jaxrl_sym.models.hf import load_pretrained
    from jaxrl_sym.models.hf.text import HFText, find_eos_ids

    model = load_pretrained(MODEL)[0]
    text = HFText(MODEL)
    eos = set(find_eos_ids(MODEL, text.tokenizer))
    for r, src in zip(rows, ROWS, strict=True):
        ids = np.asarray(text.encode_chat([{"role": "user", "content": src["question"]}]),
                         np.int32)
        want, _ = naive_generate(model, ids, 5)
        want = [int(t) for t in want]
        cut = next((i + 1 for i, t in enumerate(want) if t in eos), len(want))
        assert r["completion"] == text.decode(want[:cut])
        assert r["reward"] == float(len(r["completion"]) % 3)
        assert r["answer"] == str(src["answer"].split("#### ")[1])
        nums = re.findall(r"-?\d+", r["completion"])  # '#### N' or the last number
        assert r["correct"] == float(bool(nums) and nums[-1] == r["answer"])
    assert summary["greedy"]["reward"] == pytest.approx(np.mean([r["reward"] for r in rows]))
    calls = [json.loads(line) for line in (cwd / "calls.jsonl").read_text().splitlines()]
    assert len(calls) == len(ROWS) * (1 + 2)  # greedy, then 2 samples per row
    sampled = [float(len(c["completions"][0]) % 3) for c in calls[len(ROWS):]]
    assert summary["sampled"]["reward"] == pytest.approx(np.mean(sampled))
    assert set(summary["sampled"]) >= {"pass@1", "pass@2"}


@pytest.mark.parametrize("flags,message", [
    (["--samples", "-1"], "--samples -1: give a whole number >= 0"),
    (["--temperature", "0"], "--temperature 0.0: pass@k samples"),
    (["--step", "3"], "--step applies to --checkpoint-dir RUN"),
    (["--limit", "0"], "--limit 0: give a whole number >= 1"),
    (["--reward", "nosuchmod:score"], "--reward nosuchmod:score"),
])
def test_bad_flags_are_refused_before_the_model_loads(
        cwd: Path, capsys: pytest.CaptureFixture[str], flags: list[str], message: str) -> None:
    rc = main(["eval", "--model", str(MODEL), "--dataset", "d.jsonl", *flags])
    err = capsys.readouterr().err
    assert rc == 2 and message in err, err


def test_a_bad_row_is_named_by_file_and_line(cwd: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    (cwd / "bad.jsonl").write_text(json.dumps(ROWS[0]) + "\n" + json.dumps({"question": "x"})
                                   + "\n")
    rc = main(["eval", "--model", str(MODEL), "--dataset", "bad.jsonl"])
    err = capsys.readouterr().err
    assert rc == 2 and "bad.jsonl:2" in err and "answer" in err, err
