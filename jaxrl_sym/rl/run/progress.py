"""What a training run shows while it runs: the progress bar and the health check of each step.

Kept apart from the loop (:mod:`jaxrl_sym.rl.run.train`) because neither changes the run: they read
its per-step metrics and report.
"""

from __future__ import annotations

import itertools
import sys
from typing import Any

import numpy as np

__all__ = ["Bar", "GreedyDrift", "RunHealth", "distinct2", "recipe_line"]


class RunHealth:
    """Flags a run that has stopped learning, from its per-step metrics (``health`` per line).

    ``non-finite``: a reported metric is NaN/inf. ``entropy collapse``: the policy's entropy
    fell below :attr:`entropy_floor` nats/token while the reward moved less than
    :attr:`flat_tol` between the two halves of the last :attr:`window` steps — every group
    then samples (nearly) the same answer, its advantages are 0, and nothing changes any more.
    A run that converged to the right answers also ends with low entropy and a flat reward;
    the flag says the run has stopped moving, the reward says at what level. ``no learning
    signal``: for :attr:`stall_steps` steps in a row every group's rewards were identical
    (``zero_var_frac`` 1) or the gradient was exactly 0 — the reward teaches nothing (a new
    user's first run with a reward that never fires, e.g. reward 0 on every sample).
    """

    entropy_floor = 0.05
    window = 50
    flat_tol = 0.01
    stall_steps = 3

    def __init__(self, algo: str = "grpo") -> None:
        self.rewards: list[float] = []
        self.stalled = 0  # consecutive steps without a learning signal
        self.stalling = False  # the last check's flag was the stall's
        self.grouped = algo != "ppo"  # PPO's critic gives identical rewards advantages too

    def check(self, m: dict[str, Any]) -> str | None:
        bad = [k for k in ("reward", "loss", "entropy", "grad_norm")
               if m.get(k) is not None and not np.isfinite(m[k])]
        if bad:
            return f"diverged: non-finite {', '.join(bad)}"
        self.rewards.append(float(m["reward"]))
        self.stalling = False
        stall = self._stall(m)
        if stall is not None:
            self.stalling = True  # the weakest flag: a drift check's flag may replace it
            return stall
        if len(self.rewards) < self.window or m.get("entropy") is None:
            return None
        last = self.rewards[-self.window:]
        half = self.window // 2
        a, b = float(np.mean(last[:half])), float(np.mean(last[half:]))
        if m["entropy"] < self.entropy_floor and abs(b - a) < self.flat_tol:
            return (f"entropy collapse: entropy {m['entropy']:.3f} < {self.entropy_floor}, "
                    f"reward flat ({a:.3f} -> {b:.3f} over {self.window} steps)")
        return None


    def _stall(self, m: dict[str, Any]) -> str | None:
        same = self.grouped and m.get("zero_var_frac") == 1.0
        zero = m.get("grad_norm") == 0.0
        self.stalled = self.stalled + 1 if (same or zero) else 0
        if self.stalled < self.stall_steps:
            return None
        why = (f"every group's rewards were identical (reward {m['reward']:.3f})" if same
               else "the gradient was exactly 0")
        return (f"no learning signal: for {self.stalled} steps in a row {why}, so every "
                "policy-gradient term is 0 and the reward teaches nothing; check that the "
                "reward separates good from bad samples (e.g. partial credit, a format "
                "reward), or raise --group or --temperature")


def distinct2(tokens: Any) -> float:
    """Distinct bigrams / bigrams of one response (1.0 for fewer than two bigrams): a
    degenerate loop ("you you you ...") drives it towards 0."""
    t = [int(x) for x in tokens]
    pairs = list(itertools.pairwise(t))
    return len(set(pairs)) / len(pairs) if len(pairs) > 1 else 1.0


