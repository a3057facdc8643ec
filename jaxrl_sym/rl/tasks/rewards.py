"""Your reward: ``--reward module:function`` (repeatable) and built-in graders, weighted and summed.

Why: a practitioner's task is graded by their own code. A reward is a Python function with the
signature of TRL's reward functions, ``f(prompts, completions, **row_fields) -> list[float]``:
``prompts`` as the dataset holds them (text, or a chat prompt's list of ``{role, content}``),
``completions`` the decoded responses, and every other field of the rows as a keyword list
(``answer=[...]``, raw as read: GSM8K's ``"... #### 72"``). Built-in graders are named instead
of a ``module:function``: ``exact_number`` (the answer from ``#### N``, ``\\boxed{N}`` or the last
number equals the row's, no format credit), ``boxed`` (the last ``\\boxed{N}`` equals it) and
``format`` (the response has a ``#### N`` line, right or wrong: paid alone it was reward-hacked,
see :mod:`jaxrl_sym.rl.tasks.text_tasks`, so give it a small weight). The step's reward is
``sum(w_i * r_i)`` (``--reward-weights``, default 1 each); each ``r_i``'s mean is logged per step
as ``reward/<name>``.

The trainer scores a step's samples in one call (:meth:`RewardSet.score_next`, through
:class:`~jaxrl_sym.rl.step.rollout.BatchReward`), so a function is called once per step with
every completion of it, as TRL calls it (evaluation still calls it per sample). What it returns
is checked: an exception, a non-number, NaN/inf or a list of the wrong length is an InputError
naming the function and the sample (its index in the step's batch), and the loop saves the last
finished step first when the run has a checkpoint directory (:func:`reward_failure`).
``module:function`` is imported at the start (the current directory first on ``sys.path``, as
TRL and verl do), before JAX is; a missing module or function is refused then, and the
module's source digest is part of the run's identity (a resume with edited reward code is a
changed run).
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import math
import numbers
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import numpy as np

from jaxrl_sym.errors import InputError
from jaxrl_sym.rl.errors import RewardError
from jaxrl_sym.rl.tasks.data import Fields, TextOptions, open_dataset, parse_answer, short
from jaxrl_sym.rl.tasks.text_tasks import Problem, answer_in, extract_answer, format_answer


def _targets(answer: Sequence[Any]) -> list[Fraction]:
    return [parse_answer(a, f"answer[{i}]") for i, a in enumerate(answer)]


def exact_number(prompts: list[Any], completions: list[str], answer: Sequence[Any],
                 **_: Any) -> list[float]:
    """1.0 where the response's answer (``#### N``, else ``\\boxed{N}``, else its last number)
    equals the row's, whatever the format."""
    return [float(extract_answer(c).value == t)
            for c, t in zip(completions, _targets(answer), strict=True)]


def boxed(prompts: list[Any], completions: list[str], answer: Sequence[Any],
          **_: Any) -> list[float]:
    """1.0 where the response's last ``\\boxed{N}`` equals the row's answer."""
    return [float(answer_in(c, "boxed") == t)
            for c, t in zip(completions, _targets(answer), strict=True)]


def format_reward(prompts: list[Any], completions: list[str], **_: Any) -> list[float]:
    """1.0 where the response gives a ``#### N`` answer, right or wrong."""
    return [float(answer_in(c, "hash") is not None) for c in completions]


BUILTINS: dict[str, Callable[..., list[float]]] = {
    "exact_number": exact_number, "boxed": boxed, "format": format_reward}
RESERVED = ("prompts", "completions")  # the positional arguments: never a row field's keyword


class RewardFunctionError(InputError):
    """A reward function raised or returned something that is not one finite number per
    completion; the message names the function and the sample."""


@dataclass(frozen=True)
class Reward:
    """One term of the reward: its name as given, the function, its weight, and the digest of
    its module's source (None for a built-in)."""

    name: str
    fn: Callable[..., Any]
    weight: float = 1.0
    builtin: bool = False
    source_sha256: str | None = None


def _import(name: str, module: str) -> Any:
    """``module``, imported with the current directory first on ``sys.path``."""
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name is not None and (module == err.name or module.startswith(f"{err.name}.")):
            raise InputError(f"--reward {name}: no module {module!r} in the current directory "
                             f"({cwd}) or on sys.path") from None
        raise InputError(f"--reward {name}: importing {module!r} failed: {err}") from None
    except Exception as err:  # a syntax error, an exception at import: the user's code
        raise InputError(f"--reward {name}: importing {module!r} failed: "
                         f"{type(err).__name__}: {err}") from None


