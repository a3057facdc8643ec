"""The benchmark suite's logic at tiny sizes: resume, OOM/errors as rows, padding accounting,
tables and plots. No timing is asserted (the machine may be busy)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from bench.experiments.suite import grid
from bench.lib import child
from bench.lib.suite import suite_jobs as suite
from bench.lib.suite import suite_padding as sp
from bench.lib.suite import suite_report

META = {"device": "cpu", "platform": "cpu", "versions": {"jax": "x"}, "git": "abc",
        "date": "2026-01-01T00:00:00+00:00", "command": "python -m bench suite --test"}

TINY: dict[str, Any] = {
    **grid("full"), "preset": "tiny", "batch": 2, "prompt_len": (3, 6), "window": 8, "block": 8,
    "kinds": ("full", "window"), "tokens": (12,), "pershape_tokens": (), "pershape_kinds": (),
    "realistic": {"batch": 3, "prompt": (2, 5), "median": 6, "cap": 10, "sigma": 0.6},
    "growing": {"batch": 3, "prompt": (2, 5), "medians": (2, 20), "runs": 2, "cap": 24,
                "sigma": 0.6},
}

# A stand-in child: behaviour chosen by the system name, so no JAX work is done.
FAKE_CHILD = r"""
import json, os, signal, sys
spec = json.load(open(sys.argv[1]))
with open(os.environ["FAKE_LOG"], "a") as f:
    f.write(spec["system"] + "\n")
mode = os.environ.get("FAKE_MODE", "ok")
if mode == "oom" and spec["system"] == "padded":
    sys.stderr.write("jaxlib.xla_extension.XlaRuntimeError: RESOURCE_EXHAUSTED: Out of memory\n")
    sys.exit(1)
if mode == "kill" and spec["system"] == "padded":
    os.kill(os.getpid(), signal.SIGKILL)
if mode == "error" and spec["system"] == "padded":
    raise ValueError("some bug")
n = max(spec["limits"])
json.dump({"s_per_token": 0.001, "s_per_token_with_compile": 0.002, "seconds": 0.001 * n,
           "seconds_with_compile": 0.002 * n, "peak_bytes": 1000 * n, "peak_rss_bytes": 10**8,
           "xla_compiles": 3, "dispatches": n, "decode_steps": n, "generated_tokens": n,
           "tokens_sha": "same"}, open(sys.argv[2], "w"))
"""


@pytest.fixture
def fake_child(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The stand-in child's call log; :func:`_run` runs jobs through the stand-in."""
    (tmp_path / "fake_child.py").write_text(FAKE_CHILD)
    log = tmp_path / "calls.log"
    monkeypatch.setenv("FAKE_LOG", str(log))
    return log


def _run(jobs: list[suite.Job], out: Path, fake: Path, **kw: Any) -> dict[str, dict[str, Any]]:
    """``run_jobs`` with the stand-in child (next to the call log ``fake``)."""
    script = fake.parent / "fake_child.py"
    return suite.run_jobs(jobs, out, META, progress=False, echo=None,
                          command=lambda spec, o: [sys.executable, str(script), spec, o], **kw)


def _jobs() -> list[suite.Job]:
    return suite.plan(TINY, systems=("sym-xla", "padded"), scenarios=("decode", "realistic"))


def _calls(log: Path) -> list[str]:
    return log.read_text().split() if log.exists() else []


def test_plan_orders_padded_first_and_is_deterministic() -> None:
    jobs = _jobs()
    assert [j.system for j in jobs[:2]] == ["padded", "sym-xla"]
    assert [j.key for j in jobs] == [j.key for j in _jobs()]
    real = [j for j in jobs if j.config["scenario"] == "realistic"]
    assert all(1 <= x <= 10 for x in real[0].limits) and len(real[0].limits) == 3
    grow = suite.plan(TINY, systems=("padded",), scenarios=("growing",))
    assert [j.config["median"] for j in grow] == [2.0, 20.0]  # 10x over the runs


def test_resume_skips_finished_and_force_reruns(tmp_path: Path, fake_child: Path) -> None:
    jobs = _jobs()
    rows = _run(jobs, tmp_path, fake_child)
    assert len(_calls(fake_child)) == len(jobs)
    assert all(r["status"] == "ok" and r["device"] == "cpu" and r["command"] for r in
               rows.values())
    assert all(r["check_vs_padded"]["tokens_equal"] for r in rows.values()
               if r["system"] == "sym-xla")
    _run(jobs, tmp_path, fake_child)
    assert len(_calls(fake_child)) == len(jobs)  # nothing re-run
    _run(jobs, tmp_path, fake_child, force=True)
    assert len(_calls(fake_child)) == 2 * len(jobs)
    assert len(suite.load_rows(tmp_path / "results.jsonl")) == len(jobs)  # last row wins


@pytest.mark.parametrize(("mode", "status"), [("oom", "oom"), ("kill", "oom"),
                                               ("error", "error")])
