"""A picture of a training run, drawn from its JSON-lines metrics file.

Reading the file (not the in-memory history) means a resumed run's plot shows every step, the
ones run before the interruption included.
"""

from __future__ import annotations

import json
import os
from typing import Any

STAGES = ("generation", "reference", "reward", "update")


def read_metrics(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every complete JSON line of a metrics file, in order."""
    rows = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                rows.append(json.loads(line))
    return rows


def _smooth(xs: list[float], k: int = 10) -> list[float]:
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x
        if i >= k:
            acc -= xs[i - k]
        out.append(acc / min(i + 1, k))
    return out


def plot_run(rows: list[dict[str, Any]], out_png: str | os.PathLike[str], title: str = ""
             ) -> str:
    """Reward / exact match, KL, and per-stage seconds against the step; returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [m["step"] for m in rows]
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    ax = axes[0]
    for key, label in (("reward", "reward"), ("exact_match", "exact match (sampled)")):
        vals = [m.get(key) for m in rows]
        if any(v is not None for v in vals):
            vals = [float("nan") if v is None else v for v in vals]
            line = ax.plot(steps, vals, alpha=0.3)[0]
            ax.plot(steps, _smooth(vals), color=line.get_color(), label=f"{label}, mean of 10")
    ax.set(xlabel="step", ylim=(0, 1), title="reward and exact match")
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(alpha=0.3)
    ax = axes[1]
    kl = [m.get("kl") for m in rows]
    if any(v is not None for v in kl):
        ax.plot(steps, [float("nan") if v is None else v for v in kl], label="KL to reference")
        ax.set(title="KL (k3) to reference")
    else:
        ax.plot(steps, [m.get("entropy", float("nan")) for m in rows], label="entropy")
        ax.set(title="policy entropy (beta = 0: no reference)")
    ax.set(xlabel="step")
    ax.grid(alpha=0.3)
    ax = axes[2]
    for s in STAGES:
        vals = [m["seconds"].get(s, 0.0) for m in rows]
        if any(v > 0 for v in vals):
            ax.plot(steps, [v if v > 0 else float("nan") for v in vals], label=s, lw=1)
    # log scale: steps that compile a new shape cost 10-100x a steady-state step
    ax.set(xlabel="step", ylabel="seconds", title="time per step by stage", yscale="log")
    ax.legend(loc="upper right", fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return os.fspath(out_png)
