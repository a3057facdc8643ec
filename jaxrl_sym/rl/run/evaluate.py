"""``jaxrl-sym eval``: a model or a trained run scored on a dataset — greedy accuracy and pass@k
with the rewards training uses, on the same generation systems.

Why a command and not only the run's final evaluation: a practitioner compares the base model,
each checkpoint and a peer's export on the same held-out file, with the same grader, before and
after a run (TRL, verl and Tunix users do it with a separate script that re-implements the
reward). Here the rows are read by the training loader (:mod:`jaxrl_sym.rl.tasks.data`), prompts
rendered by the training task (:class:`~jaxrl_sym.rl.run.pretrained.TokenTextTask`: chat template,
system prompt), and the rewards are the ``--reward`` functions of training; generation runs on a
registered system (``sym`` by default, ``padded`` beside it).

pass@k is the unbiased estimator of Chen et al. (2021, "Evaluating Large Language Models Trained
on Code"): with ``n`` samples of a prompt of which ``c`` are correct,
``1 - C(n - c, k) / C(n, k)``, averaged over prompts; here ``n = samples`` and ``k`` every power
of two up to it (and ``n`` itself).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from math import comb
from typing import Any

import numpy as np

from jaxrl_sym import systems
from jaxrl_sym.errors import InputError
from jaxrl_sym.rl.tasks.text_tasks import FORMAT_WEIGHT, TextTask


@dataclass(frozen=True)
class EvalConfig:
    """What ``eval`` measures (JAX-free: the CLI builds it to check its flags).

    samples: completions sampled per prompt for pass@k (0: greedy only). temperature / seed:
    their sampling. max_new_tokens: the response limit. limit: evaluate the first rows only
    (None: every row). system: the registered generation system."""

    samples: int = 0
    temperature: float = 1.0
    seed: int = 0
    max_new_tokens: int = 256
    limit: int | None = None
    system: str = systems.REFERENCE

    def __post_init__(self) -> None:
        from jaxrl_sym.generation import check_sampling_temperature

        for flag, v, low in (("--samples", self.samples, 0),
                             ("--max-new-tokens", self.max_new_tokens, 1),
                             ("--limit", 1 if self.limit is None else self.limit, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise InputError(f"{flag} {v!r}: give a whole number >= {low}")
        if not (np.isfinite(self.temperature) and self.temperature > 0):
            raise InputError(f"--temperature {self.temperature}: pass@k samples, so give a "
                             "finite number > 0")
        check_sampling_temperature(self.temperature, "--temperature")
        if self.system not in systems.names(peer=False):
            raise InputError(f"--system {self.system}: choose from "
                             f"{', '.join(systems.names(peer=False))}")

    def ks(self) -> list[int]:
        """The k of pass@k: powers of two below ``samples``, and ``samples``."""
        out = [k for k in (1 << i for i in range(20)) if k < self.samples]
        return [*out, self.samples] if self.samples else []


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of ``k`` draws (without replacement) from ``n`` samples,
    ``c`` of them correct, is correct."""
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def evaluate_rows(model: Any, task: Any, problems: list[Any], cfg: EvalConfig,
                  eos: tuple[int, ...]) -> dict[str, Any]:
    """Greedy and sampled completions of ``problems`` (a
    :class:`~jaxrl_sym.rl.run.pretrained.TokenTextTask` renders and scores them) on ``cfg.system``.
    Returns the summary and one record per row."""
    from jaxrl_sym.generation import GenerationConfig

    t0 = time.perf_counter()
    prompts = task.use(problems)
    bound = systems.get(cfg.system).bind(model, systems.BindOptions())
    greedy = bound.generate(prompts, GenerationConfig(
        max_new_tokens=cfg.max_new_tokens, eos_id=eos or None, temperature=0.0)).tokens
    scored = _scored(task, prompts, greedy)
    rows = [{"prompt": p.prompt if not p.messages else [list(m) for m in p.messages],
             "answer": str(p.answer), "completion": s["text"], "correct": s["correct"],
             "format": s["format"], "reward": s["reward"]}
            for p, s in zip(problems, scored, strict=True)]
    out: dict[str, Any] = {
        "rows": len(problems), "system": cfg.system, "max_new_tokens": cfg.max_new_tokens,
        "greedy": {k: float(np.mean([s[k] for s in scored]))
                   for k in ("correct", "format", "reward")}}
    if cfg.samples:
        many = [p for p in prompts for _ in range(cfg.samples)]
        sampled = bound.generate(many, GenerationConfig(
            max_new_tokens=cfg.max_new_tokens, eos_id=eos or None,
            temperature=cfg.temperature, seed=cfg.seed)).tokens
        task.use(problems)  # a new round of scoring (the rewards' per-sample indices)
        s = _scored(task, many, sampled)
        right = np.asarray([x["correct"] for x in s]).reshape(len(prompts), cfg.samples)
        out["sampled"] = {"samples": cfg.samples, "temperature": cfg.temperature,
                          "seed": cfg.seed,
                          "reward": float(np.mean([x["reward"] for x in s])),
                          **{f"pass@{k}": float(np.mean([pass_at_k(cfg.samples, int(c), k)
                                                         for c in right.sum(1)]))
                             for k in cfg.ks()}}
        for r, row in zip(rows, right, strict=True):
            r["sampled_correct"] = int(row.sum())
    out["seconds"] = time.perf_counter() - t0
    return {"summary": out, "records": rows}


def _scored(task: Any, prompts: list[np.ndarray], responses: list[Any]) -> list[dict[str, Any]]:
    return [{"text": task.response_text(r), "correct": task.exact_match(p, r),
             "format": task.format_match(p, r), "reward": float(task.reward(p, r))}
            for p, r in zip(prompts, responses, strict=True)]


def dataset_task(problems: list[Any], name: str, text: Any, cfg: EvalConfig,
                 options: Any) -> Any:
    """The training task's rendering and scoring over a fixed list of rows."""
    from jaxrl_sym.rl.run.pretrained import TokenTextTask

    if not problems:
        raise InputError(f"--dataset {name}: no rows to evaluate")
    rewards = None if options is None else options.rewards
    system_prompt = None if options is None else options.system_prompt
    return TokenTextTask(TextTask(name, tuple(problems)), text, text.chat_template is not None,
                         cfg.max_new_tokens, FORMAT_WEIGHT, system_prompt=system_prompt,
                         rewards=rewards)
