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
