"""Word problems, the answer extractor and the reward: property-based where a property exists.

The extractor is checked on arbitrary surrounding text (``#### N`` wins over boxed, boxed over
the last number); the reward on arbitrary responses (in [0, 1], correct >= 0.8 > 0.2 >= wrong);
generated problems against their own worked solutions, whose every line is re-computed here.
"""

from __future__ import annotations

import json
import re
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl_sym.errors import InputError
from jaxrl_sym.rl.tasks.text_tasks import (
    INSTRUCTION,
    MULTIPLIERS,
    Extracted,
    extract_answer,
    format_answer,
    get_text_task,
    load_problems,
    parse_number,
    reward,
    word_problem,
)

# Text that cannot itself look like a marker or a number.
PLAIN = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="#\\0123456789"),
                max_size=40)
ANY = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="#\\"),
              max_size=40)
INTS = st.integers(-10**9, 10**9)


def spelled(n: int, commas: bool, dollar: bool) -> str:
    body = f"{abs(n):,}" if commas else str(abs(n))
    return ("-" if n < 0 else "") + ("$" if dollar else "") + body


@given(ANY, INTS, st.booleans(), st.booleans(), PLAIN)
def test_hash_answer_wins(before: str, n: int, commas: bool, dollar: bool, after: str) -> None:
    text = f"{before} \\boxed{{7}} 99 #### {spelled(n, commas, dollar)}\n{after}"
    assert extract_answer(text) == Extracted(Fraction(n), "hash")


@given(ANY, INTS, st.booleans(), PLAIN)
def test_boxed_then_last_number(before: str, n: int, commas: bool, after: str) -> None:
    assert extract_answer(f"{before} \\boxed{{{spelled(n, commas, False)}}}{after}") == \
        Extracted(Fraction(n), "boxed")
    assert extract_answer(f"{before} so it is {spelled(n, commas, True)}{after}") == \
        Extracted(Fraction(n), "last")


@given(PLAIN)
def test_no_number_no_answer(text: str) -> None:
    assert extract_answer(text) == Extracted(None, None)
    assert reward(text, 3) == 0.0


@given(st.integers(-10**6, 10**6))
def test_decimals_exact(num: int) -> None:
    value = Fraction(num, 100)
    text = f"{float(value):.2f}"
    assert extract_answer(f"#### {text}").value == value
    assert parse_number(text) == value
    assert parse_number(format_answer(value)) == value


@settings(max_examples=300)
@given(ANY, st.integers(-1000, 1000))
def test_reward_bounded_and_exact_answer_dominant(response: str, answer: int) -> None:
    r = reward(response, answer)
    assert 0.0 <= r <= 1.0
    if extract_answer(response).value == answer:
        assert r >= 0.8
    else:
        assert r == 0.0  # the format is paid only with the right answer


@given(st.integers(-1000, 1000), st.integers(-1000, 1000))
def test_reward_levels(answer: int, wrong: int) -> None:
    if wrong == answer:
        wrong += 1
    assert reward(f"... #### {answer}", answer) == 1.0
    assert reward(f"\\boxed{{{answer}}}", answer) == pytest.approx(0.9)
    assert reward(f"it is {answer}", answer) == 0.8
    assert reward(f"#### {wrong}", answer) == 0.0
    assert reward(f"\\boxed{{{wrong}}}", answer) == 0.0
    assert reward(f"it is {wrong}", answer) == 0.0


@given(st.integers(-1000, 1000), st.integers(-1000, 1000),
       st.sampled_from([0.0, 0.1, 0.3, 0.49]))
def test_format_weight_levels(answer: int, wrong: int, w: float) -> None:
    """``--partial-weight`` on a text task is the format's weight: 0 rewards the exact answer
    alone (any format); a wrong answer scores 0 whatever its format."""
    if wrong == answer:
        wrong += 1
    assert reward(f"#### {answer}", answer, w) == pytest.approx(1.0)
    assert reward(f"it is {answer}", answer, w) == pytest.approx(1 - w)
    assert reward(f"\\boxed{{{answer}}}", answer, w) == pytest.approx(1 - w / 2)
    assert reward(f"#### {wrong}", answer, w) == 0.0
    assert reward(f"\\boxed{{{wrong}}}", answer, w) == 0.0
    assert min(reward(f"it is {answer}", answer, w), reward(f"\\boxed{{{answer}}}", answer, w)) \
        > max(reward(f"#### {wrong}", answer, w), reward(f"it is {wrong}", answer, w))