class GreedyDrift:
    """Catches a pretrained policy wrecked by its first updates, from its greedy responses to a
    few fixed probe prompts and its KL to the reference (``health`` per line).

    Why: too large a learning rate or an entropy bonus can turn a chat model into one that
    answers "Hello" with "...named you you you..." after a single step, while the reward (all
    zero for a model that never answered right) and the entropy (which the bonus *raises*) look
    normal, so :class:`RunHealth` sees nothing. Two signs do show it:

    * ``policy collapse``: the probes' greedy responses lost most of their distinct bigrams
      (:func:`distinct2`, mean over probes, below :attr:`repeat_ratio` of its value at the start
      and below :attr:`repeat_floor`) — the policy repeats itself;
    * ``KL jump``: the KL to the reference (β > 0) exceeds :attr:`kl_jump` nats/token within
      the first :attr:`early` steps — a fine-tuning step should move the policy by far less.

    The probes are decoded at the start, after the first step and every :attr:`every` steps.
    """

    repeat_ratio = 0.5
    repeat_floor = 0.5
    kl_jump = 1.0
    early = 10
    every = 25

    def __init__(self, start: list[Any]) -> None:
        self.start = float(np.mean([distinct2(r) for r in start])) if start else 1.0

    def due(self, step: int) -> bool:
        return step == 1 or step % self.every == 0

    def check(self, step: int, m: dict[str, Any], responses: list[Any] | None) -> str | None:
        kl = m.get("kl")
        if kl is not None and step <= self.early and kl > self.kl_jump:
            return (f"KL jump: KL to the reference {kl:.3f} nats/token at step {step} "
                    f"(> {self.kl_jump}); lower --lr")
        if not responses:
            return None
        now = float(np.mean([distinct2(r) for r in responses]))
        if now < self.repeat_floor and now < self.repeat_ratio * self.start:
            return (f"policy collapse: the probes' greedy responses repeat themselves (distinct "
                    f"bigrams {self.start:.2f} -> {now:.2f} since the start); lower --lr or "
                    "drop --entropy-coef")
        return None


def recipe_line(cfg: Any, trainer: Any, run: Any) -> str:
    """One line of the settings a run trains with (the recipe a ``--model`` run picks is not
    the from-scratch one; printed so a user sees which they got). ``cfg``: an RLConfig."""
    a, o = cfg.algorithm, cfg.optim
    lora = "off" if run.lora is None else f"rank {run.lora.rank}, alpha {run.lora.alpha:g}"
    decay = f", weight decay {o.weight_decay:g}" if o.weight_decay else ""
    return (f"recipe: {a.algo}, {o.optimizer}{decay}, lr {o.lr:g} (warm-up "
            f"{o.warmup_steps}, {o.lr_schedule}),"
            f" beta {a.beta:g}, entropy_coef {a.entropy_coef:g}, clip {a.clip_eps:g}/"
            f"{a.clip_high:g}, group {a.group_size}, max_new_tokens {a.max_new_tokens}, "
            f"update_tokens {cfg.execution.update_tokens}, precision {trainer.precision.name}, "
            f"lora {lora}")


PLAIN_STAGE_SECONDS = 1.0  # a log gets a line for a stage this long (a step's short ones: none)


class Bar:
    """Rich progress bar with the latest reward / exact match; a no-op when disabled. When
    stderr is not a terminal (a log file, a batch job) one plain line per step instead: a bar
    redrawn in place writes nothing a log can show until the run ends."""

    def __init__(self, enabled: bool, total: int, done: int, title: str) -> None:
        self.enabled = enabled
        self.total, self.done, self.title = total, done, title
        self.plain = False  # one line per step (set on entry: stderr is not a terminal)
        self.progress: Any = None
        self.seconds: list[float] = []  # per step of this run (a resumed run starts afresh)

    def __enter__(self) -> Bar:
        self.plain = self.enabled and not sys.stderr.isatty()
        if self.enabled and not self.plain:
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
        if self.progress is not None or self.plain:
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
            if self.plain:
                step = self.done + len(self.seconds)
                health = f"  {m['health'].upper()}" if m.get("health") else ""
                print(f"{self.title} step {step}/{self.total}: {info}{health}", file=sys.stderr,
                      flush=True)
                return
            if m.get("health"):
                info += f"  [red]{m['health'].upper()}[/red]"
            self.progress.update(self.task, advance=1, info=info)

    def stage(self, name: str, seconds: float | None, tokens: int) -> None:
        """A stage of the step under way started (``seconds`` None) or ended: shown in the bar
        (a terminal), or one line per ended stage (a log) — a first step on a CPU can take
        minutes, and nothing moved until it ended."""
        step = self.done + len(self.seconds) + 1
        rate = f", {tokens / seconds:.0f} tokens/s" if tokens and seconds else ""
        if self.plain and seconds is not None and seconds >= PLAIN_STAGE_SECONDS:
            print(f"{self.title} step {step}/{self.total}: {name} {seconds:.1f} s{rate}",
                  file=sys.stderr, flush=True)
        elif self.progress is not None:
            what = f"{name}…" if seconds is None else f"{name} {seconds:.1f} s{rate}"
            self.progress.update(self.task, info=f"step {step}: {what}")

    def alert(self, text: str) -> None:
        """Show ``text`` in the progress line (the run is about to stop)."""
        if self.plain:
            print(f"{self.title}: {text}", file=sys.stderr, flush=True)
        elif self.progress is not None:
            self.progress.update(self.task, info=f"[red]{text}[/red]")

    def __exit__(self, *exc: object) -> None:
        if self.progress is not None:
            self.progress.__exit__(*exc)
