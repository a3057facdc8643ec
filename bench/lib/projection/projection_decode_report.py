"""The decode projection's page (:mod:`bench.lib.projection.projection_decode`): peaks and their
buffers, projected seconds beside the memory-bound floor, the ledger against this machine, and the
calibration against a committed GPU run.

Why its own module: the tables are pure functions of the report's JSON, so a page can be
re-rendered and read without compiling anything. A ``## Findings`` section written by hand into
an existing page (which term of a missed row is wrong, and why) is kept when the page is
written again.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from bench.lib.projection import GB
from jaxrl_sym.systems import BASELINE

FINDINGS = "## Findings"
TIME_MISS, MEMORY_MISS = 0.25, 0.15  # the tolerances: beyond them a term is wrong


def render(report: dict[str, Any]) -> str:
    dev = report["device"]
    progs = ", ".join(f"{s} {r['distinct_programs']}" for s, r in report["systems"].items())
    lines = [f"# Decode projected to {dev['name']} ({report['preset']} preset)", "",
             f"`{report['command']}` — {report['seconds']:.0f} s on this machine; distinct "
             f"programs compiled (never run): {progs}.", "",
             "| run | system | peak GB | fits | peak at | by kind (GB) | projected s | by "
             "program (s) | buffers once s | floor s | dispatches |",
             "|---|---|---:|---|---|---|---:|---|---:|---:|---:|"]
    for system, out in report["systems"].items():
        lines += [f"| error | {system} | {e} | | | | | | | | |" for e in out["errors"]]
        for row in out["rows"]:
            lines.append(_row(system, row))
    lines += _buffers(report) + _measured(report) + _calibrated(report)
    return "\n".join(lines)


def _name(row: dict[str, Any]) -> str:
    return f"{row['model']} {row['attention']} N={row['tokens']}"


def _row(system: str, row: dict[str, Any]) -> str:
    p, pk = row["projection"], row["ledger"]["peak"]
    kinds = ", ".join(f"{k} {v / GB:.2f}" for k, v in pk["by_kind"].items() if v >= 5e5)
    stages = ", ".join(f"{k} {v:.3f}" for k, v in p["stages"].items())
    return (f"| {_name(row)} | {system} | {p['peak'] / GB:.2f} | {'yes' if p['fits'] else 'NO'} "
            f"| {pk['stage']} {pk['what']} | {kinds} | {p['seconds']:.3f} | {stages} | "
            f"{p['seconds_once']:.3f} | {p['floor_seconds']:.3f} | {row['ledger']['dispatches']} |")


def grouped(buffers: list[dict[str, Any]]) -> list[tuple[str, int, int]]:
    """Buffers of one name pattern summed (the stores of every layer: ``store 17 (ring
    64x512)`` and ``store 42 (ring 64x512)`` are ``store (ring 64x512)``): (name, count, bytes),
    largest first."""
    out: dict[str, list[int]] = {}
    for b in buffers:
        key = re.sub(r"^store \d+ ", "store ", b["name"])
        got = out.setdefault(key, [0, 0])
        got[0] += 1
        got[1] += b["bytes"]
    return sorted(((k, c, n) for k, (c, n) in out.items()), key=lambda x: -x[2])


def _buffers(report: dict[str, Any]) -> list[str]:
    out = ["", "Buffers at each peak (GB; stores of the same shape summed, ×count):", ""]
    for system, res in report["systems"].items():
        for row in res["rows"]:
            pk = row["ledger"]["peak"]
            parts = [f"{name}{f' ×{c}' if c > 1 else ''} {n / GB:.3f}"
                     for name, c, n in grouped(pk["buffers"]) if n >= pk["total"] / 200]
            out.append(f"- **{_name(row)}, {system}** ({pk['stage']}, {pk['what']}, "
                       f"{pk['total'] / GB:.2f}): " + "; ".join(parts))
    return out


def transient(system: str, row: dict[str, Any]) -> int:
    """The ledger's peak minus what is held before the call: the weights (and hoisted weight
    values, kept by the engine between calls); padded's inputs are placed before its run."""
    kinds = row["ledger"]["peak"]["by_kind"]
    held = kinds.get("weights", 0) + (kinds.get("batch", 0) if system == BASELINE else 0)
    return row["ledger"]["peak"]["total"] - held


