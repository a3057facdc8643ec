"""Offline arithmetic-style tasks for RL fine-tuning tests and demos (no downloads).

Why these tasks: they are small enough to learn from random initialisation on a CPU in minutes
(digit reversal, per FIELD_NOTES §5), their prompt and answer lengths vary per sample (so the
exact-length runtime has something to save), and the correct answer is a deterministic function of
the prompt, so a reward function needs only ``(prompt_tokens, response_tokens)`` — the signature
a user's reward function gets in :mod:`jaxrl_sym.rl.step.trainer`.

Vocabulary (14 tokens): ``0..9`` digits, ``PLUS`` (10), ``SEP`` ('=', 11, ends every prompt),
``EOS`` (12, ends a response), ``BOS`` (13, starts every prompt).

Reward: 1 for the exact ``answer + [EOS]``, else ``partial_weight`` x position-wise partial credit
against it (an exact-match-only reward gives no gradient signal from a random policy; FIELD_NOTES
§5 notes it "learned only the format"). ``partial_weight`` < 1 makes the exact answer strictly
dominant by a margin: with full partial credit a response one digit off scores 0.75 against 1.0,
and a policy that is reliably one digit off is paid nearly as much as one that is right.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from jaxrl_sym.errors import InputError

DIGITS = tuple(range(10))
PLUS, SEP, EOS, BOS = 10, 11, 12, 13
VOCAB_SIZE = 14
TOKEN_NAMES = {**{d: str(d) for d in DIGITS}, PLUS: "+", SEP: "=", EOS: "<eos>", BOS: "<bos>"}


def detokenize(tokens: Sequence[int]) -> str:
    """Human-readable text of a token sequence (for logs and error messages)."""
    return "".join(TOKEN_NAMES.get(int(t), f"<{int(t)}>") for t in tokens)


def _digits_of(prompt: np.ndarray) -> list[int]:
    """The digit tokens between BOS and SEP (the task's operand)."""
    body = [int(t) for t in prompt if int(t) not in (BOS, SEP)]
    return body


def _int_digits(n: int) -> list[int]:
    return [int(c) for c in str(n)]


@dataclass(frozen=True)
class Task:
    """One task: how to sample a prompt, and the answer the prompt implies.

    ``answer(prompt)`` recomputes the answer from the prompt tokens, so the task's reward is a
    plain ``(prompt, response) -> float`` function like any user reward.
    """

    name: str
    min_digits: int
    max_digits: int
    _sample: Callable[[np.random.Generator, int, int], list[int]]
    _answer: Callable[[list[int]], list[int]]
    max_answer_len: int
    partial_weight: float = 1.0

    def sample(self, rng: np.random.Generator, n: int) -> list[np.ndarray]:
        """``n`` prompts (``BOS operand SEP``), lengths varying per sample."""
        return [
            np.asarray([BOS, *self._sample(rng, self.min_digits, self.max_digits), SEP], np.int32)
            for _ in range(n)
        ]

    def answer(self, prompt: Sequence[int] | np.ndarray) -> list[int]:
        """The answer digits (no EOS) the prompt asks for."""
        return self._answer(_digits_of(np.asarray(prompt)))

    def target(self, prompt: Sequence[int] | np.ndarray) -> list[int]:
        """What an exactly correct response looks like: answer then EOS."""
        return [*self.answer(prompt), EOS]

    def reward(self, prompt: Sequence[int] | np.ndarray,
               response: Sequence[int] | np.ndarray) -> float:
        """1.0 for the exact target, else ``partial_weight`` x partial credit (< partial_weight).

        Partial credit: positions where the response agrees with ``answer + [EOS]``, divided by
        the longer of the two lengths (so rambling past the answer costs as much as stopping
        short).
        """
        target, resp = self.target(prompt), [int(t) for t in response]
        if resp == target:
            return 1.0
        return self.partial_weight * partial_credit(target, resp)

    def exact_match(self, prompt: Sequence[int] | np.ndarray,
                    response: Sequence[int] | np.ndarray) -> float:
        """1.0 when the response is exactly ``answer + [EOS]``, else 0.0."""
        return float([int(t) for t in response] == self.target(prompt))

    @property
    def max_new_tokens(self) -> int:
        """Generation limit: room for the longest answer, its EOS and one token of slack."""
        return self.max_answer_len + 2


def partial_credit(target: Sequence[int], response: Sequence[int]) -> float:
    """Matches at equal positions / max(len(target), len(response))."""
    n = max(len(target), len(response))
    if n == 0:
        return 1.0
    hits = sum(1 for a, b in zip(target, response, strict=False) if a == b)
    return hits / n


def _random_digits(rng: np.random.Generator, lo: int, hi: int) -> list[int]:
    return [int(x) for x in rng.integers(0, 10, size=int(rng.integers(lo, hi + 1)))]


def _random_sum(rng: np.random.Generator, lo: int, hi: int) -> list[int]:
    def operand() -> list[int]:
        n = int(rng.integers(lo, hi + 1))
        return _int_digits(int(rng.integers(0 if n == 1 else 10 ** (n - 1), 10**n)))

    return [*operand(), PLUS, *operand()]


def _sum_answer(body: list[int]) -> list[int]:
    if PLUS not in body:
        return []
    k = body.index(PLUS)
    a = int("".join(map(str, body[:k])) or "0")
    b = int("".join(map(str, body[k + 1:])) or "0")
    return _int_digits(a + b)


from jaxrl_sym.rl.names import TASK_NAMES  # noqa: E402 - re-exported


def get_task(name: str, *, min_digits: int = 1, max_digits: int = 3,
             partial_weight: float = 1.0) -> Task:
    """A task by name: ``reverse``, ``copy``, ``sort`` (operand of min..max digits) or ``add``
    (two operands of min..max digits each). ``partial_weight``: see the module docstring."""
    if not 1 <= min_digits <= max_digits:
        raise InputError(f"digits must satisfy 1 <= min_digits ({min_digits}) <= max_digits "
                         f"({max_digits})")
    if not (isinstance(partial_weight, int | float) and 0.0 <= partial_weight <= 1.0):
        raise InputError(f"partial_weight={partial_weight!r} (--partial-weight) must be in [0, 1]: "
                         "above 1 a near miss could outscore the exact answer")
    lo, hi, pw = min_digits, max_digits, float(partial_weight)
    if name == "reverse":
        return Task(name, lo, hi, _random_digits, lambda d: d[::-1], hi, pw)
    if name == "copy":
        return Task(name, lo, hi, _random_digits, list, hi, pw)
    if name == "sort":
        return Task(name, lo, hi, _random_digits, sorted, hi, pw)
    if name == "add":
        return Task(name, lo, hi, _random_sum, _sum_answer, hi + 1, pw)
    raise InputError(f"--task {name}: unknown task {name!r}; choose one of "
                     f"{', '.join(TASK_NAMES)} (with --model: word-problems[:K[:N[:D]]] or "
                     "jsonl:FILE)")