def test_failures_become_rows(tmp_path: Path, fake_child: Path, monkeypatch: pytest.MonkeyPatch,
                              mode: str, status: str) -> None:
    monkeypatch.setenv("FAKE_MODE", mode)
    jobs = _jobs()
    rows = _run(jobs, tmp_path, fake_child)
    padded = [r for r in rows.values() if r["system"] == "padded"]
    assert padded and all(r["status"] == status for r in padded)
    assert all(r["status"] == "ok" for r in rows.values() if r["system"] == "sym-xla")
    # OOM is finished (not retried); an error is retried on the next run.
    monkeypatch.setenv("FAKE_MODE", "ok")
    n = len(_calls(fake_child))
    _run(jobs, tmp_path, fake_child)
    rerun = len(_calls(fake_child)) - n
    assert rerun == (0 if status == "oom" else len(padded))
    md = suite_report.render_markdown(list(suite.load_rows(tmp_path / "results.jsonl").values()))
    if status == "oom":
        assert "**oom**" in md


def test_timeout_is_a_row(tmp_path: Path) -> None:
    job = _jobs()[0]
    sleeper = lambda spec, out: [sys.executable, "-c", "import time; time.sleep(30)"]
    rows = suite.run_jobs([job], tmp_path, META, timeout=1, progress=False, echo=None,
                          command=sleeper)
    assert rows[job.key]["status"] == "timeout"


def test_outputs_render(tmp_path: Path, fake_child: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_MODE", "oom")
    jobs = suite.plan(TINY, systems=("sym-xla", "padded"),
                      scenarios=("decode", "realistic", "growing"))
    rows = _run(jobs, tmp_path / "suite", fake_child)
    suite.write_outputs(rows, tmp_path / "suite")
    md = (tmp_path / "suite" / "results.md").read_text()
    assert "## Decoding" in md and "## Growing" in md and "padded OOM" in md
    assert "python -m bench suite --test" in md and "device: `cpu`" in md
    summary = (tmp_path / "SUITE.md").read_text()
    assert "suite/decode_time.png" in summary
    for name in ("decode_time", "decode_memory", "decode_compiles_padding", "lengths"):
        assert (tmp_path / "suite" / f"{name}.png").stat().st_size > 10_000


def test_padding_accounting() -> None:
    full, window = [sp.Layer("full")], [sp.Layer("window", 4)]
    # One row, prompt 2, 3 new tokens: positions 0..3 fed (2 prompt + 2 fed-back tokens).
    w = sp.padded_work([2], [3], full)
    assert (w.tokens_needed, w.tokens_computed) == (4, 4)
    # decode steps s=1,2 feed positions 2,3 → needed keys 3+4; padded attends 5 slots twice.
    assert (w.keys_needed, w.keys_computed) == (7, 10)
    # Padded: a short row keeps decoding; every pattern attends over P + N slots.
    pw = sp.padded_work([4, 2], [10, 2], window)
    sw = sp.sym_work([4, 2], [10, 2], window)
    assert pw.fractions()["key_padding_fraction"] > sw.fractions()["key_padding_fraction"]
    assert pw.fractions()["padding_fraction"] > 0.3
    # Sym's ring holds w slots: after the first w positions nothing is wasted in a 1-row batch
    # (its 39 decode steps run as tiles of 8, 16 and 15: the last is cut at the row's limit).
    one = sp.sym_work([8], [40], window)
    assert one.keys_needed == one.keys_computed == 39 * 4
    assert sp.layers_for("mixed", 4, 16, 8) == [sp.Layer("window", 16), sp.Layer("full")] * 2
    assert sp.work_for("pershape", [3], [5], full).fractions()["key_padding_fraction"] == 0.0


def test_classify_failure() -> None:
    assert child.classify_failure(1, "XlaRuntimeError: RESOURCE_EXHAUSTED: ...") == "oom"
    assert child.classify_failure(-9, "") == "oom"
    assert child.classify_failure(1, "ValueError: x") == "error"
    assert suite.device_dir("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"


def test_real_child_tiny(tmp_path: Path) -> None:
    """One real tiny configuration through the real child: sym matches padded, rows complete."""
    t = {**TINY, "kinds": ("window",), "tokens": (6,)}
    jobs = suite.plan(t, systems=("sym-xla", "padded"), scenarios=("decode",))
    rows = suite.run_jobs(jobs, tmp_path, META, progress=False, echo=None)
    sym = rows[jobs[1].key]
    assert sym["status"] == "ok", sym.get("error")
    assert sym["check_vs_padded"]["tokens_equal"]
    assert sym["check_vs_padded"]["max_abs_logprob_diff"] < 1e-3
    assert sym["decode_steps"] == 6 and sym["generated_tokens"] == 12
    assert json.loads(json.dumps(sym))["peak_bytes"] > 0
