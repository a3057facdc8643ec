"""RL fine-tuning of a pretrained Hugging Face checkpoint on a text task, and the way back out.

``jaxrl-sym train --model DIR --task word-problems`` (or ``--task jsonl:FILE``) runs the same
training loop as the built-in tasks (:func:`jaxrl_sym.rl.run.train.train`); this module supplies
what differs, so the loop itself only asks :func:`setup` for it:

* the **task in tokens**: problems rendered through the checkpoint's chat template when it has
  one (else plain text), encoded with its tokenizer; the reward decodes the response and scores
  it with :func:`jaxrl_sym.rl.tasks.text_tasks.reward` against the answer of *that* prompt;
* the **EOS id** from the checkpoint's files, and the **model** itself (loaded only after the
  loop has checked its flags and output paths);
* the **source directory** in the run's hyper-parameters (``model_dir``), so a checkpoint knows
  which model it started from: resuming with another ``--model`` is refused like any changed
  setting, and :func:`export_checkpoint` can write the trained policy as a Hugging Face
  directory next to that model's config and tokenizer;
* the user's **dataset, system prompt and rewards** (``--dataset``, ``--reward``:
  :mod:`jaxrl_sym.rl.tasks.data`, :mod:`jaxrl_sym.rl.tasks.rewards`), whose flags and file digests
  join the recorded hyper-parameters, so a resume with other data or reward code is a changed run.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import stat
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jaxrl_sym.errors import InputError
from jaxrl_sym.rl.tasks.data import TextOptions, chat_messages, file_sha256, plain_prompt
from jaxrl_sym.rl.tasks.text_tasks import (
    FORMAT_WEIGHT,
    TEXT_TASK_NAMES,
    Problem,
    TextTask,
    check_format_weight,
    exact_match,
    extract_answer,
    is_text_task,
    reward,
)

DEFAULT_MAX_NEW_TOKENS = 256  # room for a short worked solution and its '#### N' line
# Token slots per training micro-batch of a checkpoint run (ExecutionConfig.update_tokens). A
# pretrained model's activations dominate the update: at SmolLM2-135M's shape in fp32 a GRPO
# batch of 8 x 128 tokens peaks lower in micro-batches than in one (the ledger's numbers:
# bench/results/cpu/design_notes.md); the update is the same (gradients are summed, then one
# optimiser step).
PRETRAINED_UPDATE_TOKENS = 256
# The fine-tuning recipe of a pretrained checkpoint, over the built-in tasks' (TASK_RECIPE, made
# for models trained from scratch: lr 1e-3 and an entropy bonus, which moves every weight even
# when all rewards are 0 — one such step turned a chat model's "Hello" into "named you you you").
# GRPO on models of this size uses lr ~1e-6 for full fine-tuning (TRL's GRPOConfig default,
# DeepSeekMath's GRPO) and no entropy bonus; the KL weight stays the caller's (--beta, default 0
# as in TRL and DAPO: a reference copy costs a model's weights).
PRETRAINED_RECIPE: dict[str, Any] = {"lr": 1e-6, "entropy_coef": 0.0,
                                     "update_tokens": PRETRAINED_UPDATE_TOKENS}
# LoRA's own rate: adapters start at B = 0 and a rank-r update of a frozen base needs a rate
# ~100x the full model's (PEFT's and TRL's LoRA examples use 1e-4-2e-4). On SmolLM2-135M with
# LoRA 16, 3e-4 learned (bench/results/cpu/pretrained_learning_exact70.md), 5e-4 collapsed
# (bench/results/cpu/pretrained_learning_d0_lr5e4.md); 1e-6 left the adapters where they started.
PRETRAINED_LORA_LR = 2e-4


class TokenTextTask:
    """A :class:`TextTask` in tokens, with the interface the training loop uses for its tasks:
    ``sample(rng, n)`` → prompt token arrays, ``reward``/``exact_match(prompt, response)``,
    ``max_new_tokens``.

    The answer of each sampled prompt is remembered by its tokens (the reward only sees tokens);
    a prompt the task did not sample in its latest ``sample`` call is an error, not a zero.
    """

    def __init__(self, task: TextTask, text: Any, chat: bool, max_new_tokens: int,
                 format_weight: float = FORMAT_WEIGHT, *, system_prompt: str | None = None,
                 rewards: Any = None) -> None:
        check_format_weight(format_weight)
        self.task, self.text, self.chat = task, text, chat
        self.max_new_tokens = max_new_tokens
        self.format_weight = format_weight
        self.system_prompt = system_prompt
        self.rewards = rewards  # a RewardSet (jaxrl_sym.rl.tasks.rewards); None: reward() below
        self.max_positions = text.max_positions  # read once: checked on every sample
        self._answers: dict[tuple[int, ...], Problem] = {}
        self.eval_task: TokenTextTask = self  # what the final evaluation samples
        self.eval_note: str | None = None  # where its rows come from (the run's summary)

    def encode(self, problem: Problem) -> np.ndarray:
        if self.chat:
            ids = self.text.encode_chat(chat_messages(problem, self.system_prompt))
        else:
            ids = self.text.encode(plain_prompt(problem, self.system_prompt))
        return np.asarray(ids, np.int32)

    def sample(self, rng: np.random.Generator, n: int) -> list[np.ndarray]:
        return self.use(self.task.sample(rng, n))

    def check_rows(self) -> None:
        """Every row of a fixed list (``jsonl:``, ``--dataset``) fits the model's positions with
        ``--max-new-tokens``: checked at the start, not when a step happens to sample the long
        one (a template task's problems are checked as they are drawn)."""
        if self.task.problems is not None and self.max_positions is not None:
            self._check([self.encode(p) for p in self.task.problems], self.task.problems)

    def _check(self, prompts: list[np.ndarray], problems: Sequence[Problem]) -> None:
        from jaxrl_sym.models.hf.config import check_positions  # JAX: not at CLI import

        i = int(np.argmax([len(p) for p in prompts]))
        row = (f" (row {self.task.problems.index(problems[i]) + 1})"
               if self.task.problems is not None else "")
        check_positions(self.max_positions, len(prompts[i]) + self.max_new_tokens,
                        f"task {self.task.name}: a prompt of {len(prompts[i])} tokens{row} "
                        f"({problems[i].prompt[:40]!r}…) with --max-new-tokens "
                        f"{self.max_new_tokens}", "lower --max-new-tokens or use shorter prompts")

    def use(self, problems: Sequence[Problem]) -> list[np.ndarray]:
        """``problems`` as prompt token arrays; their answers are what the rewards score next
        (a new step for the rewards' per-sample indices and means)."""
        prompts = [self.encode(p) for p in problems]
        self._check(prompts, problems)
        self._answers = {}
        if self.rewards is not None:
            self.rewards.begin_step()
        for p, ids in zip(problems, prompts, strict=True):
            seen = self._answers.setdefault(tuple(ids.tolist()), p)
            if seen.answer != p.answer:
                raise InputError(f"task {self.task.name}: the prompt {p.prompt[:60]!r} appears "
                                 f"with two answers ({seen.answer} and {p.answer})")
        return prompts

    def _problem(self, prompt: Sequence[int] | np.ndarray) -> Problem:
        key = tuple(int(t) for t in prompt)
        if key not in self._answers:
            raise InputError(f"task {self.task.name}: a reward was asked for a prompt this task "
                             "did not sample last (its answer is unknown)")
        return self._answers[key]

    def response_text(self, response: Sequence[int] | np.ndarray) -> str:
        return self.text.decode([int(t) for t in response])

    def reward(self, prompt: Sequence[int] | np.ndarray,
               response: Sequence[int] | np.ndarray) -> float:
        problem, text = self._problem(prompt), self.response_text(response)
        if self.rewards is not None:
            return self.rewards.score_one(problem, text)
        return reward(text, problem.answer, self.format_weight)

    def score_batch(self, prompts: Sequence[np.ndarray], responses: Sequence[np.ndarray]
                    ) -> list[float]:
        """The step's rewards in one call of each ``--reward`` function
        (:class:`~jaxrl_sym.rl.step.rollout.BatchReward`); the task's own reward per sample."""
        if self.rewards is None:
            return [self.reward(p, r) for p, r in zip(prompts, responses, strict=True)]
        return self.rewards.score_next([self._problem(p) for p in prompts],
                                       [self.response_text(r) for r in responses])

    def reward_metrics(self) -> dict[str, float]:
        """``reward/<name>`` means of the latest step (none without ``--reward``)."""
        return {} if self.rewards is None else self.rewards.step_metrics()

    def exact_match(self, prompt: Sequence[int] | np.ndarray,
                    response: Sequence[int] | np.ndarray) -> float:
        return exact_match(self.response_text(response), self._problem(prompt).answer)

    def format_match(self, prompt: Sequence[int] | np.ndarray,
                     response: Sequence[int] | np.ndarray) -> float:
        """1.0 when the response gives its answer in the asked format (``#### N``)."""
        return float(extract_answer(self.response_text(response)).source == "hash")


@dataclasses.dataclass
class PretrainedRun:
    """What :func:`jaxrl_sym.rl.run.train.train` needs from a ``--model DIR`` run."""

    model_dir: str
    task: TokenTextTask
    eos_id: int
    dtype: str | None = None
    user: TextOptions = dataclasses.field(default_factory=TextOptions)
    base_sha256: str | None = None  # the loaded weights' digest (None until load_model)
    task_sha256: str | None = None  # a jsonl: task file's contents (None for other tasks)

    def rl_config(self, lora: bool) -> dict[str, Any]:
        """RLConfig knobs (by field name) this run fixes (a caller's ``config`` may still
        override them); ``lora``: adapters train, at :data:`PRETRAINED_LORA_LR`."""
        return {"eos_id": self.eos_id, "max_new_tokens": self.task.max_new_tokens,
                **PRETRAINED_RECIPE, **({"lr": PRETRAINED_LORA_LR} if lora else {})}

    @property
    def hparams(self) -> dict[str, Any]:
        """Recorded in every checkpoint: the source model (export, resume check) and the
        prompt format."""
        base = {} if self.base_sha256 is None else {"base_sha256": self.base_sha256}
        return {"model_dir": self.model_dir, "chat_template": self.task.chat,
                "model_dtype": self.dtype, "task_sha256": self.task_sha256, **base,
                **self.user.hparams()}

    def load_model(self, lora: Any = None) -> Any:
        """The checkpoint's model; its weights' digest becomes part of the run's identity
        (:attr:`hparams`): a base whose weights changed between runs is a changed run. With
        ``lora`` (a LoraConfig), targets no PEFT adapter can name are reported now, before the
        run, not by ``export --peft`` after it."""
        from jaxrl_sym.models.hf import load_pretrained

        model = load_pretrained(self.model_dir, dtype=self.dtype)[0]
        self.base_sha256 = model_digest(model)
        if lora is not None:
            _warn_unexportable(model, lora)
        return model


def _warn_unexportable(model: Any, lora: Any) -> None:
    """A warning at the start for LoRA targets that are not Linear layers of the Hugging Face
    model (an embedding, a norm): they train and export merged, but a PEFT adapter cannot
    name them, so ``export --peft`` will refuse the run."""
    from jaxrl_sym.weights.lora import plan_lora
    from jaxrl_sym.weights.peft import linear_modules

    linear = set(linear_modules(model).values())
    other = [n for n in plan_lora(model, lora).names if n not in linear]
    if other:
        logging.getLogger(__name__).warning(
            "--lora-targets matches %d weight(s) that are not Linear layers (%s): they train "
            "and `export` merges them, but `export --peft` will refuse this run's adapters; "
            "narrow --lora-targets to Linear layers for PEFT adapters", len(other),
            ", ".join(other[:3]))


def model_digest(model: Any) -> str:
    """SHA-256 of a model's parameters as loaded (:func:`~jaxrl_sym.rl.step.state.params_sha256`
    over its state): what a checkpoint records of its base and an export compares."""
    import jax
    from flax import nnx

    from jaxrl_sym.rl.step.state import params_sha256

    return params_sha256(jax.tree_util.tree_leaves(nnx.state(model)))


def setup(model_dir: str | None, task: str, *, max_new_tokens: int | None = None,
          dtype: str | None = None, format_weight: float = FORMAT_WEIGHT,
          text: TextOptions | None = None) -> PretrainedRun | None:
    """The pretrained side of a run, or None for the built-in model and token tasks.

    Cheap: reads the tokenizer, chat template, EOS ids and (for ``jsonl:``) the task file — the
    weights are loaded later by :meth:`PretrainedRun.load_model`. Every mismatch of model and
    task is an :class:`InputError` naming the flag. ``text``: the user's dataset, system prompt
    and rewards (:func:`jaxrl_sym.rl.tasks.rewards.text_options`; None: the task's own).
    """
    if model_dir is None:
        if is_text_task(task) or text is not None:
            raise InputError(f"--task {task} is a text task: it needs --model DIR (a Hugging "
                             "Face checkpoint directory with a tokenizer)")
        return None
    if not is_text_task(task):
        raise InputError(f"--task {task} is a token task for the built-in model; with --model "
                         f"use a text task: {', '.join(TEXT_TASK_NAMES)} or jsonl:PATH")
    from jaxrl_sym.models.hf.file_checks import refuse_unreadable
    from jaxrl_sym.models.hf.gguf import find_gguf
    from jaxrl_sym.models.hf.text import HFText

    root = Path(model_dir)
    with refuse_unreadable("--model", model_dir):
        if not _has_config(root) and find_gguf(root) is None:
            raise InputError(f"--model {model_dir}: not a Hugging Face checkpoint directory "
                             "(no config.json) nor a .gguf file")
    user = text or TextOptions()
    tok = HFText(root)
    eos = tok.eos_ids()
    limit = DEFAULT_MAX_NEW_TOKENS if max_new_tokens is None else max_new_tokens
    train_task, held, note = user.tasks(task)
    chat = tok.chat_template is not None
    user.check_chat(chat, model_dir)
    args = (tok, chat, limit, format_weight)
    token_task = TokenTextTask(train_task, *args, system_prompt=user.system_prompt,
                               rewards=user.rewards)
    if held is not None:
        token_task.eval_task = TokenTextTask(held, *args, system_prompt=user.system_prompt)
    token_task.eval_note = note
    token_task.check_rows()
    if held is not None:
        token_task.eval_task.check_rows()
    # a jsonl: file edited between runs is another run's data, as a --dataset file is
    task_sha = (file_sha256(Path(task.removeprefix("jsonl:")), "--task")
                if task.startswith("jsonl:") else None)
    return PretrainedRun(os.path.abspath(model_dir), token_task, eos[0], dtype, user,
                         task_sha256=task_sha)


def _has_config(root: Path) -> bool:
    """Whether ``root`` holds a config.json, asked of ``stat``: ``Path.is_file`` says False for
    a directory this user may not enter, and the run was refused as "no config.json" (or died
    in ``find_gguf``'s listing with a PermissionError traceback); ``stat`` raises it, for
    :func:`~jaxrl_sym.models.hf.file_checks.refuse_unreadable` to name."""
    try:
        return stat.S_ISREG((root / "config.json").stat().st_mode)
    except (FileNotFoundError, NotADirectoryError):
        return False


# --------------------------------------------------------------------------- export
