"""A picture of a training run, drawn from its JSON-lines metrics file.

Reading the file (not the in-memory history) means a resumed run's plot shows every step, the
ones run before the interruption included. Besides reward and time, the plot shows the training
signals that tell a stalled run from a learning one before the reward does: policy entropy (a
collapse to ~0 means every group samples the same answer), the share of zero-variance groups
(they give no gradient), advantage scale, clipping and importance ratios, response lengths and the
gradient norm.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

STAGES = ("generation", "reference", "reward", "update")

# (panel title, [(metric key, label)], y scale)
PANELS: tuple[tuple[str, tuple[tuple[str, str], ...], str], ...] = (
    ("reward and exact match", (("reward", "reward"), ("exact_match", "exact match (sampled)")),
     "linear"),
    ("policy entropy and KL", (("entropy", "entropy (nats/token)"), ("kl", "KL to reference"),
                               ("kl_old", "KL to sampling policy")), "linear"),
    ("groups and advantages", (("zero_var_frac", "zero-variance groups"),
                               ("adv_std", "advantage std"), ("clip_frac", "clip fraction")),
     "linear"),
    ("importance ratio", (("ratio_max", "max"), ("ratio_mean", "mean"), ("ratio_min", "min")),
     "linear"),
    ("response length and grad norm", (("response_len", "response length, mean"),
                                       ("response_len_max", "response length, max"),
                                       ("grad_norm", "grad norm (before clipping)")), "linear"),
)


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
    """Trailing mean of k (NaN entries are skipped, so a None-filled series stays NaN)."""
    out = []
    for i in range(len(xs)):
        win = [x for x in xs[max(0, i - k + 1):i + 1] if not math.isnan(x)]
        out.append(sum(win) / len(win) if win else float("nan"))
    return out


def _series(rows: list[dict[str, Any]], key: str) -> list[float] | None:
    vals = [m.get(key) for m in rows]
    if all(v is None for v in vals):
        return None
    return [float("nan") if v is None else float(v) for v in vals]


def _panel(ax: Any, steps: list[int], rows: list[dict[str, Any]], title: str,
           keys: tuple[tuple[str, str], ...]) -> None:
    for key, label in keys:
        vals = _series(rows, key)
        if vals is None:
            continue
        line = ax.plot(steps, vals, alpha=0.25, lw=0.8)[0]
        ax.plot(steps, _smooth(vals), color=line.get_color(), label=f"{label}, mean of 10")
    ax.set(xlabel="step", title=title)
    ax.legend(loc="best", fontsize=7)
    ax.grid(alpha=0.3)


def plot_run(rows: list[dict[str, Any]], out_png: str | os.PathLike[str], title: str = ""
             ) -> str:
    """Reward / exact match, the training signals and per-stage seconds against the step;
    steps whose health check flagged a problem are marked in red. Returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [m["step"] for m in rows]
    fig, axes = plt.subplots(2, 3, figsize=(16, 7.5))
    flat = list(axes.ravel())
    for ax, (name, keys, scale) in zip(flat, PANELS, strict=False):
        _panel(ax, steps, rows, name, keys)
        ax.set_yscale(scale)
    flat[0].set_ylim(0, 1)
    flagged = [m["step"] for m in rows if m.get("health")]
    if flagged:
        flat[0].axvline(flagged[0], color="red", ls="--", lw=1,
                        label=f"health: {rows[steps.index(flagged[0])]['health'][:40]}")
        flat[0].legend(loc="best", fontsize=7)
    ax = flat[5]
    for s in STAGES:
        vals = [m["seconds"].get(s, 0.0) for m in rows]
        if any(v > 0 for v in vals):
            ax.plot(steps, [v if v > 0 else float("nan") for v in vals], label=s, lw=1)
    # log scale: steps that compile a new shape cost 10-100x a steady-state step
    ax.set(xlabel="step", ylabel="seconds", title="time per step by stage", yscale="log")
    ax.legend(loc="upper right", fontsize=7)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    # written beside and renamed: a failed write (a full disk) leaves no empty or truncated
    # image under the asked name
    tmp = f"{out_png}.partial"
    try:
        fig.savefig(tmp, dpi=100, format=os.path.splitext(str(out_png))[1][1:] or "png")
        os.replace(tmp, out_png)
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.remove(tmp)
    return os.fspath(out_png)
