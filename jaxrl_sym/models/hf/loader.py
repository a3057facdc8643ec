"""Load a Hugging Face checkpoint directory into a contract model, one tensor at a time.

``load_pretrained(path) -> (model, tokenizer | None, generation_config | None)``.

Why it is built this way:

* **Memory.** The model is first built under ``nnx.eval_shape`` (parameters are shapes, nothing
  is allocated), then each safetensors tensor is read on its own (a plain read at its header's
  offsets into its own array; no memory map, whose touched pages would count as a second copy),
  transposed/cast on the host, put on the device and assigned into its parameter before the next
  is read. At no point do two full copies of the weights exist.
* **Fail before reading.** Every file's header (names, shapes, dtypes) is read first and checked
  against the model's parameters; a missing, unexpected or mis-shaped tensor is reported by name
  (with its file) before any weight data is read, instead of after minutes of loading.
* **Names by rule.** The NNX modules carry transformers' names, so ``model.layers.3.mlp.up_proj
  .weight`` is parameter path ``model/layers/3/mlp/up_proj/kernel``; Linear weights are stored
  ``[out, in]`` by PyTorch and ``[in, out]`` by NNX, hence the transpose.
* **Nothing that poisons a run loads.** Each tensor passes :func:`check_weight` as it is read:
  NaN/inf, or a value the dtype asked for cannot hold (float16 past ±65504 loaded as inf and
  decoded token 0). GGUF, PEFT adapters and the exporter call the same function; a path this
  user may not read is an error naming it and the permission needed (``refuse_unreadable``).
* **bf16.** numpy has no bfloat16; tensors are read as ``ml_dtypes.bfloat16`` arrays from the
  file's bytes, whatever the installed safetensors' numpy side supports.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxrl_sym.errors import InputError
from jaxrl_sym.models.hf.config import HFConfig, parse_config
from jaxrl_sym.models.hf.file_checks import check_readable, check_weight, refuse_unreadable
from jaxrl_sym.models.hf.gguf import find_gguf, open_gguf
from jaxrl_sym.models.hf.gguf_model import load_gguf
from jaxrl_sym.models.hf.gguf_text import gguf_tokenizer
from jaxrl_sym.models.hf.modeling import CausalLM, abstract_model
from jaxrl_sym.models.hf.safetensors_io import ST_DTYPES, read_header, read_tensor
from jaxrl_sym.models.hf.targets import Target, parameter_targets, variable_at
from jaxrl_sym.models.hf.text import read_json

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Buffers some exporters save that are recomputed from the config, never parameters.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_ST_DTYPES = ST_DTYPES  # the floating dtypes a parameter may be stored in


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as its file header describes it (no data read)."""

    file: Path
    shape: tuple[int, ...]
    dtype: str  # safetensors code: F32, BF16, F16, …


def checkpoint_tensors(root: Path) -> dict[str, TensorInfo]:
    """Every tensor of the checkpoint (single file or sharded via the index), from headers only.

    A sharded checkpoint's index must agree with its shards: a tensor the index lists but its
    shard lacks, or a shard holding a tensor the index does not list, is an error naming both.
    """
    from safetensors import SafetensorError, safe_open

    if (root / INDEX_FILE).exists():
        weight_map = read_json(root / INDEX_FILE, "index").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise InputError(f"{root / INDEX_FILE} has no 'weight_map' of tensor names to files")
        files = sorted({str(f) for f in weight_map.values()})
    elif (root / SINGLE_FILE).exists():
        weight_map, files = None, [SINGLE_FILE]
    else:
        raise InputError(f"{root} holds neither {SINGLE_FILE} nor {INDEX_FILE}; point at a "
                         "Hugging Face checkpoint directory saved with safetensors")
    out: dict[str, TensorInfo] = {}
    for fname in files:
        fpath = root / fname
        if not fpath.exists():
            raise InputError(f"{root / INDEX_FILE} names shard {fname}, which is missing")
        try:
            with safe_open(str(fpath), framework="numpy") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                    sl = f.get_slice(name)
                    out[name] = TensorInfo(fpath, tuple(sl.get_shape()), str(sl.get_dtype()))
        except (OSError, ValueError, RuntimeError, SafetensorError) as err:
            # SafetensorError derives from Exception only (safetensors 0.8): named here; the
            # Rust reader's "permission denied" is no damage: the probe says so
            check_readable(fpath, "checkpoint file")
            raise InputError(f"cannot read safetensors file {fpath}: {err}; the file is "
                             "truncated or damaged — re-download or re-export it") from None
    if weight_map is not None:
        for name, fname in weight_map.items():
            info = out.get(name)
            if info is None or info.file.name != Path(fname).name:
                raise InputError(f"{root / INDEX_FILE} maps tensor {name!r} to {fname}, but "
                                 f"that shard does not hold it")
        stray = sorted(set(out) - set(weight_map))
        if stray:
            raise InputError(f"tensor {stray[0]!r} in {out[stray[0]].file.name} is not listed "
                             f"in {INDEX_FILE}; the index and shards disagree")
    return out