def test_format_weight_refused_where_a_wrong_answer_could_win() -> None:
    from jaxrl_sym.rl.config import RunConfig

    for bad in (0.5, 0.8, -0.1, True, "0.1"):
        with pytest.raises(InputError, match="--partial-weight"):
            reward("#### 3", 3, bad)
        with pytest.raises(InputError, match="--partial-weight"):
            RunConfig(task="word-problems", model_dir="/ckpt", partial_weight=bad)
    # the default of a checkpoint's text task is the format weight, of a token task its own
    assert RunConfig(task="word-problems", model_dir="/ckpt").reward_weight == 0.2
    assert RunConfig(task="word-problems", model_dir="/ckpt", partial_weight=0.0
                     ).reward_weight == 0.0
    assert RunConfig(task="reverse").reward_weight == 0.5


_LINE = re.compile(r"(\d+) ([-+*/]) (\d+) = (\d+)")


@settings(max_examples=200)
@given(st.integers(0, 2**32 - 1), st.integers(1, 4))
def test_word_problems_check_out(seed: int, max_steps: int) -> None:
    """The worked solution re-computes line by line, chains, ends in the answer; the prompt
    states every operand and asks one question."""
    p = word_problem(np.random.default_rng(seed), 1, max_steps)
    lines = p.solution.splitlines()
    assert lines[-1] == f"#### {p.answer}" and reward(p.solution, p.answer) == 1.0
    prev = None
    ops = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b,
           "/": lambda a, b: Fraction(a, b)}
    for line in lines[:-1]:
        a, op, b, c = _LINE.fullmatch(line).groups()
        assert ops[op](int(a), int(b)) == int(c)
        assert prev is None or int(a) == prev
        assert b in p.prompt or (op == "*" and MULTIPLIERS[int(b)] in p.prompt)
        prev = int(c)
    assert prev == p.answer and p.answer >= 0
    assert p.prompt.endswith(INSTRUCTION) and p.prompt.count("?") == 1


def test_word_problems_vary_and_repeat() -> None:
    a = [word_problem(np.random.default_rng([3, k])) for k in range(40)]
    b = [word_problem(np.random.default_rng([3, k])) for k in range(40)]
    assert a == b  # a function of the generator's state only (resume replays the prompts)
    lengths = {len(p.prompt) for p in a}
    assert len(lengths) > 20 and max(lengths) - min(lengths) > 80
    assert any("years old" in p.prompt or "kilometres" in p.prompt for p in a)  # distractors


def test_jsonl_loading_and_errors(tmp_path: Path) -> None:
    f = tmp_path / "tasks.jsonl"
    f.write_text('{"prompt": "1+1?", "answer": 2}\n\n{"prompt": "half", "answer": "0.5", '
                 '"id": 7}\n{"prompt": "big", "answer": "1,234"}\n{"prompt": "x", "answer": 2.5}\n')
    probs = load_problems(f)
    assert [p.answer for p in probs] == [2, Fraction(1, 2), 1234, Fraction(5, 2)]
    task = get_text_task(f"jsonl:{f}")
    drawn = task.sample(np.random.default_rng(0), 50)
    assert {p.prompt for p in drawn} == {p.prompt for p in probs}
    bad = {
        '{"prompt": "a", "answer": 1}\n{"prompt": "b"': r"tasks\.jsonl:2: not valid JSON",
        '{"prompt": "a", "answer": 1}\n\n[1, 2]': r"tasks\.jsonl:3: expected a JSON object",
        '{"answer": 1}': r"tasks\.jsonl:1: the record has no 'prompt'",
        '{"prompt": "a"}': r"tasks\.jsonl:1: the record has no 'answer'",
        '{"prompt": "", "answer": 1}': r"tasks\.jsonl:1: 'prompt' must be a non-empty string",
        '{"prompt": "a", "answer": "many"}': r"tasks\.jsonl:1: 'answer' must be a number",
        '{"prompt": "a", "answer": true}': r"tasks\.jsonl:1: 'answer' must be a number",
        '{"prompt": "a", "answer": NaN}': r"tasks\.jsonl:1: 'answer' must be a number",
        "\n\n": r"holds no records",
        '{"prompt": "a", "answer": 1}\n{"prompt": "a", "answer": "1.0"}\n{"prompt": "a", '
        '"answer": 2}': r"tasks\.jsonl:3: the same prompt as line 1 with another answer",
    }
    for text, pattern in bad.items():
        f.write_text(text)
        with pytest.raises(InputError, match=pattern):
            load_problems(f)
    with pytest.raises(InputError, match=r"cannot read task file .*missing\.jsonl"):
        get_text_task(f"jsonl:{tmp_path / 'missing.jsonl'}")
    with pytest.raises(InputError, match=r"unknown text task 'gsm9k'"):
        get_text_task("gsm9k")
    assert json.loads(json.dumps(format_answer(Fraction(1, 3)))) == "1/3"


