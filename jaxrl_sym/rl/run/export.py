"""The trained policy of a ``train --model`` run: rebuilt from its checkpoint (``eval``,
:func:`restore_policy`) and exported as a Hugging Face directory or PEFT adapters
(``jaxrl-sym export --checkpoint-dir``, :func:`export_checkpoint`).

Why apart from :mod:`jaxrl_sym.rl.run.pretrained` (which sets a run up): these run after training,
from the checkpoint's metadata alone — the source model's directory, its dtype, LoRA settings
and the digest of the base weights the run trained on.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from jaxrl_sym.errors import InputError
from jaxrl_sym.rl.run.pretrained import model_digest
from jaxrl_sym.weights.precision import Precision


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
    and each is cast (if asked) and placed into the model one at a time. An export's peak RSS
    went from about ten times the policy's size (a trainer, its optimiser state and reference,
    host copies of all of them) to one copy of the weights plus orbax's read buffers
    (``bench/results/cpu/export_memory.md``).
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
    A LoRA run's checkpoint holds adapters, not weights: its policy is the run's base with them
    merged in (the model its merged export holds).
    """
    import jax
    from flax import nnx

    lora = _lora_meta(checkpoint_dir, step)
    if lora is not None:
        from jaxrl_sym.weights.lora import merged_model

        base, plan, adapters, meta, _ = _lora_parts(checkpoint_dir, lora, merging=True)
        return merged_model(base, plan, adapters), meta
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
    from jaxrl_sym.rl.run.checkpoint import Checkpointer

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
    from jaxrl_sym.weights.peft import export_merged

    base, plan, adapters, meta, source = _lora_parts(checkpoint_dir, lora, merging=not peft)
    if peft:
        return _export_peft(plan, adapters, base, out_dir, _peft_base(meta["hparams"], source),
                            dtype=dtype, overwrite=overwrite), meta
    if dtype is not None:
        raise InputError("--dtype: a LoRA run's merged export keeps the base model's dtype; "
                         "drop --dtype (or load the export and cast it)")
    return export_merged(plan, adapters, base, out_dir, source_dir=source,
                         overwrite=overwrite, max_shard_bytes=max_shard_bytes), meta


def _peft_base(hparams: dict[str, Any], source: str) -> str:
    """What a PEFT adapter names as its base (``base_model_name_or_path``): the model the run
    trained from. For a GGUF run that is the file itself, whose weights the adapters were
    trained on; ``source`` is then the directory of its rebuilt config and tokenizer under the
    user's cache, which holds no weights. :func:`~jaxrl_sym.weights.peft.load_peft` checks an
    adapter against either."""
    from jaxrl_sym.models.hf.gguf import find_gguf

    root = Path(hparams["model_dir"])
    if (root / "config.json").is_file():
        return source
    g = find_gguf(root)
    return str(Path(g).resolve()) if g is not None else source


def _lora_parts(checkpoint_dir: str | Path, lora: tuple[int, dict], *, merging: bool
                ) -> tuple[Any, Any, Any, dict[str, Any], str]:
    """A LoRA run's frozen base (from the run's own model file: a GGUF's weights are not in
    its rebuilt source directory), LoRA plan, adapters, step metadata and source directory.
    ``merging``: the adapters go into the base, which must then hold the weights the run
    trained on (its digest is checked against the checkpoint's)."""
    from jaxrl_sym.models.contract import model_fingerprint
    from jaxrl_sym.models.hf import load_pretrained
    from jaxrl_sym.rl.run.checkpoint import Checkpointer
    from jaxrl_sym.weights.lora import plan_lora
    from jaxrl_sym.weights.lora_config import LoraConfig

    step, meta = lora
    hp = meta["hparams"]
    base = load_pretrained(hp["model_dir"], dtype=hp.get("model_dtype"))[0]
    if merging and hp.get("base_sha256") not in (None, model_digest(base)):
        raise InputError(f"--checkpoint-dir {checkpoint_dir}: the run's base model "
                         f"{hp['model_dir']} holds other weights than the run trained on (its "
                         "digest differs from the one the checkpoint recorded); merging the "
                         "adapters into it would give a model nobody trained. Restore the base "
                         "weights, or export the adapters alone with --peft")
    plan = plan_lora(base, LoraConfig(**hp["lora"]))
    master = Precision(hp.get("precision") or "fp32").master
    shapes = [s for i, o in plan.shapes for s in ([[i, plan.rank], master],
                                                   [[plan.rank, o], master])]
    fp = {k: v for k, v in model_fingerprint(base).items() if k != "params"}
    meta, params = Checkpointer(checkpoint_dir, create=False).restore_params(
        step, {"model": fp, "params": shapes})
    return base, plan, params["lm"], meta, _source_dir(checkpoint_dir, hp)


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
