"""A GPU plan's ``plan.jsonl`` as markdown, each measured row beside its projection.

``python -m bench gpu_plan --report bench/results/<device>/<date>/plan.jsonl`` writes
``plan.md`` beside it. The projection of an RL-step item is the committed ``bench project`` run
named by the item (:attr:`bench.experiments.gpu_plan.Item.projection`): XLA's memory and cost
analysis compiled on a CPU, never run. ``miss`` is projected / measured - 1.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.lib.child import ROOT

GB = 1e9


def load(path: Path) -> list[dict[str, Any]]:
    """The plan's rows; an item run more than once (a rerun on a warm machine) keeps its last
    row that was not skipped."""
    rows: dict[str, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if row["status"] != "skipped" or row["item"] not in rows:
            rows[row["item"]] = row
    return list(rows.values())


def _miss(projected: float | None, measured: float) -> str:
    if projected is None or not measured:
        return "—"
    return f"{100 * (projected / measured - 1):+.0f}%"


def _rl_rows(row: dict[str, Any], projection: dict[str, Any] | None) -> list[str]:
    lines = ["| system | step s | generation s | reference s | update s | peak GB | "
             "projected peak GB (miss) | projected update s (miss) | generation floor s | "
             "warm-up s (compiles) | train layout, padding |", "|" + "---|" * 11]
    for name, r in row["result"]["systems"].items():
        if "error" in r:
            lines.append(f"| {name} | {r.get('status', 'error')}: see plan.log |" + " |" * 9)
            continue
        sec, peak = r["seconds"], r["peak_bytes"]
        proj = (projection or {}).get("systems", {}).get(name, {}).get("projection")
        p_peak = proj["peak"] if proj else None
        p_upd = proj["seconds"].get("update") if proj else None
        floor = f"{proj['seconds']['generation floor']:.2f}" if proj else "—"
        lines.append(
            f"| {name} | {sec['total']:.2f} | {sec['generation']:.2f} | {sec['reference']:.2f} "
            f"| {sec['update']:.2f} | {peak / GB:.2f} | "
            + (f"{p_peak / GB:.2f} ({_miss(p_peak, peak)})" if proj else "—") + " | "
            + (f"{p_upd:.2f} ({_miss(p_upd, sec['update'])})" if p_upd else "—")
            + f" | {floor} | {r['warmup_seconds']:.0f} ({r['warmup_compiles']}) | "
            f"{'x'.join(map(str, r['layout_shape']))}, {r['padding_fraction']:.3f} |")
    for name, r in row["result"]["systems"].items():
        split = r.get("peak_bytes_after_stage")
        if split and "error" not in r:
            what = ("process peak RSS" if r.get("peak_source") == "host_rss"
                    else "allocator peak")
            lines.append(f"\n{name}: {what} GB after each stage of the warm-up step: "
                         + ", ".join(f"{k} {v / GB:.2f}" for k, v in split.items()))
    ratios = row["result"].get("ratios")
    if ratios:
        lines.append("\nsym vs padded (> 1: sym better): " + ", ".join(
            f"{k} {v:.2f}x" for k, v in ratios.items()))
    return lines


def _kernel_rows(row: dict[str, Any]) -> list[str]:
    info = row["result"]["info"]
    lines = [f"Copy bandwidth {info['copy_gbps']:.0f} GB/s (read+write); L2 flushed "
             f"({info['flush_bytes'] >> 20} MiB) before every launch.", "",
             "| variant | dtype | heads q/kv/d | batch | length | splits | us | KV MB | GB/s "
             "| % copy |",
             "|" + "---|" * 10]
    for k in row["result"]["rows"]:
        lines.append(f"| {k.get('variant', 'before')} | {k['dtype']} | "
                     f"{k['hq']}/{k['hkv']}/{k['d']} | {k['batch']} | "
                     f"{k['length']} | {k['splits']} | {k['us']:.1f} | {k['kv_mb']:.1f} | "
                     f"{k['gbps']:.0f} | {k['pct_copy']:.1f} |")
    return lines


def render(rows: list[dict[str, Any]], projections: dict[str, str | None]) -> str:
    """The plan's markdown: where each item's minutes went, then each item's result."""
    first = rows[0]
    commits = sorted({r["commit"] or "?" for r in rows})
    out = [f"# GPU plan on {first['device']} ({first['date'][:10]})", "",
           f"Tree {', '.join(c[:7] for c in commits)}; versions "
           + ", ".join(f"{k} {v}" for k, v in first["versions"].items()) + ".", "",
           "| item | status | seconds | expected min | command |", "|---|---|---:|---:|---|"]
    for r in rows:
        cmd = f"`python -m {r['command']}`" if r["command"] else "—"
        out.append(f"| {r['item']} | {r['status']} | {r['seconds']:.0f} | "
                   f"{r['expected_minutes']} | {cmd} |")
    for r in rows:
        out += ["", f"## {r['item']}", "", r["why"] + ".", ""]
        if not r["result"]:
            out.append(f"No result ({r['status']}): {r['tail'][-300:]}")
        elif r["item"] == "gpu_tests":
            out.append("JUnit counts: " + ", ".join(f"{k} {v}" for k, v in r["result"].items()))
        elif "markdown" in r["result"]:  # an experiment that renders its own table (refill)
            out.append(r["result"]["markdown"])
        elif "rows" in r["result"]:
            out += _kernel_rows(r)
        else:
            ref = projections.get(r["item"])
            proj = json.loads((ROOT / ref).read_text()) if ref else None
            if ref:
                out += [f"Projection: `{ref}` (`{proj['command']}`).", ""]
            out += _rl_rows(r, proj)
    return "\n".join(out) + "\n"


def write(plan: Path, projections: dict[str, str | None]) -> Path:
    md = plan.with_name("plan.md")
    md.write_text(render(load(plan), projections))
    return md
