"""The practitioner's own data and reward (issue 48 items 1-2): ``train --model DIR --dataset FILE
--reward module:function``.

Oracles: the rows a test writes itself (every format must give the same problems as the JSONL),
hand-computed grades of hand-written completions, plain Python arithmetic for the weighted sum,
and a reward module written into ``tmp_path`` that records what it was called with. One short
run through the CLI (the tiny ChatML Qwen2 of ``tests/fixtures/text``, 2 steps of 2 x 2 samples
and 4 new tokens) checks the whole path; a second one checks that a reward failing in step 2
stops the run naming the function and the sample, with step 1 saved.
"""

from __future__ import annotations

import csv
import hashlib
import json
import sys
from collections.abc import Iterator
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from jaxrl_sym.cli import main
from jaxrl_sym.errors import InputError
from jaxrl_sym.rl.tasks.data import Fields, load_dataset, open_dataset
from jaxrl_sym.rl.tasks.rewards import (
    RewardFunctionError,
    boxed,
    exact_number,
    format_reward,
    reward_set,
    text_options,
)
from tests import tb_events

pytestmark = pytest.mark.share_compiles
MODEL = Path(__file__).parent / "fixtures" / "text" / "chatml_qwen2"
SUMS = [(3, 4), (12, 5), (7, 7), (20, 1), (9, 30), (2, 2), (1, 8), (6, 6), (5, 9), (4, 11)]
GSM8K = [{"question": f"What is {a} + {b}?", "answer": f"{a} plus {b} makes {a + b}.\n#### {a + b}"}
         for a, b in SUMS]
