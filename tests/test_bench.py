"""``python -m bench``: every registered experiment has the three presets, its ``--help`` and
its quick preset parse, the entry point lists and refuses by name, the suite's quick dry run
plans jobs, and no bench module compares system names (the registry holds the one list)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from test_systems_registry import _name_compares

from bench import presets, registry
from bench.__main__ import main as bench_main

ROOT = Path(__file__).resolve().parents[1]
NAMES = registry.names()


def test_registry_lists_every_experiment_module_once() -> None:
    modules = {p.stem for p in (ROOT / "bench" / "experiments").glob("*.py")} - {"__init__"}
    assert set(NAMES) == modules and len(NAMES) == len(set(NAMES))


@pytest.mark.parametrize("name", NAMES)
def test_presets_and_help_parse(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    module = registry.get(name).load()
    assert tuple(module.PRESETS) == presets.NAMES
    args = module.parse_args([])  # quick is the default
    assert args.preset == "quick"
    for key in module.PRESETS["quick"]:
        assert hasattr(args, key), key
    for preset in presets.NAMES:
        assert module.parse_args(["--preset", preset]).preset == preset
    with pytest.raises(SystemExit) as e:
        module.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert f"python -m bench {name}" in out and "quick:" in out and "gpu:" in out


def test_quick_presets_write_outside_results() -> None:
    """A quick run never poses as a result: wherever it writes, it is not bench/results."""
    for name in NAMES:
        out = registry.get(name).load().PRESETS["quick"].get("out")
        assert out is None or "bench/results" not in str(out), name


def test_entry_point_lists_and_refuses(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_main([]) == 0
    listing = capsys.readouterr().out
    assert all(name in listing for name in NAMES)
    assert bench_main(["no-such-experiment"]) == 2
    assert "choose one of headline" in capsys.readouterr().err


def test_suite_quick_dry_run_plans_every_scenario() -> None:
    """``python -m bench suite --dry-run`` in a process of its own, as a user runs it."""
    proc = subprocess.run([sys.executable, "-m", "bench", "suite", "--dry-run"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    labels = proc.stdout.splitlines()
    for scenario in ("decode", "realistic", "growing", "rlft", "trace"):
        assert any(line.startswith(scenario) for line in labels), (scenario, labels)


def test_no_bench_module_compares_system_names() -> None:
    assert _name_compares(ROOT / "bench") == []


def test_a_projection_is_calibrated_by_the_device_run_of_its_own_configuration() -> None:
    """The committed H100 runs (first run: fp32, no precision key; the GPU plan's rows:
    bf16-mixed + LoRA 16 twice, fp32 once): a projection takes the newest run that shares its
    precision, LoRA rank and update tokens, and a configuration never run gets no rows."""
    import json

    from bench.lib.child import ROOT
    from bench.lib.projection import calibration, devices

    h100 = devices()["h100"]

    def report(**cfg: object) -> dict:
        proj = {"peak": 5e9, "seconds": {"update": 1.0, "generation floor": 0.5}}
        return {"config": {"preset": "gpu", "precision": "fp32", "lora_rank": None,
                           "update_tokens": 4096, **cfg},
                "systems": {"sym": {"projection": proj}, "padded": {"projection": proj}}}

    def measured(item: str, system: str) -> float:  # read here from the committed plan rows
        for line in (ROOT / "bench/results/nvidia-h100-80gb-hbm3/2026-11-26b/plan.jsonl"
                     ).read_text().splitlines():
            row = json.loads(line)
            if row["item"] == item:
                return row["result"]["systems"][system]["peak_bytes"] / 1e9
        raise AssertionError(item)

    rows = calibration(report(precision="bf16-mixed", lora_rank=16), h100)
    peaks = {r["system"]: r for r in rows if r["what"] == "peak GB"}
    assert set(peaks) == {"sym", "padded"}
    for name in ("sym", "padded"):  # the newer of the two bf16 runs (2026-11-26b)
        assert "2026-11-26b" in peaks[name]["source"]
        assert peaks[name]["measured"] == measured("rl_step_bf16mixed_lora16", name)
        assert abs(peaks[name]["miss"] - (5.0 / peaks[name]["measured"] - 1)) < 1e-12
    fp32 = {r["system"]: r for r in calibration(report(), h100) if r["what"] == "peak GB"}
    assert all("rl_step_fp32" in r["source"] for r in fp32.values())  # not the first run
    assert fp32["sym"]["measured"] != peaks["sym"]["measured"]
    assert calibration(report(update_tokens=1280), h100) == []


def test_recalibrate_rewrites_the_device_rows_and_keeps_the_hand_note(tmp_path) -> None:
    import json
    import shutil

    from bench.experiments import project
    from bench.lib.child import ROOT

    src = ROOT / "bench/results/projection/rl_step_gpu_h100_bf16mixed_lora16"
    shutil.copy(src.with_suffix(".json"), tmp_path / "p.json")
    stale = json.loads((tmp_path / "p.json").read_text())
    stale.pop("config", None)  # a report written before the config was stored
    stale["calibration"] = []
    (tmp_path / "p.json").write_text(json.dumps(stale))
    (tmp_path / "p.md").write_text("# title\n\n> a note by hand\n\n`python -m bench project "
                                   "--preset gpu`\n\nold tables\n")
    assert project.main(["--recalibrate", str(tmp_path / "p.json")]) == 0
    md = (tmp_path / "p.md").read_text()
    assert md.startswith("# RL step projected") and "\n> a note by hand\n" in md
    assert "old tables" not in md
    assert "2026-11-26b/plan.jsonl (rl_step_bf16mixed_lora16, tree b0d2181)" in md
    got = json.loads((tmp_path / "p.json").read_text())
    assert got["config"]["precision"] == "bf16-mixed" and got["config"]["lora_rank"] == 16


def test_reprice_prices_every_device_at_its_own_roofline(tmp_path) -> None:
    """``bench reasoning --reprice``: each device's stage seconds are the programs' roofline on
    that device (max of flops over its float32 flops and bytes over its bandwidth, plus its
    dispatch cost, times the count) and "fits" is its own memory's JAX share, by hand from
    ``bench/devices.json``; the run's own command stays first in its .md."""
    import json

    from bench.lib.projection import devices

    row = {"programs": [{"stage": "update", "count": 3, "flops": 4e14, "bytes_accessed": 2e12}],
           "decode": {"weights_bytes": 1e9, "kv_bytes": 1e9},
           "ledger": {"peak": {"total": 50e9}}, "largest_batch": {"h100": 7, "a100-40gb": 2},
           "projection": {"seconds": {"update": -1.0}, "fits": False}}
    out = tmp_path / "run.json"
    out.write_text(json.dumps({"cap": 512, "device": "a100-40gb", "precision": "fp32",
                               "lora_rank": None, "samples": 4, "generation": "none",
                               "project": {"systems": {"sym": row}}, "dispatch": None}))
    out.with_suffix(".md").write_text("`the run's command`\n")
    assert bench_main(["reasoning", "--reprice", str(out)]) == 0
    got = json.loads(out.read_text())["by_device"]
    for name, dev in devices().items():
        t = max(4e14 / dev["flops"]["float32"], 2e12 / dev["bandwidth"]) + dev["dispatch_s"]
        assert got[name]["sym"]["other_stages_s"]["update"] == round(3 * t, 3)
        assert got[name]["sym"]["fits"] == (dev["memory"] * dev["jax_fraction"] >= 50e9)
    assert got["h100"]["sym"]["fits"] and not got["a100-40gb"]["sym"]["fits"]
    assert out.with_suffix(".md").read_text().startswith("`the run's command`, re-priced by")
