"""Text tasks with a verifiable reward: GSM8K-style word problems, offline.

Why: fine-tuning a pretrained checkpoint needs a task in *text* whose reward is checked, not
judged. :func:`word_problem` writes arithmetic word problems from templates (names, items, 1-4
operations of + - × ÷, distractor sentences with numbers that do not matter, so lengths vary) with
a GSM8K-style worked solution ending in ``#### answer``; :func:`load_problems` reads a user's
JSONL of ``{"prompt": ..., "answer": ...}`` instead.

Reward (:func:`reward`): the answer is extracted from the response (``#### 42``, else
``\\boxed{42}``, else the last number; ``1,234``/``$5``/``2.50`` parsed exactly as fractions).
A correct answer scores ``1 - w`` plus up to ``w`` for its format (``####``: w, boxed: w/2); a
wrong or missing answer scores 0 whatever its format. ``w = FORMAT_WEIGHT = 0.2`` unless a run
sets ``--partial-weight``; ``w = 0`` rewards the exact answer alone. The format is paid only with
the right answer because, paid on its own (``w`` for any ``#### N``), it was reward-hacked: two
SmolLM2-135M runs learned the format first while exact match fell. Gated, it breaks ties among
correct samples in favour of the parseable format, so runs that chase the answer do not drop it
(exact-only runs lost most of their formatted answers:
``bench/results/cpu/pretrained_learning_p8_e256.md``,
``bench/results/cpu/pretrained_learning_lr3e4.md``).

Pure Python (no JAX): the CLI can check a ``jsonl:`` task file before importing JAX.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

from jaxrl_sym.errors import InputError
from jaxrl_sym.jsonl import parse_object, read_lines
from jaxrl_sym.rl.names import TEXT_TASK_NAMES

FORMAT_WEIGHT = 0.2  # the default w of reward(): see the module docstring
FORMAT_CREDIT = {"hash": 1.0, "boxed": 0.5, "last": 0.0, None: 0.0}
INSTRUCTION = "Solve the problem. Give the final answer as '#### <number>'."

# A number as people write it: 1,234 (groups of three), 12, 2.50, -7, $5 (sign before $ or not).
# ASCII digits only (re.ASCII): other scripts' digits are not answers this task checks.
_NUM = r"-?\$?-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
_NUM_RE = re.compile(rf"(?<![\d.,]){_NUM}", re.ASCII)
_HASH_RE = re.compile(rf"####\s*({_NUM})", re.ASCII)
_BOXED_RE = re.compile(r"\\boxed\{\s*(?:\\\$|\$)?\s*(" + _NUM + r")\s*\}", re.ASCII)


@dataclass(frozen=True)
class Problem:
    """One problem: the prompt text, its exact answer, and a worked solution (templates only).

    A row of a user's dataset (:mod:`jaxrl_sym.rl.tasks.data`) may instead hold a chat prompt
    (``messages``: ``(role, content)`` pairs, rendered with the tokenizer's chat template;
    ``prompt`` is then its last user message, for logs) and keeps its other fields as read
    (``fields``), which ``--reward module:function`` receives as keyword lists."""

    prompt: str
    answer: Fraction
    solution: str | None = None
    messages: tuple[tuple[str, str], ...] | None = None
    fields: dict[str, Any] | None = field(default=None, compare=False, hash=False)


@dataclass(frozen=True)
class Extracted:
    """The answer found in a response and where: ``hash`` / ``boxed`` / ``last`` / None."""

    value: Fraction | None
    source: str | None


def parse_number(text: str) -> Fraction:
    """``"1,234"``, ``"$5"``, ``"-2.50"``, ``"7"`` → an exact Fraction (ValueError otherwise)."""
    clean = text.strip().replace(",", "").replace("$", "")
    if not re.fullmatch(r"-?[0-9]+(?:\.[0-9]+)?", clean):
        raise ValueError(f"not a number: {text!r}")
    return Fraction(clean)


def extract_answer(text: str) -> Extracted:
    """The final answer of a response: the last ``#### N``, else the last ``\\boxed{N}``, else
    the last number anywhere; ``Extracted(None, None)`` when the text has no number."""
    for source, pattern in (("hash", _HASH_RE), ("boxed", _BOXED_RE)):
        found = pattern.findall(text)
        if found:
            return Extracted(parse_number(found[-1]), source)
    found = _NUM_RE.findall(text)
    if found:
        return Extracted(parse_number(found[-1]), "last")
    return Extracted(None, None)


def answer_in(text: str, source: str) -> Fraction | None:
    """The last ``#### N`` (``source="hash"``) or ``\\boxed{N}`` (``"boxed"``) of ``text``, None
    without one: the built-in ``--reward`` graders look at one format each."""
    found = {"hash": _HASH_RE, "boxed": _BOXED_RE}[source].findall(text)
    return parse_number(found[-1]) if found else None


def reward(response: str, answer: Fraction | int,
           format_weight: float = FORMAT_WEIGHT) -> float:
    """``correct * ((1 - w) + w * format)`` in [0, 1], ``w = format_weight``: the format counts
    only with the right answer (see the module docstring)."""
    check_format_weight(format_weight)
    ex = extract_answer(response)
    if ex.value is None or ex.value != Fraction(answer):
        return 0.0
    return (1.0 - format_weight) + format_weight * FORMAT_CREDIT[ex.source]


def check_format_weight(w: float) -> None:
    """The format's weight must leave the answer the larger part of the reward: ``0 <= w < 0.5``."""
    if isinstance(w, bool) or not isinstance(w, int | float) or not 0.0 <= w < 0.5:
        raise InputError(f"--partial-weight {w!r}: a text task's format weight must be in "
                         "[0, 0.5) so that the exact answer carries most of a correct response's "
                         "reward (0: the exact answer only, any format)")


