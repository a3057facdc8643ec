"""Partial rollouts: a step stops generating once a target fraction of its rows finished, trains on
the groups that are complete, and carries the unfinished rows into the next step.

Why: with skewed response lengths a few long rows hold the whole step's generation while the
device idles on the rest (the RLVR workload study, ``bench/suite.py --only trace``). Stopping
early and finishing the long rows next step — while the next step's new rows already generate
beside them — trades a little off-policy-ness for less waiting. Off by default
(``RLTrainer(partial=None)``): the plain step is then exactly the step without this module.

Decisions, and why:

* **Carried rows are re-prefilled, not their stores kept.** An unfinished row resumes next step as
  a prompt ``original prompt + tokens so far``, prefilled under the *new* parameters by the
  runtime's packed prefill (cheap: one forward over the prefix). Keeping its KV stores would
  continue generation from keys/values computed by the old parameters — a state that no policy
  ever had — and would need the runtime to hold stores across steps and updates. Re-prefilling
  costs one prefix forward per carried row and keeps the engine untouched.
* **Carried tokens keep their generation-time log-probs.** The tokens a row emitted in an earlier
  step were sampled by that step's policy; their log-probs (``Rollout.old_logprobs``) stay the
  behaviour policy's, so the loss's importance ratio ``pi_current / pi_behaviour`` (clipped, see
  :func:`jaxrl_sym.rl.algorithms.losses.rl_loss`) corrects exactly the off-policy part. Nothing is
  recomputed.
* **A group is trained when all its G rows finished.** Group-relative advantages (GRPO, RLOO)
  compare the G responses of one prompt; training a partial group would bias its baseline. Rows
  that finished wait in the buffer for their group-mates (counted as ``waiting_rows``).
* **Staleness is capped.** A row carried ``max_carry`` times must finish in the next step (the
  step keeps generating until it has), so no trained token is more than ``max_carry`` updates
  old; the step reports carried rows and staleness (``metrics["partial"]``).
* **The stop rule**: the step stops when the target fraction of its rows has finished, every row
  at the carry cap has finished, and at least one group is complete.
* **Where it is checked**: on a system that can end generation mid-way (``System.
  generate_until``; the sym runtime asks after every read-back, a tile of steps), one
  generation call runs every row and ends a tile after the rule holds. A system whose generation
  is one program to the end (padded) runs segments of ``segment`` tokens per row instead, each a
  normal generation call on the still-unfinished rows (re-prefilled), checking the rule after
  each. Segments were the only way at first; on sym they made generation more than twice as
  slow (every segment re-prefills every row and pays its own dispatches;
  ``bench/results/partial_rollouts.md``), which the hook removes.
* **Not in checkpoints**: the carried rows live in the trainer's host memory; a run resumed from a
  checkpoint starts with an empty buffer (its trajectory then differs from an uninterrupted one).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from jaxrl_sym.errors import InputError
from jaxrl_sym.rl.config import PartialConfig
from jaxrl_sym.rl.step.context import StepContext
from jaxrl_sym.rl.step.rollout import Drawn, Rollout, sampling_batch
from jaxrl_sym.rl.step.state import TrainState

__all__ = ["Carried", "PartialBuffer", "PartialConfig", "Row", "partial_generate"]


@dataclass
class Row:
    """One sample in flight: its prompt, what it generated so far and with which log-probs."""

    uid: int
    group: int
    prompt: np.ndarray
    limit: int
    born: int  # the step (1-based) that started generating it
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    carried: int = 0  # steps it was carried into (unfinished at the end of a step)
    done: bool = False


def _seg_seed(seed: int, seg: int) -> int:
    """Segment 0 samples with the step's seed (so fraction 1 with one segment is the plain
    step); later segments with distinct seeds derived from it (both then go through
    :meth:`~jaxrl_sym.rl.step.sampling.SamplingConfig.generation`'s one seed rule)."""
    return seed if seg == 0 else (int(seed) * 1_000_003 + seg * 104_729) & 0x7FFFFFFF


class PartialBuffer:
    """The rows in flight between steps (unfinished, or finished and waiting for their group)."""

    def __init__(self, cfg: PartialConfig) -> None:
        self.cfg = cfg
        self.rows: list[Row] = []
        self.next_uid = 0
        self.next_group = 0
        self.last_trained: list[Row] = []  # the rows the last step trained (tests, debugging)

    def add(self, expanded: list[np.ndarray], limits: Sequence[int], group_size: int,
            step: int) -> None:
        """New samples, G consecutive per prompt (``sampling_batch``'s order)."""
        for i, (p, lim) in enumerate(zip(expanded, limits, strict=True)):
            if i % group_size == 0:
                self.next_group += 1
            self.rows.append(Row(self.next_uid, self.next_group, p, int(lim), step))
            self.next_uid += 1

    def complete_groups(self, finished: frozenset[int] = frozenset()) -> list[int]:
        """Groups whose rows are all done (``finished``: uids also counted as done)."""
        by: dict[int, bool] = {}
        for r in self.rows:
            by[r.group] = by.get(r.group, True) and (r.done or r.uid in finished)
        return sorted(g for g, ok in by.items() if ok)

    def _should_stop(self, started: int, must: list[Row],
                     finished: frozenset[int] = frozenset()) -> bool:
        """The stop rule (module docstring); ``finished``: uids that ended during the
        generation call in progress (their ``Row`` is updated when it returns)."""
        done = lambda r: r.done or r.uid in finished
        unfinished = sum(not done(r) for r in self.rows)
        frac = 1.0 - unfinished / started if started else 1.0
        return (frac >= self.cfg.fraction and all(done(r) for r in must)
                and bool(self.complete_groups(finished)))

    def _stop_live(self, started: int, todo: list[Row]) -> int:
        """Most unfinished rows among ``todo`` at which the stop rule can first hold: the
        fraction's share of ``started`` (rows outside ``todo`` are already done)."""
        allowed = started - math.ceil(self.cfg.fraction * started - 1e-9)
        return max(0, min(len(todo), allowed))

    def generate(self, ctx: StepContext, seed: int) -> dict[str, Any]:
        """Generate until the stop rule holds (one call that stops itself where the system can,
        else segments); returns generation stats."""
        todo = [r for r in self.rows if not r.done]
        started, must = len(todo), [r for r in todo if r.carried >= self.cfg.max_carry]
        resumed = sum(r.carried > 0 for r in todo)
        seg, run_s, compile_s, early, loops = 0, 0.0, 0.0, False, 0
        while todo and (seg == 0 or not self._should_stop(started, must)):
            prompts = [np.concatenate([r.prompt, np.asarray(r.tokens, np.int32)]) for r in todo]
            full = tuple(r.limit - len(r.tokens) for r in todo)
            gcfg = ctx.sampling.generation(_seg_seed(seed, seg), full)
            rows = todo
            stop = lambda fin, rows=rows: self._should_stop(
                started, must, frozenset(r.uid for r, f in zip(rows, fin, strict=True) if f))
            res = ctx.system.generate_until(prompts, gcfg, stop,
                                            stop_live=self._stop_live(started, todo))
            if res is None:  # this system runs every row to its end: a segment at a time
                gcfg = replace(gcfg, max_new_tokens=tuple(min(self.cfg.segment, n)
                                                          for n in full))
                res = ctx.system.generate(prompts, gcfg)
            else:
                early = early or bool(res.stats.get("stopped_early", False))
            run_s += float(res.stats.get("run_seconds", 0.0))
            compile_s += float(res.stats.get("compile_seconds", 0.0))
            loops += int(res.stats.get("groups", 1))
            eos = set(gcfg.eos_ids)
            for r, t, lp in zip(todo, res.tokens, res.logprobs, strict=True):
                r.tokens += [int(x) for x in t]
                r.logprobs += [float(x) for x in lp]
                r.done = len(r.tokens) >= r.limit or (bool(r.tokens) and r.tokens[-1] in eos)
            todo = [r for r in todo if not r.done]
            seg += 1
        return {"segments": seg, "decode_loops": loops, "stopped_early": early,
                "generating_rows": started, "resumed_rows": resumed, "run_seconds": run_s,
                "compile_seconds": compile_s}

    def take(self, step: int) -> tuple[list[Row], dict[str, Any]]:
        """Remove and return the complete groups' rows (group order, G consecutive); the rows
        left unfinished are counted as carried once more."""
        ready = set(self.complete_groups())
        out = sorted((r for r in self.rows if r.group in ready), key=lambda r: (r.group, r.uid))
        self.rows = [r for r in self.rows if r.group not in ready]
        for r in self.rows:
            if not r.done:
                r.carried += 1
        stale = [step - r.born for r in out]
        self.last_trained = out
        return out, {"trained_groups": len(ready), "trained_rows": len(out),
                     "trained_carried_rows": sum(r.carried > 0 for r in out),
                     "carried_rows": sum(not r.done for r in self.rows),
                     "waiting_rows": sum(r.done for r in self.rows),
                     "max_staleness": max(stale, default=0),
                     "mean_staleness": float(np.mean(stale)) if stale else 0.0}


def partial_generate(ctx: StepContext, state: TrainState, buf: PartialBuffer,
                     prompts: Sequence[Any], seed: int, limits: Sequence[int] | None
                     ) -> tuple[Rollout, dict[str, Any]]:
    """Add the step's new prompts to ``buf``, generate until the stop rule, and return the
    complete groups as a rollout (carried tokens with their behaviour log-probs) plus the
    step's partial stats."""
    sampling, step = ctx.sampling, state.step + 1
    if len(prompts):
        expanded, gcfg = sampling_batch(sampling, prompts, seed, limits, ctx.vocab_size)
        lim = (gcfg.max_new_tokens if isinstance(gcfg.max_new_tokens, tuple)
               else (gcfg.max_new_tokens,) * len(expanded))
        buf.add(expanded, lim, sampling.group_size, step)
    if not buf.rows:
        raise InputError("no prompts given and no carried rows left: pass prompts")
    gen = buf.generate(ctx, seed)
    rows, taken = buf.take(step)
    rollout = Rollout([r.prompt for r in rows], [np.asarray(r.tokens, np.int32) for r in rows],
                      [np.asarray(r.logprobs, np.float32) for r in rows], sampling.group_size,
                      {"run_seconds": gen["run_seconds"],
                       "compile_seconds": gen["compile_seconds"]})
    return rollout, {**gen, **taken}


@dataclass(frozen=True)
class Carried:
    """The partial-rollouts source: the rows ``buffer`` carries plus G samples of each new
    prompt (which may be none, to finish the carried rows), generated until the stop rule.

    ``buffer`` is never changed: the source works on a copy and returns it as
    :attr:`Drawn.carried`, which the trainer keeps only when the step commits — a failing reward
    function or a diverged update leaves parameters *and* carried rows as they were.
    """

    buffer: PartialBuffer
    prompts: Sequence[Any]
    seed: int
    limits: Sequence[int] | None = None

    def draw(self, ctx: StepContext, state: TrainState) -> Drawn:
        buf = copy.deepcopy(self.buffer)
        rollout, stats = partial_generate(ctx, state, buf, self.prompts, self.seed, self.limits)
        return Drawn(rollout, {"partial": stats}, buf)
