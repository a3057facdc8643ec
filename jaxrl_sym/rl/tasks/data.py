"""Your data: ``train --model DIR --dataset FILE`` on the practitioner's own problems.

Why a module: a dataset arrives as JSONL, JSON (a list of objects, or ``{"data": [...]}``), CSV
or Parquet, with its own field names (GSM8K's ``question`` / ``answer`` with a ``#### N`` tail),
and every bad row must be refused naming the file, the line (JSONL, CSV) or row index (JSON,
Parquet: ``FILE[i]``, 0-based) and the field — before JAX is imported, a model is loaded or a
step runs. So this module is JAX-free: the CLI reads and checks the whole file while checking its
flags. Parquet goes through ``pyarrow`` when it is installed (an optional dependency: without it
a ``.parquet`` file is refused with ``pip install pyarrow``).

A row becomes a :class:`~jaxrl_sym.rl.tasks.text_tasks.Problem`: a text prompt or a list of
``{role, content}`` chat messages (rendered with the tokenizer's chat template), an exact answer
(a number, ``"1,234"``, or text ending ``#### N``), and its other fields as read (which
``--reward module:function`` receives). Without ``--eval-dataset`` a fixed 10% of the rows (at
least one; the same rows whatever the seed) is held out for the final evaluation and never
trained on: a ``jsonl:`` task evaluated on its own training rows, which measured memorisation.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import math
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

from jaxrl_sym.errors import InputError
from jaxrl_sym.jsonl import parse_object, read_lines
from jaxrl_sym.rl.tasks.text_tasks import (
    DATASET_TASK,
    Problem,
    TextTask,
    extract_answer,
    format_answer,
    get_text_task,
    parse_number,
)

FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".csv": "csv",
           ".tsv": "tsv", ".parquet": "parquet", ".pq": "parquet"}
HOLDOUT_FRACTION = 0.1  # of --dataset's rows, held out when there is no --eval-dataset
SPLIT_SEED = 0  # the held-out rows do not depend on --seed: the split is part of the data
GSM8K_PROMPT = "question"  # the prompt field used when the default 'prompt' is absent


@dataclass(frozen=True)
class Fields:
    """Which fields of a row hold the prompt and the answer (``--prompt-field`` and
    ``--answer-field``); ``question`` stands in for an absent default ``prompt`` (GSM8K)."""

    prompt: str = "prompt"
    answer: str = "answer"


def short(value: Any, width: int = 60) -> str:
    """``repr(value)`` cut to ``width`` characters: a message names a value, not a page."""
    text = repr(value)
    return text if len(text) <= width else text[:width - 1] + "…"


def file_sha256(path: Path, flag: str) -> str:
    """The digest of the file's bytes, recorded in the checkpoint (a changed file is a changed
    run on resume)."""
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError as err:
        raise InputError(f"cannot read {flag} {path}: {err.strerror or err}") from None


def _text(path: Path, flag: str) -> str:
    """The file as UTF-8 text (a byte-order mark dropped), a decoding error named by line."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = data[:err.start].count(b"\n") + 1
        raise InputError(f"{path}:{line}: bytes that are not UTF-8 ({data[err.start:err.end]!r}); "
                         f"save the {flag} file as UTF-8") from None


def _jsonl(path: Path, flag: str) -> list[tuple[str, Any]]:
    return [(f"{path}:{n}", parse_object(line, f"{path}:{n}", "a JSON object"))
            for n, line in read_lines(path, f"{flag} file")]


def _json(path: Path, flag: str) -> list[tuple[str, Any]]:
    try:
        data = json.loads(_text(path, flag))
    except json.JSONDecodeError as err:
        if err.msg == "Extra data":  # JSON lines in a .json file, as `datasets` accepts
            return _jsonl(path, flag)
        raise InputError(f"{path}:{err.lineno}: not valid JSON ({err.msg} at column "
                         f"{err.colno})") from None
    if isinstance(data, dict) and isinstance(data.get("data"), list):
        data = data["data"]
    if not isinstance(data, list):
        raise InputError(f"{path}: expected a JSON list of objects or {{\"data\": [...]}}, got "
                         f"{type(data).__name__}")
    return [(f"{path}[{i}]", rec) for i, rec in enumerate(data)]


