"""What generation hands the rest of the step: the :class:`Rollout`, and the user's rewards on it.

Kept apart from the trainer because both are plain data/functions every system shares: a rollout
looks the same whether it came from the symbolic runtime or the padded baseline, and rewards are
computed on the host from exact token arrays either way.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, runtime_checkable

import numpy as np

from jaxrl_sym.errors import InputError
from jaxrl_sym.generation import GenerationConfig, validate_prompts
from jaxrl_sym.rl.errors import RewardError
from jaxrl_sym.rl.step.sampling import SamplingConfig


@runtime_checkable
class BatchReward(Protocol):
    """A reward that scores a step's samples in one call: ``score_batch(prompts, responses)``
    returns one number per sample, in order. Why: a reward model, an LLM judge or a batched
    verifier pays per call, and TRL-style reward functions take the step's completions as one
    list; called per sample they ran B times a step with lists of one."""

    def score_batch(self, prompts: Sequence[np.ndarray], responses: Sequence[np.ndarray]
                    ) -> Sequence[float]: ...


RewardFn = Callable[[np.ndarray, np.ndarray], float] | BatchReward
"""``reward_fn(prompt_tokens, response_tokens) -> float`` per sample, or a :class:`BatchReward`;
the response includes the EOS token when the row ended on one."""


@dataclass
class Rollout:
    """Generated samples, group after group (G consecutive samples share a prompt)."""

    prompts: list[np.ndarray]
    responses: list[np.ndarray]
    old_logprobs: list[np.ndarray]
    group_size: int
    stats: dict = field(default_factory=dict)
    ref_logprobs: list[np.ndarray] | None = None
    """Reference log-probs per sample when they were computed during generation (sym, beta > 0,
    ``ExecutionConfig.overlap_reference``); None means the step runs the reference pass
    afterwards."""

    @property
    def useful_tokens(self) -> int:
        return int(sum(len(p) + len(r) for p, r in zip(self.prompts, self.responses, strict=True)))

    @property
    def responses_sha256(self) -> str:
        """A digest of every response's tokens, in order, each with its length. Why: two systems
        (or two runs) given the same prompts and seed sample the same tokens, up to a sampling
        near-tie that float summation order can tip (``bench/results/cpu/reasoning_measured/``);
        comparing digests checks that without keeping or shipping the tokens."""
        h = hashlib.sha256()
        for r in self.responses:
            a = np.asarray(r, np.int64)
            h.update(np.int64(a.size).tobytes())
            h.update(a.tobytes())
        return h.hexdigest()


@dataclass(frozen=True)
class Drawn:
    """What a rollout source hands a step: the rollout to train on, what the step adds to its
    metrics (partial rollouts: ``{"partial": stats}``), and the rows in flight after it
    (:class:`~jaxrl_sym.rl.step.partial.PartialBuffer`; None: the source carries nothing). The
    trainer stores ``carried`` only when the step commits."""

    rollout: Rollout
    report: dict[str, Any] = field(default_factory=dict)
    carried: Any = None


def sampling_batch(cfg: SamplingConfig, prompts: Sequence[np.ndarray | Sequence[int]], seed: int,
                   limits: Sequence[int] | None, vocab_size: int
                   ) -> tuple[list[np.ndarray], GenerationConfig]:
    """The G-fold expanded prompt list and its generation config (per-row limits included).

    limits: optional response limits, one per prompt or one per sample (prompt-major, G per
    prompt); default ``cfg.max_new_tokens`` for every row.
    """
    n, g = len(prompts), cfg.group_size
    max_new: int | tuple[int, ...] = cfg.max_new_tokens
    if limits is not None:
        lim = [int(x) for x in limits]
        if len(lim) == n:
            lim = [x for x in lim for _ in range(g)]
        elif len(lim) != n * g:
            raise InputError(f"limits has {len(lim)} entries; give one per prompt ({n}) or "
                             f"one per sample ({n * g})")
        max_new = tuple(lim)
    gcfg = cfg.generation(seed)
    # Validate the user's prompts first so errors name *their* index, not a repeated copy's.
    ps = validate_prompts(list(prompts), vocab_size, gcfg)
    gcfg = replace(gcfg, max_new_tokens=max_new)
    return [p for p in ps for _ in range(g)], gcfg


def compute_rewards(fn: RewardFn, prompts: Sequence[np.ndarray], responses: Sequence[np.ndarray],
                    *, what: str = "reward function") -> np.ndarray:
    """Score every sample (one call for a :class:`BatchReward`, else one per sample) and insist
    on one finite real number each.

    Why so strict: a NaN or a vector reward would silently poison the group statistics and then
    every parameter; failing here, before the update, keeps the model intact and names the sample.
    """
    if isinstance(fn, BatchReward):
        try:
            values = list(fn.score_batch(list(prompts), list(responses)))
        except RewardError:
            raise
        except Exception as e:
            raise RewardError(f"{what} raised on the step's {len(prompts)} samples: "
                              f"{type(e).__name__}: {e}. The step was not applied.", 0) from e
        if len(values) != len(prompts):
            raise RewardError(f"{what} returned {len(values)} rewards for {len(prompts)} "
                              "samples; it must return one per sample. The step was not "
                              "applied.", 0)
    else:
        values = []
        for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
            try:
                values.append(fn(p, r))
            except Exception as e:
                raise RewardError(
                    f"{what} raised on sample {i} (prompt {p.tolist()}, response {r.tolist()}): "
                    f"{type(e).__name__}: {e}. The step was not applied.", i) from e
    return np.array([_one_reward(v, i, p, r, what) for i, (v, p, r) in
                     enumerate(zip(values, prompts, responses, strict=True))], np.float64)


def _one_reward(v: Any, i: int, p: np.ndarray, r: np.ndarray, what: str) -> float:
    """Sample ``i``'s reward ``v`` as a float, or a :class:`RewardError` naming the sample."""
    a = np.asarray(v)
    if a.shape != () or a.dtype == bool or not np.issubdtype(a.dtype, np.number) \
            or np.iscomplexobj(a):
        raise RewardError(
            f"{what} returned {type(v).__name__} of shape {a.shape} and dtype {a.dtype} on "
            f"sample {i}; it must return one real number per (prompt, response). The step "
            "was not applied.", i)
    if not np.isfinite(a):
        raise RewardError(f"{what} returned {float(a)} on sample {i} (prompt {p.tolist()}, "
                          f"response {r.tolist()}); rewards must be finite. The step was not "
                          "applied.", i)
    return float(a)