def _measured(report: dict[str, Any]) -> list[str]:
    rows = [(s, r) for s, res in report["systems"].items() for r in res["rows"]
            if "measured" in r]
    if not rows:
        return []
    bw = report["cpu_copy_bandwidth"]
    out = ["", f"Ledger vs this machine (RSS rise during a warm call vs the ledger's transient "
               f"bytes; floor at this machine's copy bandwidth {bw / 1e9:.1f} GB/s):", "",
           "| run | system | ledger transient MB | measured rise MB | ledger ÷ measured | "
           "measured s | floor s (CPU) | measured ÷ floor |",
           "|---|---|---:|---:|---:|---:|---:|---:|"]
    for system, row in rows:
        t, m = transient(system, row), row["measured"]
        f = row["floor"]
        floor = (f["weights_bytes"] + f["kv_bytes"]) / bw
        ratio = t / m["rise"] if m["rise"] else float("nan")
        out.append(f"| {_name(row)} | {system} | {t / 1e6:.1f} | {m['rise'] / 1e6:.1f} | "
                   f"{ratio:.2f} | {m['seconds']:.3f} | {floor:.3f} | "
                   f"{m['seconds'] / floor:.1f} |")
    return out


def _miss(x: float | None, limit: float) -> str:
    if x is None:
        return "-"
    return f"**{x:+.0%}**" if abs(x) > limit else f"{x:+.0%}"


def _calibrated(report: dict[str, Any]) -> list[str]:
    rows = report.get("calibration") or []
    if not rows:
        return []
    out = ["", f"Projected vs measured on the device (bold: beyond {TIME_MISS:.0%} time / "
               f"{MEMORY_MISS:.0%} memory):", "",
           "| run | projected | measured | measured s | projected s (cost_analysis) | miss | "
           "projected s (buffers once) | miss | residual ms / step | floor s | "
           "measured ÷ floor | projected GB | measured GB | memory miss | dispatches "
           "projected / measured |",
           "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for c in rows:
        name = f"{c['attention']} N={c['tokens']}"
        if c["status"] != "ok":
            verdict = "fits: yes" if c["fits"] else "fits: NO"
            out.append(f"| {name} | {c['system']} | {c['measured_system']} {c['status']} | - | "
                       f"{c['projected_s']:.2f} | - | {c['once_s']:.2f} | - | - | "
                       f"{c['floor_s']:.2f} | - | {c['projected_peak'] / GB:.2f} ({verdict}) | "
                       "- | - | - |")
            continue
        out.append(
            f"| {name} | {c['system']} | {c['measured_system']} ({c['date'][:10]}) | "
            f"{c['measured_s']:.2f} | {c['projected_s']:.2f} | "
            f"{_miss(c['time_miss'], TIME_MISS)} | {c['once_s']:.2f} | "
            f"{_miss(c['once_miss'], TIME_MISS)} | {c['residual_ms_per_step']:.2f} | "
            f"{c['floor_s']:.2f} | {c['measured_over_floor']:.2f} | "
            f"{c['projected_peak'] / GB:.2f} | {c['measured_peak'] / GB:.2f} | "
            f"{_miss(c['memory_miss'], MEMORY_MISS)} | {c['dispatches']['projected']} / "
            f"{c['dispatches']['measured']} |")
    return out


def write(out: Path, report: dict[str, Any], text: str) -> None:
    """OUT.json and OUT.md; an existing page's ``## Findings`` section is kept."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    page = out.with_suffix(".md")
    old = page.read_text() if page.exists() else ""
    kept = old[old.index(FINDINGS):] if FINDINGS in old else ""
    page.write_text(text + "\n" + (f"\n{kept}" if kept else ""))