def _csv(path: Path, flag: str, delimiter: str = ",") -> list[tuple[str, Any]]:
    reader = csv.reader(io.StringIO(_text(path, flag), newline=""), delimiter=delimiter)
    header: list[str] | None = None
    rows = []
    try:
        for cells in reader:
            if not cells:
                continue
            if header is None:
                header = cells
                if len(set(header)) != len(header) or "" in header:
                    raise InputError(f"{path}:{reader.line_num}: the header needs distinct, "
                                     f"non-empty column names, got {header}")
                continue
            where = f"{path}:{reader.line_num}"
            if len(cells) != len(header):
                raise InputError(f"{where}: {len(cells)} cells where the header has "
                                 f"{len(header)} ({', '.join(header)})")
            rows.append((where, dict(zip(header, cells, strict=True))))
    except csv.Error as err:
        raise InputError(f"{path}:{reader.line_num}: not valid CSV ({err})") from None
    return rows


def _parquet(path: Path, flag: str) -> list[tuple[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise InputError(f"{flag} {path}: reading Parquet needs pyarrow, which is not installed: "
                         "pip install pyarrow (or convert the file to JSONL)") from None
    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as err:  # pyarrow's ArrowInvalid / OSError: a damaged or foreign file
        raise InputError(f"{flag} {path}: not a readable Parquet file ({err})") from None
    return [(f"{path}[{i}]", rec) for i, rec in enumerate(rows)]


def read_records(path: str | Path, flag: str = "--dataset") -> list[tuple[str, Any]]:
    """``(where, record)`` of every row, ``where`` being ``FILE:LINE`` or ``FILE[i]``; the format
    comes from the file's suffix."""
    path = Path(path)
    kind = FORMATS.get(path.suffix.lower())
    if kind is None:
        raise InputError(f"{flag} {path}: unknown format {path.suffix or '(no suffix)'}; give "
                         f"one of {', '.join(FORMATS)}")
    try:  # a missing or unreadable file, named by its flag
        path.open("rb").close()
    except OSError as err:
        raise InputError(f"cannot read {flag} {path}: {err.strerror or err}") from None
    if kind == "tsv":
        return _csv(path, flag, "\t")
    return {"jsonl": _jsonl, "json": _json, "csv": _csv, "parquet": _parquet}[kind](path, flag)


def parse_answer(value: Any, where: str, field: str = "answer") -> Fraction:
    """A row's answer as an exact Fraction: a number, ``"1,234"`` / ``"$5"``, or text whose
    ``#### N`` gives it (GSM8K's worked solutions)."""
    if isinstance(value, Fraction):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return Fraction(value)
    if isinstance(value, float) and math.isfinite(value):
        return Fraction(str(value))  # 2.5 -> 5/2 as written, not the binary float
    if isinstance(value, str):
        try:
            return parse_number(value)
        except ValueError:
            found = extract_answer(value)
            if found.source == "hash" and found.value is not None:
                return found.value
    raise InputError(f"{where}: field {field!r} must be a number (42, 2.5, \"1,234\") or text "
                     f"ending in '#### N' (GSM8K), got {short(value)}")


def _messages(value: list[Any], where: str, field: str) -> tuple[tuple[str, str], ...]:
    """A chat prompt's ``(role, content)`` pairs, each message checked."""
    out = []
    for i, m in enumerate(value):
        if (not isinstance(m, dict) or not isinstance(m.get("role"), str) or not m["role"]
                or not isinstance(m.get("content"), str)):
            raise InputError(f"{where}: field {field!r} message {i} must be an object with a "
                             f"'role' and a 'content' string, got {short(m)}")
        out.append((m["role"], m["content"]))
    return tuple(out)


def _problem(where: str, rec: Any, fields: Fields) -> Problem:
    """One row as a Problem; every refusal names ``where`` and the field."""
    if not isinstance(rec, dict):
        raise InputError(f"{where}: expected an object with fields {fields.prompt!r} and "
                         f"{fields.answer!r}, got {type(rec).__name__}")
    pf = fields.prompt
    if pf not in rec and pf == Fields.prompt and GSM8K_PROMPT in rec:
        pf = GSM8K_PROMPT
    for name, flag in ((pf, "--prompt-field"), (fields.answer, "--answer-field")):
        if name not in rec:
            nor = " (nor 'question')" if name == Fields.prompt else ""
            raise InputError(f"{where}: no field {name!r}{nor} (fields: {sorted(rec)}); name "
                             f"the right one with {flag}")
    value = rec[pf]
    if isinstance(value, str) and value.strip():
        prompt, messages = value, None
    elif isinstance(value, list) and value:
        messages = _messages(value, where, pf)
        prompt = next((c for r, c in reversed(messages) if r == "user"), messages[-1][1])
    else:
        raise InputError(f"{where}: field {pf!r} must be a non-empty string or a list of "
                         f"{{\"role\", \"content\"}} messages, got {short(value)}")
    answer = parse_answer(rec[fields.answer], where, fields.answer)
    rest = {k: v for k, v in rec.items() if k != pf}
    return Problem(prompt, answer, messages=messages, fields=rest)


def load_dataset(path: str | Path, fields: Fields = Fields(), flag: str = "--dataset"
                 ) -> list[Problem]:
    """Every row of ``path`` as a Problem, all checked before any is used: a bad row, or a
    prompt repeated with another answer (the reward could not tell which is right), is an
    InputError naming it; so is a file without rows."""
    problems: list[Problem] = []
    first: dict[str, tuple[str, Problem]] = {}
    for where, rec in read_records(path, flag):
        p = _problem(where, rec, fields)
        key = json.dumps(p.messages) if p.messages is not None else p.prompt
        seen, other = first.setdefault(key, (where, p))
        if other.answer != p.answer:
            raise InputError(f"{where}: the same prompt as {seen} with another answer "
                             f"({format_answer(p.answer)} vs {format_answer(other.answer)})")
        problems.append(p)
    if not problems:
        raise InputError(f"{flag} {path} holds no rows; give objects with fields "
                         f"{fields.prompt!r} and {fields.answer!r}")
    return problems


def holdout(problems: list[Problem], path: str) -> tuple[list[Problem], list[Problem]]:
    """``(train, held out)``: a fixed :data:`HOLDOUT_FRACTION` of the rows (at least one), the
    same whatever the run's seed, kept in file order."""
    n = len(problems)
    k = max(1, round(n * HOLDOUT_FRACTION))
    if n - k < 1:
        raise InputError(f"--dataset {path} holds {n} row(s): too few to hold out "
                         f"{HOLDOUT_FRACTION:.0%} (at least one row) for the final evaluation "
                         "and train on the rest; give --eval-dataset FILE")
    held = set(np.random.default_rng(SPLIT_SEED).permutation(n)[:k].tolist())
    return ([p for i, p in enumerate(problems) if i not in held],
            [p for i, p in enumerate(problems) if i in held])


@dataclass(frozen=True)
class Dataset:
    """A ``--dataset`` run's rows: those it trains on, those it evaluates on, and the digests of
    the files they came from (recorded in its checkpoints)."""

    path: str
    fields: Fields
    train: tuple[Problem, ...]
    held_out: tuple[Problem, ...]
    eval_path: str | None
    sha256: str
    eval_sha256: str | None

    @property
    def eval_note(self) -> str:
        """Where the final evaluation's rows come from, for the run's summary."""
        if self.eval_path is not None:
            return f"--eval-dataset {self.eval_path} ({len(self.held_out)} rows)"
        total = len(self.train) + len(self.held_out)
        return (f"{len(self.held_out)} of {total} rows of {self.path} held out (a fixed "
                f"{HOLDOUT_FRACTION:.0%} split, not trained on)")

    def field_names(self) -> set[str]:
        """Every field a row passes to a reward function."""
        return {k for p in (*self.train, *self.held_out) for k in (p.fields or {})}


def open_dataset(path: str, fields: Fields = Fields(), eval_path: str | None = None
                 ) -> Dataset:
    """Read and check ``path`` (and ``eval_path``), holding out a split when there is no
    evaluation file."""
    rows = load_dataset(path, fields)
    if eval_path is None:
        train, held = holdout(rows, path)
        eval_sha = None
    else:
        train, held = rows, load_dataset(eval_path, fields, "--eval-dataset")
        eval_sha = file_sha256(Path(eval_path), "--eval-dataset")
    return Dataset(str(path), fields, tuple(train), tuple(held), eval_path,
                   file_sha256(Path(path), "--dataset"), eval_sha)


NO_REWARDS: dict[str, Any] = dict.fromkeys(("reward", "reward_weights", "reward_sha256"))


@dataclass(frozen=True)
class TextOptions:
    """What a ``--model`` run takes from the user besides a ``--task``: a dataset, a system
    prompt, reward functions (a :class:`~jaxrl_sym.rl.tasks.rewards.RewardSet`). None of each: the
    task's problems, the prompt alone, the built-in reward."""

    dataset: Dataset | None = None
    system_prompt: str | None = None
    rewards: Any = None

    def hparams(self) -> dict[str, Any]:
        """The run identity these define (compared on resume): every key always present, so
        a setting added on resume is a difference, not a key one side lacks."""
        ds = self.dataset
        out: dict[str, Any] = {
            "dataset": None if ds is None else ds.path,
            "prompt_field": None if ds is None else ds.fields.prompt,
            "answer_field": None if ds is None else ds.fields.answer,
            "eval_dataset": None if ds is None else ds.eval_path,
            "dataset_sha256": None if ds is None else ds.sha256,
            "eval_dataset_sha256": None if ds is None else ds.eval_sha256,
            "system_prompt": self.system_prompt}
        return {**out, **(NO_REWARDS if self.rewards is None else self.rewards.hparams())}

    def tasks(self, task: str) -> tuple[TextTask, TextTask | None, str | None]:
        """``(training problems, evaluation problems or None: the same, what the summary says
        about the evaluation)`` of ``task`` with these options."""
        ds = self.dataset
        if ds is None:
            note = ("the training file itself (a jsonl: task holds out no rows; --dataset FILE "
                    "does)") if task.startswith("jsonl:") else None
            return get_text_task(task), None, note
        if task != DATASET_TASK:
            raise InputError(f"--dataset {ds.path} with --task {task}: a run trains on one of "
                             "them; drop --task")
        name = f"dataset {ds.path}"
        return (TextTask(name, ds.train), TextTask(f"{name} (evaluation)", ds.held_out,
                                                   held_out=True), ds.eval_note)

    def check_chat(self, chat: bool, model: str) -> None:
        """Chat-message prompts need the model's chat template: refused at the start without."""
        ds = self.dataset
        if not chat and ds is not None and any(p.messages for p in (*ds.train, *ds.held_out)):
            raise InputError(f"--dataset {ds.path}: its prompts are chat messages, but --model "
                             f"{model} has no chat template to render them; give text prompts "
                             "or a model with a chat template")


def chat_messages(problem: Problem, system_prompt: str | None) -> list[dict[str, str]]:
    """The messages a chat template renders: the row's own, or its prompt as the user's; the
    system prompt first unless the row starts with a system message of its own."""
    msgs = ([{"role": r, "content": c} for r, c in problem.messages] if problem.messages
            else [{"role": "user", "content": problem.prompt}])
    if system_prompt is not None and msgs[0]["role"] != "system":
        msgs.insert(0, {"role": "system", "content": system_prompt})
    return msgs


def plain_prompt(problem: Problem, system_prompt: str | None) -> str:
    """A prompt for a model without a chat template: the system prompt, a blank line, the
    prompt (chat messages are refused before: :meth:`TextOptions.check_chat`)."""
    return problem.prompt if system_prompt is None else f"{system_prompt}\n\n{problem.prompt}"
