"""RL fine-tuning of a pretrained Hugging Face checkpoint on a text task, and the way back out.

``jaxrl-sym train --model DIR --task word-problems`` (or ``--task jsonl:FILE``) runs the same
training loop as the built-in tasks (:func:`jaxrl_sym.rl.train.train`); this module supplies what
differs, so the loop itself only asks :func:`setup` for it:

* the **task in tokens**: problems rendered through the checkpoint's chat template when it has
  one (else plain text), encoded with its tokenizer; the reward decodes the response and scores
  it with :func:`jaxrl_sym.rl.text_tasks.reward` against the answer of *that* prompt;
* the **EOS id** from the checkpoint's files, and the **model** itself (loaded only after the
  loop has checked its flags and output paths);
* the **source directory** in the run's hyper-parameters (``model_dir``), so a checkpoint knows
  which model it started from: resuming with another ``--model`` is refused like any changed
  setting, and :func:`export_checkpoint` can write the trained policy as a Hugging Face
  directory next to that model's config and tokenizer;
* the user's **dataset, system prompt and rewards** (``--dataset``, ``--reward``:
  :mod:`jaxrl_sym.rl.data`, :mod:`jaxrl_sym.rl.rewards`), whose flags and file digests join the
  recorded hyper-parameters, so a resume with other data or reward code is a changed run.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import stat
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jaxrl_sym.errors import InputError
from jaxrl_sym.rl.data import TextOptions, chat_messages, plain_prompt
from jaxrl_sym.rl.text_tasks import (
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
from jaxrl_sym.weights.precision import Precision

DEFAULT_MAX_NEW_TOKENS = 256  # room for a short worked solution and its '#### N' line
# Token slots per training micro-batch of a checkpoint run (RLConfig.update_tokens). A
# pretrained model's activations dominate the update: at SmolLM2-135M's shape in fp32 a GRPO
# batch of 8 x 128 tokens in one micro-batch peaks at 4.9 GB (ledger), in micro-batches of 512
# slots at 3.0 GB; the update is the same (gradients are summed, then one optimiser step).
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
# ~100x the full model's (PEFT's and TRL's LoRA examples use 1e-4-2e-4). Measured on
# SmolLM2-135M, LoRA 16: 3e-4 learned (bench/results/cpu/pretrained_learning_exact70.md),
# 5e-4 collapsed; 1e-6 left the adapters where they started.
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
        self.rewards = rewards  # a RewardSet (jaxrl_sym.rl.rewards); None: reward() below
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

    def use(self, problems: Sequence[Problem]) -> list[np.ndarray]:
        """``problems`` as prompt token arrays; their answers are what the rewards score next
        (a new step for the rewards' per-sample indices and means)."""
        prompts = [self.encode(p) for p in problems]
        from jaxrl_sym.models.hf.config import check_positions  # JAX: not at CLI import

        i = int(np.argmax([len(p) for p in prompts]))
        check_positions(self.max_positions, len(prompts[i]) + self.max_new_tokens,
                        f"task {self.task.name}: a prompt of {len(prompts[i])} tokens "
                        f"({problems[i].prompt[:40]!r}…) with --max-new-tokens "
                        f"{self.max_new_tokens}", "lower --max-new-tokens or use shorter prompts")
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
    """What :func:`jaxrl_sym.rl.train.train` needs from a ``--model DIR`` run."""

    model_dir: str
    task: TokenTextTask
    eos_id: int
    dtype: str | None = None
    user: TextOptions = dataclasses.field(default_factory=TextOptions)

    def rl_config(self, lora: bool) -> dict[str, Any]:
        """RLConfig fields this run fixes (a caller's ``config`` may still override them);
        ``lora``: adapters train, at :data:`PRETRAINED_LORA_LR`."""
        return {"eos_id": self.eos_id, "max_new_tokens": self.task.max_new_tokens,
                **PRETRAINED_RECIPE, **({"lr": PRETRAINED_LORA_LR} if lora else {})}

    @property
    def hparams(self) -> dict[str, Any]:
        """Recorded in every checkpoint: the source model (export, resume check) and the
        prompt format."""
        return {"model_dir": self.model_dir, "chat_template": self.task.chat,
                "model_dtype": self.dtype, **self.user.hparams()}

    def load_model(self) -> Any:
        from jaxrl_sym.models.hf import load_pretrained

        return load_pretrained(self.model_dir, dtype=self.dtype)[0]


def setup(model_dir: str | None, task: str, *, max_new_tokens: int | None = None,
          dtype: str | None = None, format_weight: float = FORMAT_WEIGHT,
          text: TextOptions | None = None) -> PretrainedRun | None:
    """The pretrained side of a run, or None for the built-in model and token tasks.

    Cheap: reads the tokenizer, chat template, EOS ids and (for ``jsonl:``) the task file — the
    weights are loaded later by :meth:`PretrainedRun.load_model`. Every mismatch of model and
    task is an :class:`InputError` naming the flag. ``text``: the user's dataset, system prompt
    and rewards (:func:`jaxrl_sym.rl.rewards.text_options`; None: the task's own).
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
    return PretrainedRun(os.path.abspath(model_dir), token_task, eos[0], dtype, user)


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


def _policy_dtype(hparams: dict[str, Any], fingerprint: dict[str, Any]) -> Any:
    """The dtype the run's trained parameters have: its precision's master dtype, else (a run
    from before precisions) the run's ``--dtype``, else its saved parameters'."""
    if hparams.get("precision"):
        return Precision(hparams["precision"]).master
    if hparams.get("model_dtype"):
        return hparams["model_dtype"]
    shapes = fingerprint.get("params") or [[None, "float32"]]
    return shapes[0][1]


def _host_policy(checkpoint_dir: str | Path, step: int | None, dtype: str | None
                 ) -> tuple[Any, dict[str, Any]]:
    """The trained policy with host (numpy) parameters, cast to ``dtype`` when given, and the
    step's metadata.

    Built without a trainer and without loading the source weights: the source's config.json
    gives a shape-only model, :meth:`Checkpointer.restore_params` reads only the parameters,
    and each is cast (if asked) and placed into the model one at a time. The export of a
    0.54 GB policy went from 5.8 GB peak RSS (a trainer, its optimiser state and reference,
    host copies of all of them) to one copy of the weights plus orbax's read buffers.
    """
    import jax
    from flax import nnx

    from jaxrl_sym.models.contract import model_fingerprint
    from jaxrl_sym.models.hf.config import parse_config, parse_dtype
    from jaxrl_sym.models.hf.modeling import abstract_model
    from jaxrl_sym.models.hf.text import read_json

    ckpt, step, meta = _export_step(checkpoint_dir, step)
    source = _source_dir(checkpoint_dir, meta.get("hparams", {}))
    raw = read_json(Path(source) / "config.json", "config")
    abstract = abstract_model(parse_config(raw, _policy_dtype(meta["hparams"],
                                                              meta.get("fingerprint", {}))))
    graphdef, state = nnx.split(abstract)
    shapes, treedef = jax.tree_util.tree_flatten(state)
    fp = {k: v for k, v in model_fingerprint(abstract).items() if k != "params"}
    meta, params = ckpt.restore_params(step, {"model": fp, "params": [
        [list(x.shape), str(np.dtype(x.dtype))] for x in shapes]})
    leaves = params["lm"]
    if dtype is not None:
        dt = parse_dtype(dtype, "--dtype")
        graphdef = nnx.graphdef(abstract_model(dataclasses.replace(abstract.cfg, dtype=dt)))
        for i, x in enumerate(leaves):  # in place: one tensor in two dtypes at a time
            leaves[i] = np.asarray(x).astype(dt)
    return nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, leaves)), meta


def _source_dir(checkpoint_dir: str | Path, hparams: dict[str, Any]) -> str:
    """The Hugging Face directory the run started from (its config and tokenizer; for a GGUF
    file, the directory :func:`~jaxrl_sym.models.hf.gguf_source.hf_source` writes)."""
    source = hparams.get("model_dir")
    if not source:
        raise InputError(f"checkpoint {checkpoint_dir} was not trained from a Hugging Face "
                         "model (its metadata records no model_dir); only checkpoints of "
                         "'jaxrl-sym train --model DIR' can be exported")
    root = Path(source)
    if not (root / "config.json").is_file() and (
            root.suffix.lower() == ".gguf" or (root.is_dir() and any(root.glob("*.gguf")))):
        from jaxrl_sym.models.hf.gguf import find_gguf
        from jaxrl_sym.models.hf.gguf_source import hf_source

        # the config and tokenizer the loader rebuilds from the file, written once
        return str(hf_source(find_gguf(root) or root))
    if not (root / "config.json").is_file():
        raise InputError(f"checkpoint {checkpoint_dir} started from {source}, which is no "
                         "longer a checkpoint directory (no config.json); export needs its "
                         "config and tokenizer")
    return str(source)


def source_model(checkpoint_dir: str | Path, step: int | None = None) -> str:
    """The Hugging Face directory a ``train --model`` checkpoint started from (whose config and
    tokenizer an export copies); an InputError when there is none to export from."""
    _, _, meta = _export_step(checkpoint_dir, step)
    return _source_dir(checkpoint_dir, meta.get("hparams", {}))


def restore_policy(checkpoint_dir: str | Path, step: int | None = None
                   ) -> tuple[Any, dict[str, Any]]:
    """The trained policy (a CausalLM on the device) of a ``train --model`` checkpoint and its
    metadata.

    The source model (its ``model_dir`` in the checkpoint) gives the structure; the checkpoint's
    fingerprint, the parameters' digest and finiteness are verified as on resume, and the newest
    step is used unless ``step`` is given (a step that fails verification is an error naming it).
    """
    import jax
    from flax import nnx

    model, meta = _host_policy(checkpoint_dir, step, None)
    for _, var in nnx.to_flat_state(nnx.state(model)):
        var.set_value(jax.device_put(var.get_value()))  # one tensor at a time
    return model, meta


def export_checkpoint(checkpoint_dir: str | Path, out_dir: str | Path, *, step: int | None = None,
                      dtype: str | None = None, overwrite: bool = False,
                      max_shard_bytes: int | None = None, peft: bool = False
                      ) -> tuple[list[str], dict[str, Any]]:
    """Export the policy of a ``train --model`` checkpoint as a Hugging Face directory (a LoRA
    run: its adapters merged into the source model; with ``peft``, the adapters as a PEFT
    adapter directory instead, cast to ``dtype`` when given: :func:`_export_peft`).

    Returns the files written and ``{"source_model", "step", "params_sha256"}``.
    """
    from jaxrl_sym.models.hf.export import (
        DEFAULT_MAX_SHARD_BYTES,
        check_no_overlap,
        export_pretrained,
    )

    max_shard_bytes = max_shard_bytes or DEFAULT_MAX_SHARD_BYTES
    _, _, first = _export_step(checkpoint_dir, step)
    check_no_overlap(Path(out_dir).absolute(), {
        "--checkpoint-dir": checkpoint_dir,
        "the run's source model": first.get("hparams", {}).get("model_dir")})
    lora = _lora_meta(checkpoint_dir, step)
    if lora is not None or peft:
        if lora is None:
            raise InputError(f"--peft: {checkpoint_dir} is a full fine-tuning run (no LoRA "
                             "adapters); export it without --peft")
        files, meta = _export_lora(checkpoint_dir, lora, out_dir, peft=peft, dtype=dtype,
                                   overwrite=overwrite, max_shard_bytes=max_shard_bytes)
    else:
        model, meta = _host_policy(checkpoint_dir, step, dtype)  # host arrays: export reads them
        files = export_pretrained(model, out_dir,
                                  source_dir=_source_dir(checkpoint_dir, meta["hparams"]),
                                  overwrite=overwrite, max_shard_bytes=max_shard_bytes)
    return files, {"source_model": meta["hparams"]["model_dir"], "step": int(meta["step"]),
                   "params_sha256": meta.get("params_sha256")}


def _export_step(checkpoint_dir: str | Path, step: int | None) -> tuple[Any, int, dict]:
    """``(checkpointer, step, metadata)`` of the step to export: the one named, else the newest.
    One named step, never a fall-back: an export must not change a training directory. The
    hyper-parameters come first: they say which model to build."""
    from jaxrl_sym.rl.checkpoint import Checkpointer

    ckpt = Checkpointer(checkpoint_dir, create=False)
    steps = ckpt.steps()
    if not steps:
        raise InputError(f"--checkpoint-dir {checkpoint_dir} holds no checkpoint")
    if step is not None and step not in steps:
        raise InputError(f"--step {step}: {checkpoint_dir} holds steps {steps}")
    step = steps[-1] if step is None else step
    return ckpt, step, ckpt._read_meta(step)


def _lora_meta(checkpoint_dir: str | Path, step: int | None) -> tuple[int, dict] | None:
    """``(step, metadata)`` of a LoRA run's checkpoint to export, None for a full one."""
    _, step, meta = _export_step(checkpoint_dir, step)
    return (step, meta) if meta.get("hparams", {}).get("lora") else None


def _export_lora(checkpoint_dir: str | Path, lora: tuple[int, dict], out_dir: str | Path, *,
                 peft: bool, dtype: str | None, overwrite: bool, max_shard_bytes: int
                 ) -> tuple[list[str], dict[str, Any]]:
    """A LoRA run's export: the source model (its frozen base) with the checkpoint's adapters
    merged in (a plain Hugging Face directory), or with ``peft`` a PEFT adapter directory."""
    from jaxrl_sym.models.contract import model_fingerprint
    from jaxrl_sym.models.hf import load_pretrained
    from jaxrl_sym.rl.checkpoint import Checkpointer
    from jaxrl_sym.weights.lora import plan_lora
    from jaxrl_sym.weights.lora_config import LoraConfig
    from jaxrl_sym.weights.peft import export_merged

    step, meta = lora
    hp = meta["hparams"]
    source = _source_dir(checkpoint_dir, hp)
    # the run's frozen base, from its own file (a GGUF's weights are not in ``source``)
    base = load_pretrained(hp["model_dir"], dtype=hp.get("model_dtype"))[0]
    plan = plan_lora(base, LoraConfig(**hp["lora"]))
    master = Precision(hp.get("precision") or "fp32").master
    shapes = [s for i, o in plan.shapes for s in ([[i, plan.rank], master],
                                                   [[plan.rank, o], master])]
    fp = {k: v for k, v in model_fingerprint(base).items() if k != "params"}
    meta, params = Checkpointer(checkpoint_dir, create=False).restore_params(
        step, {"model": fp, "params": shapes})
    if peft:
        return _export_peft(plan, params["lm"], base, out_dir, source, dtype=dtype,
                            overwrite=overwrite), meta
    if dtype is not None:
        raise InputError("--dtype: a LoRA run's merged export keeps the base model's dtype; "
                         "drop --dtype (or load the export and cast it)")
    return export_merged(plan, params["lm"], base, out_dir, source_dir=source,
                         overwrite=overwrite, max_shard_bytes=max_shard_bytes), meta


def _export_peft(plan: Any, adapters: Any, base: Any, out_dir: str | Path, source: str, *,
                 dtype: str | None, overwrite: bool) -> list[str]:
    """The adapters as a PEFT adapter directory: float32 (what :func:`export_peft` writes), or
    every tensor cast to ``dtype``.

    Why ``--dtype`` is applied, not refused: PEFT writes adapters in the dtype they are held in
    (float32 by default, since peft upcasts adapters for training; the base model's dtype when
    they were made or cast so) and loads any of float32, bfloat16 and float16 (upcasting half
    precision for compute by default), so a float16 adapter is an ordinary PEFT file at half
    the size, and ``export --peft --dtype float16`` asks for exactly that; it was silently
    written in float32. Each tensor is range-checked for the cast
    (:func:`~jaxrl_sym.models.hf.file_checks.check_weight` with ``dtype``): a weight past
    float16's ±65504 would load as inf and poison every logit, so it is refused by name before
    ``out_dir`` changes. The cast rewrites the file in a staging directory beside ``out_dir``,
    swapped into place when complete, as every export is (and removed on any exception or
    signal).
    """
    from jaxrl_sym.models.hf.config import parse_dtype
    from jaxrl_sym.models.hf.export import check_out_dir, swap_into_place
    from jaxrl_sym.weights.peft import ADAPTER_WEIGHTS, export_peft

    if dtype is None:
        return export_peft(plan, adapters, base, out_dir, base_model_name_or_path=source,
                           overwrite=overwrite)
    target = np.dtype(parse_dtype(dtype, "--dtype"))
    out = Path(out_dir).absolute()
    check_out_dir(out, None, overwrite)
    stage = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        files = export_peft(plan, adapters, base, stage / out.name,
                            base_model_name_or_path=source)
        cast_adapter_file(stage / out.name / ADAPTER_WEIGHTS, target)
        swap_into_place(stage / out.name, out)
    except OSError as e:  # a full disk, a quota: the user's --out, named
        raise InputError(f"out_dir {out}: writing the adapter failed ({e.strerror or e}); "
                         "nothing was written there") from None
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return files


def cast_adapter_file(path: Path, dtype: np.dtype) -> None:
    """Rewrite the safetensors file ``path`` with every tensor cast to ``dtype``, each checked
    first (NaN/inf, and the range of ``dtype``), so a refused cast writes nothing."""
    from jaxrl_sym.models.hf.file_checks import check_weight
    from jaxrl_sym.models.hf.safetensors_io import read_header, read_tensor, write_safetensors

    start, header = read_header(path)
    meta = header.pop("__metadata__", None)
    with open(path, "rb") as fh:
        tensors = {n: read_tensor(fh, start, e, n) for n, e in header.items()}
    for name, arr in tensors.items():
        check_weight(arr, name, f"the adapter being exported with --dtype {dtype.name}",
                     dtype=dtype, remedy="nothing was written. NaN adapters mean the run "
                     "diverged: export an earlier step (--step)")
    cast = {n: a.astype(dtype) for n, a in tensors.items()}
    write_safetensors(path, {n: (a.shape, a.dtype) for n, a in cast.items()}, cast.__getitem__,
                      metadata=meta)