def test_word_problems_difficulty_by_name() -> None:
    from jaxrl_sym.rl.tasks.text_tasks import get_text_task, is_text_task

    one = get_text_task("word-problems:1")
    assert (one.min_steps, one.max_steps) == (1, 1) and is_text_task("word-problems:4")
    assert get_text_task("word-problems").max_steps == 3  # the default
    # one operation: the worked solution is the opening line (if any) plus one step and '####'
    for p in one.sample(np.random.default_rng(0), 20):
        assert p.solution is not None and p.solution.count("=") <= 2
    for bad in ("word-problems:0", "word-problems:5"):
        with pytest.raises(InputError, match=f"--task {bad}: the number of operations"):
            get_text_task(bad)
    assert not is_text_task("word-problems:x")
    small = get_text_task("word-problems:2:9")
    assert (small.max_steps, small.largest) == (2, 9) and is_text_task("word-problems:2:9")
    for bad in ("word-problems:1:1", "word-problems:1:1000"):
        with pytest.raises(InputError, match=f"--task {bad}: the largest number N"):
            get_text_task(bad)
    # D: at most D irrelevant sentences (the templates' four kinds), default 2
    distracting = ("years old", "kilometres", "favourite colour", "rained")
    def distractors(task: str) -> list[int]:
        return [sum(p.prompt.count(d) for d in distracting)
                for p in get_text_task(task).sample(np.random.default_rng(3), 40)]
    assert max(distractors("word-problems:1:9:0")) == 0 and is_text_task("word-problems:1:9:0")
    assert max(distractors("word-problems:1:9:1")) == 1
    assert max(distractors("word-problems:1:9")) == 2 == get_text_task("word-problems").distractors
    with pytest.raises(InputError, match="--task word-problems:1:9:3: the distractor count D"):
        get_text_task("word-problems:1:9:3")


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), steps=st.integers(1, 4), largest=st.integers(2, 40))
def test_no_stated_number_exceeds_the_bound_and_the_answer_follows(seed: int, steps: int,
                                                                  largest: int) -> None:
    """word-problems:K:N states no number above N (distractors included), and the answer is
    what the worked lines compute, re-done here with Python's own arithmetic."""
    from jaxrl_sym.rl.tasks.text_tasks import get_text_task

    task = get_text_task(f"word-problems:{steps}:{largest}")
    for p in task.sample(np.random.default_rng(seed), 4):
        stated = [int(x) for x in re.findall(r"\d+", p.prompt.split("\n")[0])]
        assert stated and max(stated) <= largest, p.prompt
        x = None
        for line in p.solution.splitlines()[:-1]:
            a, op, b, _, got = line.split()
            want = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b),
                    "/": int(a) // int(b)}[op]
            assert op != "/" or int(a) % int(b) == 0
            assert x is None or int(a) == x  # each line continues from the last result
            assert int(got) == want >= 0
            x = want
        assert p.answer == (x if x is not None else stated[0])


def test_the_run_weight_reaches_the_checkpoint_task_reward() -> None:
    """``train`` builds the text task with the run's weight (``setup(format_weight=...)``): an
    unformatted correct answer earns 1 - w through the token interface the trainer calls."""
    from jaxrl_sym.rl.run.pretrained import setup

    fixture = str(Path(__file__).parent / "fixtures" / "text" / "chatml_qwen2")
    for w in (0.0, 0.2):
        task = setup(fixture, "word-problems:1:9", max_new_tokens=16, format_weight=w).task
        (prompt,) = task.sample(np.random.default_rng(0), 1)
        answer = task._problem(prompt).answer
        response = task.text.encode(f"it is {answer}")
        assert task.reward(prompt, response) == pytest.approx(1 - w)