def exact_match(response: str, answer: Fraction | int) -> float:
    """1.0 when the extracted answer equals ``answer``, whatever the format."""
    return float(extract_answer(response).value == Fraction(answer))


def format_answer(value: Fraction) -> str:
    """``42``, ``2.5`` or ``1/3``: how a target answer is shown (logs, solutions)."""
    if value.denominator == 1:
        return str(value.numerator)
    text = f"{float(value):.10g}"
    return text if Fraction(text) == value else str(value)


# --------------------------------------------------------------------------- templates

NAMES = ("Ava", "Ben", "Chloe", "Diego", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jamal",
         "Keiko", "Liam", "Mia", "Noah", "Olga", "Priya")
ITEMS = ("apples", "marbles", "stickers", "books", "cookies", "pencils", "coins", "shells",
         "cards", "stamps")
COLOURS = ("red", "blue", "green", "yellow", "purple")
MULTIPLIERS = {2: "doubles", 3: "triples", 4: "quadruples"}


def _start(rng: np.random.Generator, name: str, item: str, largest: int | None
           ) -> tuple[int, str, str]:
    """The opening amount: plain, or boxes × per box (a first operation in itself); with
    ``largest``, no number written in the problem exceeds it."""
    if rng.random() < 0.5:
        x = int(rng.integers(2, 60 if largest is None else largest + 1))
        return x, f"{name} has {x} {item}.", ""
    boxes = int(rng.integers(2, 7 if largest is None else min(6, largest) + 1))
    per = int(rng.integers(2, 13 if largest is None else min(12, largest) + 1))
    return (boxes * per, f"{name} buys {boxes} boxes of {item} with {per} {item} in each box.",
            f"{boxes} * {per} = {boxes * per}")


def _step(rng: np.random.Generator, x: int, name: str, friend: str, item: str,
          largest: int | None) -> tuple[int, str, str]:
    """One operation on the running amount ``x``: (new amount, sentence, worked line)."""
    kind = ["add", "sub", "mul", "div"][int(rng.integers(0, 4))]
    if kind == "sub" and x >= 2:
        b = int(rng.integers(1, x if largest is None else min(x, largest + 1)))
        return x - b, f"{name} gives {b} {item} to {friend}.", f"{x} - {b} = {x - b}"
    if kind == "mul" and x <= 400:
        k = int(rng.integers(2, 5))
        return (x * k, f"Then the number of {item} {name} has {MULTIPLIERS[k]}.",
                f"{x} * {k} = {x * k}")
    divisors = [k for k in range(2, 7 if largest is None else min(6, largest) + 1) if x % k == 0]
    if kind == "div" and divisors:
        k = divisors[int(rng.integers(0, len(divisors)))]
        return (x // k, f"{name} splits the {item} into {k} equal piles and keeps one pile.",
                f"{x} / {k} = {x // k}")
    b = int(rng.integers(1, 40 if largest is None else largest + 1))
    return x + b, f"{friend} gives {name} {b} more {item}.", f"{x} + {b} = {x + b}"