def _check_names(root: Path, tensors: dict[str, TensorInfo], targets: dict[str, Target],
                 cfg: HFConfig) -> None:
    """Missing, unexpected and mis-shaped tensors, each named, before any data is read."""
    missing = sorted(set(targets) - set(tensors))
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise InputError(f"checkpoint {root} lacks tensor {missing[0]!r}{more} that a "
                         f"{cfg.model_type} model with this config.json needs; the weights do "
                         "not match the config")
    for name, info in tensors.items():
        target = targets.get(name)
        if target is None:
            if _ignorable(name, cfg):
                continue
            raise InputError(f"unexpected tensor {name!r} in {info.file}: a {cfg.model_type} "
                             "model with this config.json has no such parameter; the weights do "
                             "not match the config (or the architecture is not supported)")
        if info.shape != target.hf_shape:
            raise InputError(f"tensor {name!r} in {info.file} has shape {list(info.shape)}, but "
                             f"config.json implies {list(target.hf_shape)}; the weights do not "
                             "match the config")
        if info.dtype not in _ST_DTYPES:
            raise InputError(f"tensor {name!r} in {info.file} has dtype {info.dtype}; only "
                             f"floating tensors ({', '.join(_ST_DTYPES)}) can be parameters")


def _ignorable(name: str, cfg: HFConfig) -> bool:
    """Tensors a checkpoint may carry that this model recomputes or shares."""
    if name.endswith(_IGNORED_SUFFIXES):
        return True
    return name == "lm_head.weight" and cfg.tie_word_embeddings  # tied: the embedding is used


def _assign(model: CausalLM, tensors: dict[str, TensorInfo], targets: dict[str, Target],
            np_dtype: Any) -> None:
    """Read each tensor, transpose/cast it on the host, and put it into its parameter.

    Plain reads at the header's offsets, not ``safe_open``: its memory map kept every page
    read in the resident set until the file closed, so peak RSS showed the weights twice
    (:mod:`.safetensors_io`)."""
    by_file: dict[Path, list[str]] = {}
    for name in targets:
        by_file.setdefault(tensors[name].file, []).append(name)
    for fpath, names in by_file.items():
        data_start, header = read_header(fpath)
        with open(fpath, "rb") as fh:
            for name in names:
                target = targets[name]
                arr = read_tensor(fh, data_start, header[name], name)
                check_weight(arr, name, fpath, np_dtype)
                if target.transpose:
                    arr = arr.T
                arr = np.ascontiguousarray(arr, dtype=np_dtype)
                variable_at(model, target.path).set_value(jax.device_put(arr))
                del arr  # one host copy of one tensor at a time


def _dtype_from_tensors(raw: dict[str, Any], tensors: dict[str, TensorInfo]) -> Any:
    """The dtype to load in when the caller gave none: config.json's, else the embedding's."""
    if raw.get("dtype") or raw.get("torch_dtype"):
        return None  # parse_config reads it from the config
    info = tensors.get("model.embed_tokens.weight")
    return {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}.get(
        info.dtype if info else "F32", "float32")


def load_tokenizer(root: str | Path) -> Any:
    """``tokenizers.Tokenizer`` from ``tokenizer.json`` (or a GGUF file's vocabulary), or None
    when there is none."""
    root = Path(root)
    gguf_file = find_gguf(root)
    if gguf_file is not None:
        return gguf_tokenizer(open_gguf(gguf_file))
    tok_file = root / "tokenizer.json"
    if not tok_file.exists():
        return None
    check_readable(tok_file, "tokenizer")
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(tok_file))
    except Exception as err:  # the Rust side raises its own Exception type
        raise InputError(f"cannot read tokenizer {tok_file}: {err}") from None


def load_pretrained(path: str | Path, dtype: Any = None,
                    ) -> tuple[CausalLM, Any, dict[str, Any] | None]:
    """Load a Hugging Face checkpoint directory or a GGUF file as a contract model.

    Args:
      path: a directory with ``config.json`` and ``model.safetensors`` or
        ``model.safetensors.index.json`` + shards (``save_pretrained(safe_serialization=True)``);
        or a llama.cpp ``.gguf`` file, or a directory holding exactly one and no
        ``config.json`` (dequantized on load: :mod:`jaxrl_sym.models.hf.gguf`).
      dtype: parameter/compute dtype (``"float32"``, ``"bfloat16"``, ``jnp.float32`` …); None
        keeps the checkpoint's (``config.json``'s ``dtype``/``torch_dtype``; a quantized GGUF:
        float32).

    Returns:
      ``(model, tokenizer, generation_config)``: a :class:`CausalLM` called as
      ``model(tokens, positions, segment_ids) -> float32 logits``; a ``tokenizers.Tokenizer``
      from ``tokenizer.json`` (or the GGUF's vocabulary) or None; the
      ``generation_config.json`` dict (a GGUF's bos/eos/pad ids) or None.
    """
    root = Path(path)
    with refuse_unreadable("checkpoint", root):  # the user's path named, not a traceback
        return _load(root, dtype)


def _load(root: Path, dtype: Any) -> tuple[CausalLM, Any, dict[str, Any] | None]:
    """:func:`load_pretrained`'s body, inside its permission boundary."""
    gguf_file = find_gguf(root)
    if gguf_file is not None:
        return load_gguf(gguf_file, dtype)
    if not (root / "config.json").is_file():
        raise InputError(f"{root} is not a Hugging Face checkpoint directory nor a GGUF file: "
                         "it has no config.json (and no .gguf file)")
    check_readable(root / "config.json", "checkpoint config")
    raw = read_json(root / "config.json", "config")
    parse_config(raw)  # model_type and fields checked before any tensor file is touched
    tensors = checkpoint_tensors(root)
    cfg = parse_config(raw, dtype if dtype is not None else _dtype_from_tensors(raw, tensors))
    model = abstract_model(cfg)
    targets = parameter_targets(model)
    _check_names(root, tensors, targets, cfg)
    _assign(model, tensors, targets, np.dtype(cfg.dtype))
    gen_file = root / "generation_config.json"
    gen = read_json(gen_file, "generation config") if gen_file.exists() else None
    return model, load_tokenizer(root), gen