def resolve(name: str) -> Reward:
    """A built-in grader by name, or ``module:function`` imported now (refused by name when the
    module or the function is missing)."""
    if name in BUILTINS:
        return Reward(name, BUILTINS[name], builtin=True)
    module, sep, attr = name.partition(":")
    if not sep or not module or not attr:
        raise InputError(f"--reward {name!r}: neither a built-in reward "
                         f"({', '.join(BUILTINS)}) nor module:function")
    mod = _import(name, module)
    fn: Any = mod
    for part in attr.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            raise InputError(f"--reward {name}: module {module!r} ({mod.__file__}) has no "
                             f"{attr!r}")
    if not callable(fn):
        raise InputError(f"--reward {name}: {attr!r} is a {type(fn).__name__}, not a function")
    source = getattr(mod, "__file__", None)
    digest = None
    if source:
        with open(source, "rb") as fh:
            digest = hashlib.sha256(fh.read()).hexdigest()
    return Reward(name, fn, source_sha256=digest)


def parse_weights(text: str | Sequence[float] | None, n: int) -> tuple[float, ...]:
    """``--reward-weights w1,w2,...``: one finite number per ``--reward`` (default 1 each)."""
    if text is None:
        return (1.0,) * n
    parts = text.split(",") if isinstance(text, str) else list(text)
    try:
        weights = tuple(float(w) for w in parts)
    except ValueError:
        raise InputError(f"--reward-weights {text!r}: give numbers separated by commas, e.g. "
                         "1,0.1") from None
    if len(weights) != n or not all(math.isfinite(w) for w in weights):
        raise InputError(f"--reward-weights {text!r}: give {n} finite weight(s), one per "
                         "--reward, in the same order")
    return weights


def reward_set(names: Sequence[str], weights: str | Sequence[float] | None = None
               ) -> RewardSet:
    """The rewards ``--reward`` names, each resolved now, weighted by ``--reward-weights``."""
    dup = sorted({n for n in names if list(names).count(n) > 1})
    if dup:
        raise InputError(f"--reward {dup[0]} is given twice; give it once with the sum of the "
                         "weights")
    ws = parse_weights(weights, len(names))
    return RewardSet(tuple(Reward(r.name, r.fn, w, r.builtin, r.source_sha256)
                           for r, w in zip(map(resolve, names), ws, strict=True)))


def _where(first: int, completions: Sequence[str]) -> str:
    if len(completions) == 1:
        return f"on sample {first} (completion {short(completions[0])})"
    return f"on samples {first}..{first + len(completions) - 1}"


def _checked(r: Reward, out: Any, completions: Sequence[str], first: int) -> list[float]:
    """``out`` as floats, or a :class:`RewardFunctionError` naming ``r`` and the sample."""
    n = len(completions)
    if isinstance(out, np.ndarray):
        out = out.tolist()
    if not isinstance(out, list | tuple):
        raise RewardFunctionError(f"--reward {r.name} returned {type(out).__name__} "
                                  f"{_where(first, completions)}; it must return a list of {n} "
                                  "number(s), one per completion")
    if len(out) != n:
        raise RewardFunctionError(f"--reward {r.name} returned {len(out)} values for {n} "
                                  f"completion(s) {_where(first, completions)}")
    for j, v in enumerate(out):
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise RewardFunctionError(f"--reward {r.name} returned {short(v)} "
                                      f"({type(v).__name__}) for sample {first + j}: not a number")
        if not math.isfinite(v):
            raise RewardFunctionError(f"--reward {r.name} returned {v} for sample {first + j}: "
                                      "rewards must be finite")
    return [float(v) for v in out]