RECORDER = '''
import json

def score(prompts, completions, answer, **fields):
    with open("calls.jsonl", "a") as f:
        f.write(json.dumps({"prompts": prompts, "completions": completions,
                            "answer": answer}) + "\\n")
    return [float(len(c) % 3) for c in completions]
'''
REWARDS = '''
import math

def half(prompts, completions, **kw):
    return [0.5 * len(c) for c in completions]

def boom(prompts, completions, **kw):
    raise ValueError("no grader here")

def nan(prompts, completions, **kw):
    return [math.nan for _ in completions]

def short(prompts, completions, **kw):
    return [1.0]

def text(prompts, completions, **kw):
    return ["1.0" for _ in completions]

def strict(prompts, completions, answer):
    return [1.0 for _ in completions]

NOT_A_FUNCTION = 3
CALLS = [0]

def late_nan(prompts, completions, **kw):
    CALLS[0] += 1  # once per step
    return [math.nan if CALLS[0] > 1 else 1.0 for _ in completions]
'''


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """tmp_path as the current directory, where the reward modules (``udrw_*``) are imported
    from; sys.path and those modules are gone again afterwards."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield tmp_path
    for name in [m for m in sys.modules if m.startswith("udrw_")]:
        del sys.modules[name]


def test_json_csv_jsonl_give_the_same_problems(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    want = load_dataset(write_jsonl(tmp_path / "d.jsonl", GSM8K))
    assert [(p.prompt, p.answer) for p in want] == [
        (f"What is {a} + {b}?", Fraction(a + b)) for a, b in SUMS]  # question, '#### N'
    assert want[0].fields == {"answer": GSM8K[0]["answer"]}  # the raw row, for rewards
    (tmp_path / "l.json").write_text(json.dumps(GSM8K))
    (tmp_path / "o.json").write_text(json.dumps({"data": GSM8K}))
    with open(tmp_path / "d.csv", "w", newline="") as f:
        w = csv.DictWriter(f, ["question", "answer"])
        w.writeheader()
        w.writerows(GSM8K)
    for name in ("l.json", "o.json", "d.csv"):
        got = load_dataset(tmp_path / name)
        assert [(p.prompt, p.answer, p.fields) for p in got] == [
            (p.prompt, p.answer, p.fields) for p in want], name
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # as if it were not installed
    (tmp_path / "d.parquet").write_bytes(b"PAR1")
    with pytest.raises(InputError, match=r"d\.parquet: reading Parquet needs pyarrow.*"
                                         r"pip install pyarrow"):
        load_dataset(tmp_path / "d.parquet")


@pytest.mark.parametrize("lines, where", [
    (['{"question": "q1", "answer": 1}', '{"question": "q2"}'],
     r"d\.jsonl:2: no field 'answer'"),
    (['{"question": "q1", "answer": "many"}'], r"d\.jsonl:1: field 'answer' must be a number"),
    (['{"answer": 3}'], r"d\.jsonl:1: no field 'prompt' \(nor 'question'\)"),
    (['{"prompt": "a", "answer": 1}', '', '[1, 2]'], r"d\.jsonl:3: expected a JSON object"),
    (['{"prompt": "", "answer": 1}'], r"d\.jsonl:1: field 'prompt' must be a non-empty string"),
    (['{"prompt": [{"role": "user"}], "answer": 1}'],
     r"d\.jsonl:1: field 'prompt' message 0 must be an object with a 'role' and a 'content'"),
    (['{"prompt": "a", "answer": 1}', '{"prompt": "a", "answer": 2}'],
     r"d\.jsonl:2: the same prompt as .*d\.jsonl:1 with another answer"),
])
def test_bad_jsonl_rows_are_refused_by_line_and_field(tmp_path: Path, lines: list[str],
                                                      where: str) -> None:
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(InputError, match=where):
        load_dataset(tmp_path / "d.jsonl")


def test_bad_json_and_csv_rows_and_files(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "d.json").write_text(json.dumps([GSM8K[0], {"question": "q"}]))
    with pytest.raises(InputError, match=r"d\.json\[1\]: no field 'answer'"):
        load_dataset(tmp_path / "d.json")
    (tmp_path / "d.csv").write_text("q,a\nWhat?,3\nWhy?,lots\n")
    with pytest.raises(InputError, match=r"d\.csv:3: field 'a' must be a number"):
        load_dataset(tmp_path / "d.csv", Fields("q", "a"))
    (tmp_path / "d.txt").write_text("x")
    with pytest.raises(InputError, match=r"d\.txt: unknown format \.txt"):
        load_dataset(tmp_path / "d.txt")
    (tmp_path / "e.jsonl").write_text("\n")
    with pytest.raises(InputError, match=r"e\.jsonl holds no rows"):
        load_dataset(tmp_path / "e.jsonl")
    # through the CLI: refused before any model is loaded, exit 2, file, line and field named
    (tmp_path / "b.jsonl").write_text('{"question": "q", "answer": 1}\n{"prompt": 7, '
                                      '"answer": 1}\n')
    rc = main(["train", "--model", str(MODEL), "--dataset", str(tmp_path / "b.jsonl")])
    assert rc == 2 and "b.jsonl:2: field 'prompt' must be a non-empty string" in (
        capsys.readouterr().err)
    rc = main(["train", "--dataset", str(tmp_path / "d.json"), "--prompt-field", "q"])
    assert rc == 2 and "--dataset needs --model DIR" in capsys.readouterr().err
    rc = main(["train", "--model", str(MODEL), "--eval-dataset", str(tmp_path / "d.json")])
    assert rc == 2 and "--eval-dataset applies to --dataset FILE" in capsys.readouterr().err


def test_held_out_split_eval_dataset_chat_rows_and_system_prompt(tmp_path: Path) -> None:
    from jaxrl_sym.models.hf.text import HFText
    from jaxrl_sym.rl.run.pretrained import setup

    d = write_jsonl(tmp_path / "d.jsonl", GSM8K)
    ds = open_dataset(str(d))
    assert (len(ds.train), len(ds.held_out)) == (9, 1)  # 10%: one row, never trained on
    assert ds.held_out[0].prompt not in {p.prompt for p in ds.train}
    assert open_dataset(str(d)).held_out == ds.held_out  # fixed, whatever the run's seed
    assert ds.sha256 == hashlib.sha256(d.read_bytes()).hexdigest()
    with pytest.raises(InputError, match=r"holds 1 row\(s\): too few .* --eval-dataset"):
        open_dataset(str(write_jsonl(tmp_path / "one.jsonl", GSM8K[:1])))
    e = write_jsonl(tmp_path / "e.jsonl", GSM8K[:3])
    both = open_dataset(str(d), eval_path=str(e))
    assert (len(both.train), len(both.held_out)) == (10, 3)
    chat = [{"prompt": [{"role": "system", "content": "Terse."},
                        {"role": "user", "content": "What is 2 + 5?"}], "answer": 7},
            {"prompt": "What is 1 + 1?", "answer": "2"}]
    opts = text_options(dataset=str(write_jsonl(tmp_path / "c.jsonl", chat)),
                        eval_dataset=str(e), system_prompt="Answer with '#### N'.",
                        model=str(MODEL))
    run = setup(str(MODEL), "dataset", max_new_tokens=8, text=opts)
    text = HFText(MODEL)
    rendered = {tuple(run.task.encode(p).tolist()) for p in opts.dataset.train}
    assert rendered == {  # the row's own system message is kept, else --system-prompt's
        tuple(text.encode_chat(chat[0]["prompt"])),
        tuple(text.encode_chat([{"role": "system", "content": "Answer with '#### N'."},
                                {"role": "user", "content": "What is 1 + 1?"}]))}
    assert run.task.eval_task.task.problems == both.held_out and run.task.eval_task.task.held_out
    assert run.hparams["eval_dataset"] == str(e) and run.hparams["reward"] is None
    assert json.loads(json.dumps(run.hparams)) == run.hparams  # compares equal once saved
    from jaxrl_sym.rl.run.train import hparam_diffs

    assert hparam_diffs({"dataset_sha256": "a", "reward": ["format"]},
                        {"dataset_sha256": "b", "reward": ["format"]}) == [
        ("--dataset (the file's contents) (dataset_sha256)", "a", "b")]


def test_builtin_graders_on_hand_written_completions() -> None:
    completions = ["so 3 + 4 = 7\n#### 7", "it is \\boxed{7}", "#### 8", "I think 7.",
                   "\\boxed{7} then #### 9", "nothing"]
    answers = [7] * len(completions)
    assert exact_number([], completions, answers) == [1.0, 1.0, 0.0, 1.0, 0.0, 0.0]
    assert boxed([], completions, answers) == [0.0, 1.0, 0.0, 0.0, 1.0, 0.0]
    assert format_reward([], completions) == [1.0, 0.0, 1.0, 0.0, 1.0, 0.0]
    assert exact_number([], ["#### 1,234"], ["... #### 1234"]) == [1.0]  # GSM8K answer text


def test_weights_sum_and_bad_rewards_are_named(cwd: Path) -> None:
    (cwd / "udrw_a.py").write_text(REWARDS)
    rs = reward_set(["exact_number", "udrw_a:half", "format"], "1,0.25,-0.5")
    comps = ["#### 7", "7", "#### 3 \\boxed{7}"]
    fields = [{"answer": "#### 7", "id": i} for i in range(3)]
    total, parts = rs.score(["p"] * 3, comps, [Fraction(7)] * 3, fields)
    want = {"exact_number": [1.0, 1.0, 0.0], "udrw_a:half": [3.0, 0.5, 8.0],
            "format": [1.0, 0.0, 1.0]}
    assert parts == want
    assert total == [1 * e + 0.25 * h + -0.5 * f for e, h, f in zip(*want.values(), strict=True)]
    assert rs.hparams()["reward_weights"] == [1.0, 0.25, -0.5]
    assert rs.hparams()["reward_sha256"][1] == hashlib.sha256(
        (cwd / "udrw_a.py").read_bytes()).hexdigest()
    for fn, msg in (("boom", r"udrw_a:boom raised ValueError: no grader here on samples "
                             r"5\.\.6"),
                    ("nan", r"udrw_a:nan returned nan for sample 5: rewards must be finite"),
                    ("short", r"udrw_a:short returned 1 values for 2 completion\(s\) on "
                              r"samples 5\.\.6"),
                    ("text", r"udrw_a:text returned '1.0' \(str\) for sample 5: not a number")):
        with pytest.raises(RewardFunctionError, match=msg):
            reward_set([f"udrw_a:{fn}"]).score(["p", "q"], ["a", "b"], [Fraction(1)] * 2,
                                               [{}, {}], first=5)
    for names, weights, msg in (
            (["udrw_missing:f"], None, r"no module 'udrw_missing' in the current directory"),
            (["udrw_a:absent"], None, r"module 'udrw_a' .* has no 'absent'"),
            (["udrw_a:NOT_A_FUNCTION"], None, r"'NOT_A_FUNCTION' is a int, not a function"),
            (["exact_number"], "1,2", r"--reward-weights '1,2': give 1 finite weight"),
            (["format", "format"], None, r"--reward format is given twice"),
            (["udrw_a"], None, r"neither a built-in reward")):
        with pytest.raises(InputError, match=msg):
            reward_set(names, weights)
    with pytest.raises(InputError, match=r"udrw_a:strict cannot be called .*id=\.\.\."):
        reward_set(["udrw_a:strict"]).check_fields({"answer", "id"})


def run_cli(model_args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = main(["train", "--model", str(MODEL), "--steps", "2", "--prompts", "2", "--group", "2",
               "--max-new-tokens", "4", "--no-progress", *model_args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_runs_your_data_with_your_reward(cwd: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    write_jsonl(cwd / "d.jsonl", GSM8K)
    (cwd / "udrw_rec.py").write_text(RECORDER)
    rc, out, err = run_cli(["--dataset", "d.jsonl", "--reward", "udrw_rec:score", "--reward",
                            "format", "--reward-weights", "1,0.5", "--eval-prompts", "2",
                            "--metrics", "m.jsonl", "--checkpoint-dir", "run", "--json",
                            "--report-to", "tensorboard", "--log-dir", "tb",
                            "--log-completions-every", "2"], capsys)
    assert rc == 0, err
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["eval_source"].startswith("1 of 10 rows of d.jsonl held out")
    calls = [json.loads(line) for line in (cwd / "calls.jsonl").read_text().splitlines()]
    # one call per step with its prompts x group completions, as TRL calls it
    assert [len(c["completions"]) for c in calls] == [4, 4]
    by_prompt = {f"What is {a} + {b}?": r["answer"] for (a, b), r in zip(SUMS, GSM8K, strict=True)}
    for c in calls:
        assert all(isinstance(x, str) for x in c["completions"])
        assert c["answer"] == [by_prompt[p] for p in c["prompts"]]  # each row's own raw answer
    metrics = [json.loads(line) for line in (cwd / "m.jsonl").read_text().splitlines()]
    for k, m in enumerate(metrics):
        mine = [float(len(x) % 3) for x in calls[k]["completions"]]
        assert m["reward/udrw_rec:score"] == pytest.approx(np.mean(mine))
        assert m["reward"] == pytest.approx(np.mean(mine) + 0.5 * m["reward/format"])
    # the same run in TensorBoard (its event files read back by tests/tb_events.py)
    scalars, texts = tb_events.read(cwd / "tb")
    assert scalars["reward/udrw_rec_score"] == {  # TensorBoard's tag characters
        m["step"]: pytest.approx(m["reward/udrw_rec:score"]) for m in metrics}
    assert list(texts["completions"]) == [2]  # every 2 steps
    shown = texts["completions"][2].splitlines()[2:]
    assert len(shown) == 4 and all("What is" in row for row in shown)
    meta = json.loads((cwd / "run" / "2" / "meta" / "metadata").read_text())["hparams"]
    assert meta["dataset_sha256"] == hashlib.sha256((cwd / "d.jsonl").read_bytes()).hexdigest()
    assert meta["reward"] == ["udrw_rec:score", "format"] and meta["task"] == "dataset"
    assert meta["reward_sha256"][0] == hashlib.sha256(
        (cwd / "udrw_rec.py").read_bytes()).hexdigest()


def test_cli_reward_failure_names_function_and_sample_and_saves(
        cwd: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_jsonl(cwd / "d.jsonl", GSM8K)
    (cwd / "udrw_late.py").write_text(REWARDS)
    rc, _, err = run_cli(["--dataset", "d.jsonl", "--reward", "udrw_late:late_nan",
                          "--eval-prompts", "0", "--checkpoint-dir", "run"], capsys)
    assert rc == 2
    assert ("--reward udrw_late:late_nan returned nan for sample 0: rewards must be finite "
            "(step 2; the step was not applied); steps up to 1 are saved in") in err, err
    assert sorted(p.name for p in (cwd / "run").iterdir() if p.name.isdigit()) == ["1"]


def test_train_temperature_flag_reaches_the_step_and_is_checked(
        capsys: pytest.CaptureFixture[str]) -> None:
    """``train --temperature`` sets the rollouts' sampling temperature (the RLConfig the run
    trains with); out of its domain it fails before JAX with the flag named."""
    import argparse

    from jaxrl_sym.rl.config import task_rl_config
    from jaxrl_sym.rl.run.cli import add_train_parser, train_configs

    sub = argparse.ArgumentParser().add_subparsers()
    add_train_parser(sub)
    args = sub.choices["train"].parse_args(["--temperature", "0.7"])
    _, rl, _ = train_configs(args)
    assert task_rl_config(10, 8, 1, rl).algorithm.temperature == 0.7
    default = train_configs(sub.choices["train"].parse_args([]))[1]
    assert task_rl_config(10, 8, 1, default).algorithm.temperature == 1.0
    for bad in ("0", "-1", "nan", "inf"):
        assert main(["train", "--temperature", bad, "--steps", "1"]) == 2
        err = capsys.readouterr().err
        assert f"AlgorithmConfig.temperature={float(bad)} (--temperature)" in err


def test_lora_on_a_checkpoint_gets_its_own_learning_rate(
        cwd: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A ``--model`` run's LoRA adapters train at 2e-4, not the full fine-tuning's 1e-6 (what
    the run prints as its recipe before the first step); ``--lr`` still wins."""
    write_jsonl(cwd / "d.jsonl", GSM8K)
    base = ["train", "--model", str(MODEL), "--dataset", "d.jsonl", "--steps", "1", "--prompts",
            "1", "--group", "2", "--max-new-tokens", "2", "--eval-prompts", "0"]
    for extra, lr in ((["--lora-rank", "2"], "lr 0.0002"),
                      (["--lora-rank", "2", "--lr", "0.001"], "lr 0.001")):
        assert main([*base, *extra]) == 0
        recipe = next(x for x in capsys.readouterr().err.splitlines() if x.startswith("recipe:"))
        assert f"grpo, adam, {lr} (" in recipe, recipe
