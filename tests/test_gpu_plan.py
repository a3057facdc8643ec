"""The GPU plan's CPU dry run (issue 31): every item's code path runs at tiny shapes here, its
result is parsed and rendered, so a lent GPU spends its minutes on results, not script bugs."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench.experiments import gpu_plan
from bench.lib import gpu_report

ROOT = Path(__file__).resolve().parent.parent


def _plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bench", "gpu_plan", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_dry_run_runs_every_code_path_and_the_report_renders(tmp_path: Path) -> None:
    # the fp32 items run rlft_step with the flags the bf16 item covers; the bf16 item runs
    # both systems, LoRA and bf16-mixed: one of each code path
    items = ("gpu_tests,rl_step_bf16mixed_lora16,rl_step_sym_memory_knobs,decode_kernel_batch1,"
             "refill")  # in the plan's order
    proc = _plan("--dry-run", "--out", str(tmp_path), "--only", items, "--commit", "feedbee")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [json.loads(x) for x in (tmp_path / "plan.jsonl").read_text().splitlines()]
    assert [r["item"] for r in rows] == items.split(",")
    by = {r["item"]: r for r in rows}
    assert all(r["commit"] == "feedbee" and r["dry_run"] and r["versions"]["jax"] for r in rows)
    # the gpu tests are collected here and skip without a GPU (none failed, none missing)
    assert by["gpu_tests"]["result"] == {"tests": 10, "failures": 0, "errors": 0, "skipped": 10}
    rl = by["rl_step_bf16mixed_lora16"]["result"]
    assert rl["config"]["precision"] == "bf16-mixed" and rl["config"]["lora_rank"] == 4
    for system in ("sym", "padded"):
        r = rl["systems"][system]
        assert r["peak_bytes"] > 0 and r["seconds"]["update"] > 0 and r["useful_tokens"] > 0
    assert rl["ratios"]["step_seconds"] > 0
    # sym with its memory knobs: the engine options and the micro-batch reach the trainer
    knobs = by["rl_step_sym_memory_knobs"]["result"]
    assert knobs["config"]["update_tokens"] == 256 and "refill" in knobs["config"]["engine"]
    assert set(knobs["systems"]) == {"sym"} and knobs["systems"]["sym"]["peak_bytes"] > 0
    # a GPU-only experiment says why it did not run, and the row says skipped
    assert by["decode_kernel_batch1"]["status"] == "skipped"
    assert "needs a GPU" in by["decode_kernel_batch1"]["tail"]
    # refill: the replay and the measured rows, sym with and without refill beside padded
    systems_run = {r["system"] for r in by["refill"]["result"]["rows"] if r["part"] == "measured"}
    assert systems_run == {"sym compaction", "sym refill", "padded (groups of R)",
                           "tunix (groups of R)"}  # the peer: measured, or why not
    # on the CPU refill's tokens equal compaction's (the GPU records how far they agree)
    agree = [r["agreement_with_compaction"] for r in by["refill"]["result"]["rows"]
             if r["system"] == "sym refill" and r["part"] == "measured"]
    assert agree and all(a["identical"] == 1.0 and a["prefix"] == 1.0 for a in agree)
    # the item's own result file is folded into the row (the device returns 8 files)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.jsonl", "plan.log"]
    md = gpu_report.write(tmp_path / "plan.jsonl",
                          {i.name: i.projection for i in gpu_plan.PLAN}).read_text()
    assert "| sym |" in md and "| padded |" in md and "(miss)" in md
    assert "| sym refill |" in md


def test_items_that_no_longer_fit_the_budget_are_skipped_not_started(tmp_path: Path) -> None:
    proc = _plan("--preset", "gpu", "--budget-min", "0", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(x) for x in (tmp_path / "plan.jsonl").read_text().splitlines()]
    assert [r["item"] for r in rows] == [i.name for i in gpu_plan.PLAN]
    assert all(r["status"] == "skipped" and "budget" in r["tail"] for r in rows)
    assert not (tmp_path / "plan.log").exists()  # nothing was started


def test_bad_flags_name_themselves(tmp_path: Path) -> None:
    proc = _plan("--out", str(tmp_path), "--only", "rl_step_typo")
    assert proc.returncode == 2 and "--only rl_step_typo: unknown" in proc.stderr
    proc = _plan("--report", str(tmp_path / "missing.jsonl"))
    assert proc.returncode == 2 and "--report" in proc.stderr and "no such file" in proc.stderr


def test_report_of_the_committed_h100_run_keeps_its_numbers() -> None:
    plan = ROOT / "bench/results/nvidia-h100-80gb-hbm3/2026-11-26/plan.jsonl"
    md = gpu_report.render(gpu_report.load(plan), {i.name: i.projection for i in gpu_plan.PLAN})
    # the measured row as committed, beside the projection committed now (regenerated as the
    # code changes) with its miss
    assert re.search(r"\| sym \| 5\.87 \| 3\.69 \| 0\.02 \| 2\.16 \| 9\.41 \| "
                     r"\d+\.\d+ \([+-]\d+%\)", md), md
    assert "| padded | 18.72 |" in md  # the rerun's row replaces the budget-skipped one


def test_kernel_rows_render_each_variant() -> None:
    """The decode-kernel item measures the kernel now beside the first run's layout; the report
    keeps both rows apart (rows of the committed first run carry no variant: 'before')."""
    row = {"variant": "now", "dtype": "bfloat16", "hq": 14, "hkv": 2, "d": 64, "batch": 1,
           "length": 4096, "splits": 32, "us": 9.5, "kv_mb": 2.1, "gbps": 221.0,
           "pct_copy": 8.0}
    old = {k: v for k, v in row.items() if k != "variant"} | {"splits": 16, "us": 14.0}
    result = {"info": {"copy_gbps": 2760.0, "flush_bytes": 128 << 20}, "rows": [row, old]}
    lines = gpu_report._kernel_rows({"result": result})
    assert any(x.startswith("| now | bfloat16 | 14/2/64 | 1 | 4096 | 32 | 9.5 |") for x in lines)
    assert any(x.startswith("| before | bfloat16 | 14/2/64 | 1 | 4096 | 16 | 14.0 |")
               for x in lines)


def test_refill_agreement_counts_identical_samples_and_the_prefix_before_a_difference() -> None:
    from bench.experiments.refill import agreement

    a = [[5, 6, 7, 8], [1, 2], [9, 9, 9, 9]]
    b = [[5, 6, 0, 0], [1, 2], [9, 9, 9, 9, 4]]  # differ at token 2; equal; b runs one longer
    got = agreement(a, b)
    assert got["identical"] == 1 / 3
    assert got["prefix"] == (2 / 4 + 1.0 + 4 / 5) / 3
    assert got["first_divergence_min"] == 2 / 4
    assert agreement(a, a) == {"identical": 1.0, "prefix": 1.0, "first_divergence_min": 1.0}


def test_every_items_xla_flags_parse() -> None:
    """An item's environment reaches its child on the device; a misspelt XLA flag would abort
    it there after the machine's start. XLA:CPU parses GPU flags too and refuses unknown ones:
    each item's ``XLA_FLAGS`` is checked here (and a misspelt one is refused, so the check can
    fail)."""
    import os
    import subprocess
    import sys

    flags = {dict(i.env)["XLA_FLAGS"] for i in gpu_plan.PLAN if "XLA_FLAGS" in dict(i.env)}
    assert flags  # the plan has items that set XLA flags

    def parses(value: str) -> bool:
        env = {**os.environ, "XLA_FLAGS": value, "JAX_PLATFORMS": "cpu"}
        return subprocess.run([sys.executable, "-c", "import jax.numpy as j; j.ones(1).sum()"],
                              env=env, capture_output=True, timeout=120).returncode == 0

    assert all(parses(f) for f in flags), flags
    assert not parses("--xla_gpu_enable_comand_buffer=+WHILE")