@dataclass
class RewardSet:
    """The run's weighted rewards, and the per-reward values of the step under way (for the
    ``reward/<name>`` metrics)."""

    rewards: tuple[Reward, ...]
    _calls: int = 0
    _parts: dict[str, list[float]] = field(default_factory=dict)

    def hparams(self) -> dict[str, Any]:
        """The run identity the rewards define: names, weights, their modules' digests."""
        return {"reward": [r.name for r in self.rewards],
                "reward_weights": [r.weight for r in self.rewards],
                "reward_sha256": [r.source_sha256 for r in self.rewards]}

    def check_fields(self, names: set[str]) -> None:
        """Refuse, at the start, a function that cannot take the rows' fields as keywords."""
        kw = {k: [] for k in sorted(names) if k not in RESERVED}
        for r in self.rewards:
            try:
                inspect.signature(r.fn).bind([], [], **kw)
            except TypeError as err:
                raise InputError(f"--reward {r.name} cannot be called as f(prompts, "
                                 f"completions, {', '.join(f'{k}=...' for k in kw)}): {err}; "
                                 "accept the row fields as keywords (add **kwargs)") from None
            except ValueError:  # no signature to read (a builtin): its call will tell
                pass

    def score(self, prompts: Sequence[Any], completions: Sequence[str],
              answers: Sequence[Fraction], fields: Sequence[dict[str, Any]], first: int = 0
              ) -> tuple[list[float], dict[str, list[float]]]:
        """``(weighted sums, {name: values})`` of a batch; ``first`` is the index of its first
        sample in the step (named in errors)."""
        names = dict.fromkeys(k for f in fields for k in f if k not in RESERVED)
        columns = {k: [f.get(k) for f in fields] for k in names}
        total = [0.0] * len(completions)
        parts: dict[str, list[float]] = {}
        for r in self.rewards:
            kw = {"answer": list(answers)} if r.builtin else columns
            try:
                out = r.fn(list(prompts), list(completions), **kw)
            except Exception as err:
                raise RewardFunctionError(f"--reward {r.name} raised {type(err).__name__}: "
                                          f"{err} {_where(first, completions)}") from err
            parts[r.name] = vals = _checked(r, out, completions, first)
            total = [t + r.weight * v for t, v in zip(total, vals, strict=True)]
        return total, parts

    def begin_step(self) -> None:
        """A new step's samples: indices from 0, no values yet."""
        self._calls, self._parts = 0, {}

    def score_one(self, problem: Problem, completion: str) -> float:
        """The weighted reward of the step's next sample (evaluation scores them one by one)."""
        return self.score_next([problem], [completion])[0]

    def score_next(self, problems: Sequence[Problem], completions: Sequence[str]) -> list[float]:
        """The weighted rewards of the step's next samples, each reward function called once
        for all of them (the trainer passes a step's whole batch); errors name a sample by its
        index in the step."""
        i, self._calls = self._calls, self._calls + len(problems)
        prompts: list[Any] = [[{"role": r, "content": c} for r, c in p.messages]
                              if p.messages else p.prompt for p in problems]
        fields = [p.fields if p.fields is not None else {"answer": format_answer(p.answer)}
                  for p in problems]
        total, parts = self.score(prompts, completions, [p.answer for p in problems], fields,
                                  first=i)
        for name, vals in parts.items():
            self._parts.setdefault(name, []).extend(vals)
        return total

    def step_metrics(self) -> dict[str, float]:
        """``reward/<name>``: each reward's mean over the step's samples so far."""
        return {f"reward/{k}": float(np.mean(v)) for k, v in self._parts.items() if v}


def reward_failure(err: RewardError, step: int, saved: str | None) -> RewardError:
    """The error a run stops with when a reward failed in ``step``: the reward's own message
    (not the token ids the trainer's wrapper adds), and where the last finished step is saved."""
    cause = err.__cause__
    text = str(cause) if isinstance(cause, RewardFunctionError) else str(err)
    note = (f"; steps up to {step - 1} are saved in {saved} (--resume continues from there)"
            if saved else "")
    return RewardError(f"{text} (step {step}; the step was not applied){note}", err.sample)


def text_options(*, dataset: str | None = None, prompt_field: str | None = None,
                 answer_field: str | None = None, eval_dataset: str | None = None,
                 system_prompt: str | None = None, reward: list[str] | None = None,
                 reward_weights: str | None = None, model: str | None = None,
                 partial_weight: float | None = None) -> TextOptions | None:
    """The :class:`TextOptions` the flags ask for (None: none given), every file read and
    every reward resolved now, so each mistake is refused before JAX is imported."""
    loose = [flag for flag, v in (("--prompt-field", prompt_field),
                                  ("--answer-field", answer_field),
                                  ("--eval-dataset", eval_dataset)) if v is not None]
    if dataset is None and loose:
        verb = "applies" if len(loose) == 1 else "apply"
        raise InputError(f"{' and '.join(loose)} {verb} to --dataset FILE, which is not given "
                         "(a --task's problems have fixed fields)")
    if reward_weights is not None and not reward:
        raise InputError("--reward-weights set without --reward: give one --reward per weight")
    given = [f for f, v in (("--dataset", dataset), ("--system-prompt", system_prompt),
                            ("--reward", reward)) if v]
    if not given and system_prompt is None:
        return None
    if model is None:
        given = given or ["--system-prompt"]
        raise InputError(f"{' and '.join(given)} need{'s' if len(given) == 1 else ''} --model "
                         "DIR: your data and rewards fine-tune a Hugging Face checkpoint")
    if reward and partial_weight is not None:
        raise InputError("--partial-weight weights the format in the default reward; with "
                         "--reward, weight a format reward instead (--reward exact_number "
                         "--reward format --reward-weights 1,0.1)")
    if system_prompt is not None and not system_prompt.strip():
        raise InputError("--system-prompt is empty; drop it or give the text")
    ds = None if dataset is None else open_dataset(
        dataset, Fields(prompt_field or Fields.prompt, answer_field or Fields.answer),
        eval_dataset)
    rewards = None
    if reward:
        rewards = reward_set(reward, reward_weights)
        rewards.check_fields({"answer"} if ds is None else ds.field_names())
    return TextOptions(ds, system_prompt, rewards)
