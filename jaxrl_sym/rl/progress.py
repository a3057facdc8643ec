"""What a training run shows while it runs: the progress bar and the health check of each step.

Kept apart from the loop (:mod:`jaxrl_sym.rl.train`) because neither changes the run: they read
its per-step metrics and report.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["Bar", "RunHealth"]


class RunHealth:
    """Flags a run that has stopped learning, from its per-step metrics (``health`` per line).

    ``non-finite``: a reported metric is NaN/inf. ``entropy collapse``: the policy's entropy
    fell below :attr:`entropy_floor` nats/token while the reward moved less than
    :attr:`flat_tol` between the two halves of the last :attr:`window` steps — every group
    then samples (nearly) the same answer, its advantages are 0, and nothing changes any more.
    A run that converged to the right answers also ends with low entropy and a flat reward;
    the flag says the run has stopped moving, the reward says at what level.
    """

    entropy_floor = 0.05
    window = 50
    flat_tol = 0.01

    def __init__(self) -> None:
        self.rewards: list[float] = []

    def check(self, m: dict[str, Any]) -> str | None:
        bad = [k for k in ("reward", "loss", "entropy", "grad_norm")
               if m.get(k) is not None and not np.isfinite(m[k])]
        if bad:
            return f"diverged: non-finite {', '.join(bad)}"
        self.rewards.append(float(m["reward"]))
        if len(self.rewards) < self.window or m.get("entropy") is None:
            return None
        last = self.rewards[-self.window:]
        half = self.window // 2
        a, b = float(np.mean(last[:half])), float(np.mean(last[half:]))
        if m["entropy"] < self.entropy_floor and abs(b - a) < self.flat_tol:
            return (f"entropy collapse: entropy {m['entropy']:.3f} < {self.entropy_floor}, "
                    f"reward flat ({a:.3f} -> {b:.3f} over {self.window} steps)")
        return None


class Bar:
    """Rich progress bar with the latest reward / exact match; a no-op when disabled."""

    def __init__(self, enabled: bool, total: int, done: int, title: str) -> None:
        self.enabled = enabled
        self.total, self.done, self.title = total, done, title
        self.progress: Any = None
        self.seconds: list[float] = []  # per step of this run (a resumed run starts afresh)

    def __enter__(self) -> Bar:
        if self.enabled:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
            )

            # stderr: stdout stays machine-readable (``--json`` prints one object there)
            self.progress = Progress(TextColumn("{task.description}"), BarColumn(),
                                     MofNCompleteColumn(), TimeElapsedColumn(),
                                     TextColumn("{task.fields[info]}"),
                                     console=Console(stderr=True))
            self.progress.__enter__()
            self.task = self.progress.add_task(self.title, total=self.total,
                                               completed=self.done, info="")
        return self

    def advance(self, m: dict[str, Any]) -> None:
        if self.progress is not None:
            info = f"reward {m['reward']:.3f}"
            if "exact_match" in m:
                info += f"  exact {m['exact_match']:.3f}"
            # the mean over this run's steps (the last step alone jumps with compiles and with
            # response lengths), plus the remaining time it implies
            self.seconds.append(m["seconds"]["total"])
            mean = sum(self.seconds) / len(self.seconds)
            left = (self.total - self.done - len(self.seconds)) * mean
            info += f"  {mean:.2f}s/step (mean of {len(self.seconds)}), ~{left:.0f}s left"
            if m.get("entropy") is not None:
                info += f"  entropy {m['entropy']:.3f}"
            if m.get("health"):
                info += f"  [red]{m['health'].upper()}[/red]"
            self.progress.update(self.task, advance=1, info=info)

    def alert(self, text: str) -> None:
        """Show ``text`` in the progress line (the run is about to stop)."""
        if self.progress is not None:
            self.progress.update(self.task, info=f"[red]{text}[/red]")

    def __exit__(self, *exc: object) -> None:
        if self.progress is not None:
            self.progress.__exit__(*exc)
