"""PNG plots of the suite's rows (matplotlib, Agg): one line per system, one column per attention
kind, so sym, padded and per-shape can be compared on the same axes.

Configurations that ran out of memory are drawn as a red ✕ on the top edge of their panel at
their N, so a missing point reads as "OOM", not as "not measured".
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import math

import matplotlib.pyplot as plt
from matplotlib.ticker import FuncFormatter, NullLocator
from matplotlib.transforms import blended_transform_factory

Row = dict[str, Any]
KINDS = ("full", "window", "block", "linear", "mixed")
STYLE = {  # color, marker, label
    "sym-xla": ("tab:blue", "o", "sym (XLA)"),
    "sym-triton": ("tab:green", "s", "sym (Triton)"),
    "sym": ("tab:blue", "o", "sym"),
    "padded": ("tab:red", "^", "padded XLA"),
    "pershape": ("tab:orange", "D", "per-shape JAX"),
}


def _style(system: str) -> tuple[str, str, str]:
    return STYLE.get(system, ("tab:gray", ".", system))


def _systems(rows: Sequence[Row]) -> list[str]:
    order = list(STYLE)
    return sorted({r["system"] for r in rows}, key=lambda s: order.index(s) if s in order else 99)


def _title(rows: Sequence[Row], what: str) -> str:
    r = rows[0]
    date = max(x.get("date", "") for x in rows)[:10]
    extra = f"batch {r['batch']}" if "batch" in r else ""
    return f"{what} — {r.get('device', '?')}, preset {r.get('preset', '?')}, {extra}, {date}"


def _log_labels(v: float, _pos: object = None) -> str:
    """Plain numbers on log axes, only at 1, 2 and 5 times a power of ten (no 2×10⁰ clutter)."""
    if v <= 0:
        return ""
    lead = round(v / 10 ** math.floor(math.log10(v)), 6)
    return f"{v:g}" if lead in (1.0, 2.0, 5.0) else ""


def _plain_log_y(ax: Any) -> None:
    """Log y with plain-number labels; within less than a decade every tick is labelled (else a
    panel may show a single label)."""
    ax.set_yscale("log")
    lo, hi = ax.get_ylim()
    fmt = _log_labels if lo > 0 and hi / lo > 10 else (lambda v, _p=None: f"{v:g}")
    ax.yaxis.set_major_formatter(FuncFormatter(fmt))
    ax.yaxis.set_minor_formatter(FuncFormatter(fmt))


def _plain_log_x(ax: Any, values: Sequence[float]) -> None:
    """Log x with ticks exactly at the measured values."""
    ax.set_xscale("log")
    xs = sorted(set(values))
    ax.set_xticks(xs, [f"{x:g}" for x in xs])
    ax.xaxis.set_minor_locator(NullLocator())


def _mark_oom(ax: Any, xs: Sequence[float], color: str) -> None:
    if not xs:
        return
    tr = blended_transform_factory(ax.transData, ax.transAxes)
    ax.scatter(xs, [0.97] * len(xs), marker="x", s=60, color="red", transform=tr, zorder=5,
               clip_on=False)
    for x in xs:
        ax.annotate("OOM", (x, 0.97), xycoords=tr, xytext=(0, -12), textcoords="offset points",
                    fontsize=7, color="red", ha="center")


def _decode_grid(rows: Sequence[Row], metrics: Sequence[tuple[str, str, float, bool]],
                 path: Path, what: str) -> None:
    """Rows of panels = metrics, columns = attention kinds; x = N (log2)."""
    kinds = [k for k in KINDS if any(r["attention"] == k for r in rows)]
    systems = _systems(rows)
    fig, axes = plt.subplots(len(metrics), len(kinds), figsize=(3.6 * len(kinds),
                             2.9 * len(metrics)), squeeze=False)
    for j, kind in enumerate(kinds):
        for i, (key, label, scale, log) in enumerate(metrics):
            ax = axes[i][j]
            for s in systems:
                rs = sorted((r for r in rows if r["attention"] == kind and r["system"] == s),
                            key=lambda r: r["tokens"])
                ok = [r for r in rs if r["status"] == "ok" and r.get(key) is not None]
                color, marker, name = _style(s)
                if ok:
                    ax.plot([r["tokens"] for r in ok], [r[key] * scale for r in ok],
                            marker=marker, color=color, label=name, lw=1.6, ms=5)
                _mark_oom(ax, [r["tokens"] for r in rs if r["status"] == "oom"], color)
            _plain_log_x(ax, [r["tokens"] for r in rows if r["attention"] == kind])
            if log:
                _plain_log_y(ax)
            ax.grid(True, which="major", alpha=0.3)
            if i == 0:
                ax.set_title(kind, fontsize=11, fontweight="bold")
            if j == 0:
                ax.set_ylabel(label, fontsize=9)
            if i == len(metrics) - 1:
                ax.set_xlabel("new tokens per row N", fontsize=9)
            ax.tick_params(labelsize=8)
    handles, labels = {}, {}
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(lab, h)
            labels[lab] = lab
    fig.legend(list(handles.values()), list(labels), loc="upper center", ncol=len(handles),
               bbox_to_anchor=(0.5, 1.0), fontsize=10, frameon=False)
    fig.suptitle(_title(rows, what), y=1.045, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def plot_decode(rows: Sequence[Row], out_dir: Path) -> list[Path]:
    rows = [r for r in rows if r.get("scenario") == "decode"]
    if not rows:
        return []
    paths = [out_dir / "decode_time.png", out_dir / "decode_memory.png",
             out_dir / "decode_compiles_padding.png"]
    _decode_grid(rows, [("s_per_token", "ms per token (steady)", 1e3, True),
                        ("s_per_token_with_compile", "ms per token incl. compile", 1e3, True)],
                 paths[0], "Decoding time")
    _decode_grid(rows, [("peak_bytes", "peak device bytes (MB)", 2**-20, True),
                        ("peak_rss_bytes", "peak process RSS (MB)", 2**-20, False)],
                 paths[1], "Decoding memory")
    _decode_grid(rows, [("xla_compiles", "XLA compiles", 1.0, False),
                        ("key_padding_fraction", "attended key slots wasted (%)", 100, False),
                        ("padding_fraction", "token positions wasted (%)", 100, False)],
                 paths[2], "Compiles and padding")
    return paths


def _bars(ax: Any, rows: Sequence[Row], keys: Sequence[tuple[str, str, float]]) -> None:
    systems = _systems(rows)
    width = 0.8 / max(1, len(systems))
    for k, s in enumerate(systems):
        r = next(x for x in rows if x["system"] == s)
        color, _, name = _style(s)
        xs = [i + (k - (len(systems) - 1) / 2) * width for i in range(len(keys))]
        if r["status"] != "ok":
            for x in xs:
                ax.text(x, 0, r["status"].upper(), color="red", ha="center", va="bottom")
            continue
        vals = [(r.get(key) or 0) * scale for key, _, scale in keys]
        ax.bar(xs, vals, width=width, color=color, label=name)
        for x, v in zip(xs, vals, strict=True):
            ax.annotate(f"{v:.3g}", (x, v), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(keys)), [lab for _, lab, _ in keys], fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)


def plot_lengths(rows: Sequence[Row], out_dir: Path) -> list[Path]:
    """Realistic lengths (bars) and growing lengths (lines vs median response length)."""
    real = [r for r in rows if r.get("scenario") == "realistic"]
    grow = [r for r in rows if r.get("scenario") == "growing"]
    if not real and not grow:
        return []
    n = int(bool(real)) + int(bool(grow))
    fig, axes = plt.subplots(n, 3, figsize=(14, 3.6 * n), squeeze=False)
    i = 0
    if real:
        r0 = real[0]
        _bars(axes[i][0], real, [("seconds", "steady", 1.0),
                                 ("seconds_with_compile", "incl. compile", 1.0)])
        axes[i][0].set_ylabel("seconds per batch")
        _plain_log_y(axes[i][0])
        _bars(axes[i][1], real, [("peak_bytes", "peak device", 2**-20),
                                 ("peak_rss_bytes", "peak RSS", 2**-20)])
        axes[i][1].set_ylabel("MB")
        _plain_log_y(axes[i][1])
        _bars(axes[i][2], real, [("padding_fraction", "token positions", 100),
                                 ("key_padding_fraction", "key slots", 100)])
        axes[i][2].set_ylabel("wasted (%)")
        axes[i][0].legend(fontsize=8)
        axes[i][1].set_title(f"realistic lengths: {r0['batch']} rows, prompts "
                             f"{r0['prompt_len'][0]}–{r0['prompt_len'][1]}, responses log-normal "
                             f"median {r0['median']} capped at {r0['cap']}", fontsize=10)
        i += 1
    if grow:
        g0 = grow[0]
        panels = [(("seconds", "-", "steady"), ("seconds_with_compile", "--", "incl. compile"),
                   "seconds per batch", 1.0),
                  (("peak_bytes", "-", "device"), ("peak_rss_bytes", "--", "RSS"), "MB", 2**-20),
                  (("padding_fraction", "-", "tokens"), ("key_padding_fraction", "--", "keys"),
                   "wasted (%)", 100)]
        for j, (a, b, ylabel, scale) in enumerate(panels):
            ax = axes[i][j]
            for s in _systems(grow):
                rs = sorted((r for r in grow if r["system"] == s), key=lambda r: r["median"])
                ok = [r for r in rs if r["status"] == "ok"]
                color, marker, name = _style(s)
                for key, ls, what in (a, b):
                    ax.plot([r["median"] for r in ok], [r[key] * scale for r in ok], ls=ls,
                            marker=marker, color=color, label=f"{name}, {what}", ms=4)
                _mark_oom(ax, [r["median"] for r in rs if r["status"] == "oom"], color)
            _plain_log_x(ax, [r["median"] for r in grow])
            ax.set_xlabel("median response length (run → run)")
            ax.set_ylabel(ylabel)
            if j < 2:  # seconds and bytes span decades (device bytes vs process RSS)
                _plain_log_y(ax)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
        axes[i][1].set_title(f"growing lengths: median response ×10 over {len(grow) // 2} runs, "
                             f"{g0['batch']} rows, cap {g0['cap']}", fontsize=10)
    fig.suptitle(_title(real or grow, "Realistic and growing lengths (full attention)"),
                 fontsize=11)
    fig.tight_layout()
    path = out_dir / "lengths.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return [path]


def plot_trace(rows: Sequence[Row], out_dir: Path) -> list[Path]:
    """``trace_idle.png``: idle fraction (left) and useful tokens/s (right) per profile, one bar
    per system; a failed replay is a red ✕ at the bottom of its slot."""
    rows = [r for r in rows if r.get("scenario") == "trace"]
    if not rows:
        return []
    profiles = sorted({r["profile"] for r in rows})
    systems = _systems(rows)
    by = {(r["profile"], r["system"]): r for r in rows}
    fig, axes = plt.subplots(1, 2, figsize=(5 + 1.4 * len(profiles), 4.2))
    width = 0.8 / max(1, len(systems))
    for ax, (key, label, scale) in zip(axes, (("idle_fraction", "idle token positions (%)", 100),
                                             ("useful_tokens_per_s", "useful tokens/s", 1)),
                                       strict=True):
        for j, system in enumerate(systems):
            color, _, name = _style(system)
            for i, prof in enumerate(profiles):
                r = by.get((prof, system))
                x = i + (j - (len(systems) - 1) / 2) * width
                if r is None:
                    continue
                if r["status"] != "ok":
                    ax.plot([x], [0], "x", color="red", markersize=9)
                    continue
                ax.bar(x, r[key] * scale, width, color=color, label=name if i == 0 else None)
        ax.set_xticks(range(len(profiles)), profiles, rotation=20)
        ax.set_ylabel(label)
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylim(0, 100)
    axes[0].legend(fontsize=8)
    fig.suptitle(_title(rows, "Trace-driven profiles: idle fraction per system"), fontsize=9)
    path = out_dir / "trace_idle.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return [path]


def plot_all(rows: Sequence[Row], out_dir: Path) -> list[Path]:
    """Every figure the rows allow; returns the files written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    return plot_decode(rows, out_dir) + plot_lengths(rows, out_dir) + plot_trace(rows, out_dir)
