"""The suite's ``trace`` scenario: length profiles (:mod:`jaxrl_sym.workloads`) replayed by every
system, each in its own child process (``suite_child.run_trace``), with idle fraction per profile.

Why a module of its own: ``suite_jobs.py`` plans and runs every scenario; what is specific to
replays (profiles → configurations, idle positions per system) lives here so it can be tested
alone.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jaxrl_sym.workloads import builtin_profiles, idle_fraction, load_trace

Steps = list[tuple[list[int], list[int]]]


def trace_configs(p: dict[str, Any], *, seed: int = 0,
                  trace: str | None = None) -> list[tuple[dict[str, Any], Steps]]:
    """(configuration, steps) per profile: the preset's built-in profiles, plus ``trace`` (a JSONL
    file, lengths divided by the preset's scale like the built-ins). The configuration carries
    the profile's digest, so a changed trace file is a new configuration, not a cached one."""
    t = p["trace"]
    profiles = builtin_profiles(batch=t["batch"], steps=t["steps"],
                                growing_steps=t["growing_steps"], scale=t["scale"], seed=seed)
    if trace:
        profiles.append(load_trace(trace, batch=t["batch"], scale=t["scale"]))
    out = []
    for prof in profiles:
        cfg = {"preset": p["preset"], "seed": seed, "scenario": "trace", "attention": "full",
               "window": p["window"], "block": p["block"], "profile": prof.name,
               "description": prof.description, "steps": len(prof.steps),
               "batch": len(prof.steps[0].prompt_lens), "lengths_sha": prof.digest()}
        out.append((cfg, [(list(s.prompt_lens), list(s.response_lens)) for s in prof.steps]))
    return out


def finish_row(row: dict[str, Any], steps: Steps) -> dict[str, Any]:
    """Add idle fraction and useful tokens/s to a child's ok row (its token positions: the
    engine's own log, or the registry's count from the system's shapes; see
    ``suite_child.run_trace``)."""
    row["idle_fraction"] = idle_fraction(row["needed_positions"], row["token_positions"])
    row["useful_tokens_per_s"] = row["useful_tokens"] / row["seconds"] if row["seconds"] else 0.0
    return row


def run_trace_job(spec: dict[str, Any], row: dict[str, Any], tmp: Path,
                  run: Callable[[str, str], tuple[str, str, int]]) -> dict[str, Any]:
    """Run one (profile, system) replay through ``run(spec_path, out_path)`` (the suite's child
    runner: returns status, stderr tail, return code) and build its result row."""
    steps: Steps = spec["steps"]
    spec_path, out = tmp / "spec.json", tmp / "out.json"
    out.unlink(missing_ok=True)
    spec_path.write_text(json.dumps(spec))
    status, err, rc = run(str(spec_path), str(out))
    row.update(status=status, useful_tokens=int(sum(sum(r) for _, r in steps)),
               max_limit=max(max(r) for _, r in steps))
    if status != "ok":
        row.update(error=err, returncode=rc)
        return row
    row.update(json.loads(out.read_text()))
    return finish_row(row, steps)