def _distractor(rng: np.random.Generator, name: str, friend: str, largest: int | None) -> str:
    """A sentence with a number (or none) that the answer does not depend on."""
    def num(lo: int, hi: int) -> int:
        return int(rng.integers(lo, hi) if largest is None else rng.integers(2, largest + 1))

    options = (f"{friend} is {num(6, 70)} years old.",
               f"The shop is {num(2, 30)} kilometres from {name}'s house.",
               f"{name}'s favourite colour is {COLOURS[int(rng.integers(0, len(COLOURS)))]}.",
               f"It rained on {num(2, 20)} days last month.")
    return options[int(rng.integers(0, len(options)))]


def word_problem(rng: np.random.Generator, min_steps: int = 1, max_steps: int = 3,
                 max_distractors: int = 2, largest: int | None = None) -> Problem:
    """A word problem of ``min_steps..max_steps`` operations after the opening amount, with
    ``0..max_distractors`` irrelevant sentences placed among the relevant ones; ``largest``
    bounds the numbers the problem states (None: the templates' own ranges, up to 59)."""
    if not 1 <= min_steps <= max_steps:
        raise InputError(f"steps must satisfy 1 <= min_steps ({min_steps}) <= max_steps "
                         f"({max_steps})")
    i, j = rng.choice(len(NAMES), size=2, replace=False)
    name, friend = NAMES[int(i)], NAMES[int(j)]
    item = ITEMS[int(rng.integers(0, len(ITEMS)))]
    x, first, work = _start(rng, name, item, largest)
    sentences, lines = [first], [work] if work else []
    for _ in range(int(rng.integers(min_steps, max_steps + 1))):
        x, sentence, line = _step(rng, x, name, friend, item, largest)
        sentences.append(sentence)
        lines.append(line)
    for _ in range(int(rng.integers(0, max_distractors + 1))):
        where = int(rng.integers(1, len(sentences) + 1))
        sentences.insert(where, _distractor(rng, name, friend, largest))
    question = f"How many {item} does {name} have now?"
    prompt = " ".join([*sentences, question]) + "\n" + INSTRUCTION
    return Problem(prompt, Fraction(x), "\n".join([*lines, f"#### {x}"]))


# --------------------------------------------------------------------------- user files


def _record(path: Path, n: int, line: str) -> Problem:
    where = f"{path}:{n}"
    rec = parse_object(line, where, 'a JSON object {"prompt": ..., "answer": ...}')
    missing = [k for k in ("prompt", "answer") if k not in rec]
    if missing:
        raise InputError(f"{where}: the record has no {' and no '.join(map(repr, missing))} "
                         f"(keys: {sorted(rec)})")
    prompt, answer = rec["prompt"], rec["answer"]
    if not isinstance(prompt, str) or not prompt.strip():
        raise InputError(f"{where}: 'prompt' must be a non-empty string, got {prompt!r}")
    return Problem(prompt, _answer(answer, where))


def _answer(value: Any, where: str) -> Fraction:
    if isinstance(value, bool):
        raise InputError(f"{where}: 'answer' must be a number, got {value!r}")
    if isinstance(value, int):
        return Fraction(value)
    if isinstance(value, float) and math.isfinite(value):
        return Fraction(str(value))  # 2.5 -> 5/2 exactly as written, not the binary float
    if isinstance(value, str):
        try:
            return parse_number(value)
        except ValueError:
            pass
    raise InputError(f"{where}: 'answer' must be a number (42, 2.5, \"1,234\"), got {value!r}")


def load_problems(path: str | Path) -> list[Problem]:
    """Problems from a JSONL file, one ``{"prompt": str, "answer": number}`` per line (blank
    lines skipped, other keys ignored). A bad record — or a prompt repeated with another
    answer — is an :class:`InputError` naming the file and line; an empty file is one too."""
    path = Path(path)
    problems: list[Problem] = []
    first: dict[str, tuple[int, Problem]] = {}
    for n, line in read_lines(path, "task file"):
        problem = _record(path, n, line)
        k, other = first.setdefault(problem.prompt, (n, problem))
        if other.answer != problem.answer:  # the reward could not tell which one is right
            raise InputError(f"{path}:{n}: the same prompt as line {k} with another answer "
                             f"({format_answer(problem.answer)} vs {format_answer(other.answer)})")
        problems.append(problem)
    if not problems:
        raise InputError(f"task file {path} holds no records; one JSON object per line: "
                         '{"prompt": "...", "answer": 42}')
    return problems


