"""``train --report-to``: every step's metrics in the trackers, read back from the files they
wrote (TensorBoard event files parsed by ``tests/tb_events.py``, not by the writer), against the
metrics file of the same run; bad tracker flags refused before any work, naming the flag."""

from __future__ import annotations

import importlib.util
import json
import math
import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jaxrl_sym.cli import main
from jaxrl_sym.errors import InputError
from jaxrl_sym.rl.run.trackers import SAMPLES_SHOWN, ReportConfig, scalars
from jaxrl_sym.rl.run.train import train
from tests import tb_events

pytestmark = pytest.mark.share_compiles
TINY = dict(d_model=32, n_layers=1, n_heads=2, n_kv_heads=2, head_dim=16, ffn_dim=64)

leaf = st.one_of(st.integers(-10**6, 10**6), st.floats(allow_nan=False), st.booleans(),
                 st.none(), st.text(max_size=3), st.lists(st.integers(), max_size=2))
names = st.text("abcxyz_", min_size=1, max_size=4)
nested = st.recursive(leaf, lambda kids: st.dictionaries(names, kids, max_size=3), max_leaves=12)


@given(st.dictionaries(names, nested, max_size=5))
def test_scalars_are_the_numeric_leaves_by_path(metrics: dict) -> None:
    """Oracle: a walk that lists every leaf with its path, keeping ints, floats and bools."""
    want: dict[str, float] = {}

    def walk(d: dict, path: str) -> None:
        for k, v in d.items():
            if type(v) is dict:
                walk(v, f"{path}{k}/")
            elif type(v) in (int, float, bool):
                want[f"{path}{k}"] = float(v)
    walk(metrics, "")
    assert scalars(metrics) == want


def test_bad_tracker_flags_are_refused_by_name() -> None:
    with pytest.raises(InputError, match=r"--report-to 'tensorbord': not a tracker; choose "
                                         r"from tensorboard, wandb, mlflow"):
        ReportConfig.parse("tensorbord")
    with pytest.raises(InputError, match="a tracker is named twice"):
        ReportConfig.parse("tensorboard,tensorboard")
    with pytest.raises(InputError, match=r"--log-completions-every -1: give a whole number"):
        ReportConfig.parse("tensorboard", completions_every=-1)
    assert ReportConfig.parse("none").report_to == () == ReportConfig.parse(None).report_to


@pytest.mark.skipif(importlib.util.find_spec("mlflow") is not None, reason="mlflow installed")
def test_a_tracker_that_is_not_installed_stops_the_cli_before_any_work(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["train", "--steps", "1", "--report-to", "tensorboard,mlflow", "--no-progress",
               "--log-dir", str(tmp_path / "tb")])
    err = capsys.readouterr().err
    assert rc == 2 and "--report-to mlflow: the mlflow package is not installed; pip install " \
        "mlflow, or drop mlflow from --report-to" in err, err
    assert not (tmp_path / "tb").exists()


def test_tensorboard_holds_every_step_of_the_metrics_file(tmp_path: Path) -> None:
    """Two steps of the reverse task: every numeric field of each metrics line is a scalar at
    that step (nested ones as outer/inner), the final evaluation at the last step, and a
    table of the step's sampled completions (token ids, their rewards) at each step."""
    m = tmp_path / "m.jsonl"
    summary = train("grpo", "reverse", steps=2, seed=3, metrics_file=str(m), prompts_per_step=2,
                    group_size=2, eval_prompts=4, max_digits=2, model=TINY, progress=False,
                    report=ReportConfig(("tensorboard",), str(tmp_path / "tb"), 1))
    got, texts = tb_events.read(tmp_path / "tb")
    lines = [json.loads(line) for line in m.read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2]
    for line in lines:
        k, want = line["step"], scalars(line)
        assert want and len(want) > 10
        for name, v in want.items():
            t = re.sub(r"[^-/\w.]", "_", name)  # TensorBoard's tag characters
            assert t in got and k in got[t], name
            assert got[t][k] == pytest.approx(v, rel=1e-6, abs=1e-30) or \
                (math.isnan(v) and math.isnan(got[t][k])), name
    assert got["eval/exact_match"] == {2: pytest.approx(summary["final_exact_match"])}
    for k in (1, 2):
        table = texts["completions"][k].splitlines()
        assert table[0] == "| prompt | completion | reward |"
        rows = table[2:]
        assert len(rows) == min(SAMPLES_SHOWN, 2 * 2)  # prompts x group
        rewards = [float(r.rsplit("|", 2)[1]) for r in rows]
        assert all(0.0 <= r <= 1.0 for r in rewards)
        assert sum(rewards) / len(rewards) == pytest.approx(
            next(x["reward"] for x in lines if x["step"] == k), abs=1e-5)
    assert "config" in texts and "`algo`: `grpo`" in texts["config"][0]


def test_a_tracker_that_fails_to_start_is_named(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A tracker's own exception at start (MLflow 3 refusing a file store was one) becomes an
    error naming ``--report-to`` and the tracker, not a traceback from inside the package."""
    from jaxrl_sym.rl.run import trackers

    def refuses(directory: Path, config: object, name: str) -> None:
        raise RuntimeError("the filesystem tracking backend is in maintenance mode")

    monkeypatch.setitem(trackers.TRACKERS, "tensorboard", refuses)
    cfg = ReportConfig.parse("tensorboard", log_dir=str(tmp_path / "runs"))
    with pytest.raises(InputError, match=r"--report-to tensorboard: the tracker did not start "
                                         r"in .*runs: RuntimeError: the filesystem tracking"):
        trackers.Report(cfg, {"lr": 1e-3})