# --------------------------------------------------------------------------- task by name


@dataclass(frozen=True)
class TextTask:
    """A source of problems: templates (``word-problems``) or a fixed list (``jsonl:PATH``,
    ``--dataset``). ``held_out``: an evaluation set, drawn without replacement (each row at most
    once: a small held-out set is not re-weighted by chance)."""

    name: str
    problems: tuple[Problem, ...] | None = None  # None: generated from templates
    min_steps: int = 1
    max_steps: int = 3
    largest: int | None = None  # the largest number a template problem states (None: 59)
    distractors: int = 2  # at most this many irrelevant sentences per template problem
    held_out: bool = False

    def sample(self, rng: np.random.Generator, n: int) -> list[Problem]:
        """``n`` problems; a file's records are drawn with replacement (a ``held_out`` set's:
        ``min(n, rows)`` distinct rows, in file order)."""
        if self.problems is None:
            return [word_problem(rng, self.min_steps, self.max_steps, self.distractors,
                                 largest=self.largest) for _ in range(n)]
        if self.held_out:
            rows = len(self.problems)
            pick = range(rows) if n >= rows else sorted(rng.choice(rows, n, replace=False))
            return [self.problems[int(i)] for i in pick]
        idx = rng.integers(0, len(self.problems), size=n)
        return [self.problems[int(i)] for i in idx]


_WORD_PROBLEMS = re.compile(r"word-problems(?::(\d+)(?::(\d+)(?::(\d+))?)?)?")
MAX_WORD_PROBLEM_STEPS = 4
LARGEST_NUMBER = (2, 999)  # the range word-problems:K:N accepts for N
MAX_DISTRACTORS = 2  # word-problems:K:N:D accepts D in 0..2


DATASET_TASK = "dataset"  # the task name of a run on --dataset FILE (jaxrl_sym.rl.tasks.data)


def is_text_task(name: str) -> bool:
    """Whether ``name`` is a task of a ``--model`` checkpoint (text), not the built-in model's."""
    return (name in TEXT_TASK_NAMES or name == DATASET_TASK or name.startswith("jsonl:")
            or _WORD_PROBLEMS.fullmatch(name) is not None)


def get_text_task(name: str, *, max_steps: int = 3) -> TextTask:
    """``word-problems`` (1..max_steps operations), ``word-problems:K`` (1..K: the difficulty,
    so a small model can start neither at 0 nor at the ceiling), ``word-problems:K:N`` (and no
    stated number above N: a 135M model adds 7 and 5, not 47 and 38), ``word-problems:K:N:D``
    (and at most D irrelevant sentences, default 2: a 135M model adds the distractor's number
    too) or ``jsonl:PATH`` (the file is read and checked now, so a bad record fails before any
    model is loaded)."""
    m = _WORD_PROBLEMS.fullmatch(name)
    if m is not None:
        k = max_steps if m.group(1) is None else int(m.group(1))
        if not 1 <= k <= MAX_WORD_PROBLEM_STEPS:
            raise InputError(f"--task {name}: the number of operations must be 1 to "
                             f"{MAX_WORD_PROBLEM_STEPS}")
        largest = None if m.group(2) is None else int(m.group(2))
        if largest is not None and not LARGEST_NUMBER[0] <= largest <= LARGEST_NUMBER[1]:
            raise InputError(f"--task {name}: the largest number N of word-problems:K:N must "
                             f"be {LARGEST_NUMBER[0]} to {LARGEST_NUMBER[1]}")
        d = MAX_DISTRACTORS if m.group(3) is None else int(m.group(3))
        if d > MAX_DISTRACTORS:
            raise InputError(f"--task {name}: the distractor count D of word-problems:K:N:D must "
                             f"be 0 to {MAX_DISTRACTORS}")
        return TextTask(name, None, 1, k, largest, d)
    if name.startswith("jsonl:"):
        return TextTask(name, tuple(load_problems(name.removeprefix("jsonl:"))))
    if name == DATASET_TASK:
        raise InputError(f"task {name!r} trains on --dataset FILE: give the file (train(..., "
                         "text=jaxrl_sym.rl.tasks.rewards.text_options(dataset=FILE)))")
    raise InputError(f"unknown text task {name!r}; choose {', '.join(TEXT_TASK_NAMES)} or "
                     "jsonl:PATH (a file of {\"prompt\", \"answer\"} lines)")
