"""Write a :class:`~jaxrl_sym.models.hf.modeling.CausalLM` back out as a Hugging Face directory.

``export_pretrained(model, out_dir, source_dir=...)`` produces what transformers'
``save_pretrained`` would: ``config.json`` (the source's, with its dtype field set to the
parameters' dtype), ``model.safetensors`` or shards plus ``model.safetensors.index.json`` above
``max_shard_bytes``, and the tokenizer files and ``generation_config.json`` copied from the source.

Why it is built this way:

* **Names by the loader's rule, inverted.** Tensor names and layouts come from
  :func:`jaxrl_sym.models.hf.targets.parameter_targets` — the very function the loader uses to map
  a checkpoint name to a parameter — so export and load cannot drift apart: there is no second
  table. A ``kernel`` is transposed back to PyTorch's ``[out, in]``.
* **The source config is the truth.** The model only knows what :class:`HFConfig` keeps; fields
  transformers needs but the model ignores (``architectures``, ``bos_token_id``, rope spellings)
  come from the source ``config.json``, which must parse to the model's own config — a source of
  another architecture is refused rather than written next to weights it does not describe.
* **Atomic.** Everything is written into a temporary directory beside ``out_dir`` and renamed
  into place at the end, so a crash or a full disk leaves either nothing or the old directory,
  never a half checkpoint whose ``config.json`` makes it look complete.
* **One tensor at a time on the host**: each tensor is copied from the device, transposed,
  written and dropped before the next (:mod:`.safetensors_io` streams the file, header first), so
  an export holds the model plus about one tensor — the bytes are those ``save_file`` writes.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxrl_sym.errors import InputError
from jaxrl_sym.models.hf.config import parse_config
from jaxrl_sym.models.hf.file_checks import check_weight
from jaxrl_sym.models.hf.loader import INDEX_FILE, SINGLE_FILE
from jaxrl_sym.models.hf.modeling import CausalLM
from jaxrl_sym.models.hf.safetensors_io import write_safetensors
from jaxrl_sym.models.hf.targets import parameter_targets
from jaxrl_sym.models.hf.text import read_json

# Files copied verbatim from the source directory when present (tokenizer and generation
# settings: nothing in them depends on the weights).
COPIED_FILES = (
    "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt",
    "tokenizer.model", "chat_template.jinja", "chat_template.json",
)
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # transformers' historical default ("5GB")
_DTYPE_NAMES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def hf_tensors(model: CausalLM) -> dict[str, tuple[tuple[Any, ...], bool]]:
    """HF tensor name → (parameter path, transpose?), the loader's mapping read backwards."""
    return {name: (t.path, t.transpose) for name, t in parameter_targets(model).items()}


def _param(model: CausalLM, path: tuple[Any, ...]) -> Any:
    """The parameter's value (a device array) at an NNX path."""
    node: Any = model
    for p in path:
        node = node[p] if isinstance(p, int) else getattr(node, p)
    return node.get_value()


def _host_tensor(model: CausalLM, path: tuple[Any, ...], transpose: bool) -> np.ndarray:
    """One parameter as a contiguous host array in HF layout."""
    arr = np.asarray(jax.device_get(_param(model, path)))
    return np.ascontiguousarray(arr.T if transpose else arr)


def _finite(name: str, arr: np.ndarray) -> np.ndarray:
    """``arr``, refused if it holds NaN or inf: the loader refuses such a checkpoint (the same
    :func:`~jaxrl_sym.models.hf.file_checks.check_weight`), so writing one would only move the
    failure to whoever loads it (the export stops before ``--out`` changes)."""
    check_weight(arr, name, "the model being exported", overflow_fix="export with --dtype "
                 "bfloat16 or float32", remedy="nothing was written to the output. NaN weights "
                 "mean the run diverged: export an earlier checkpoint (--step)")
    return arr


def export_config(model: CausalLM, source_dir: Path) -> dict[str, Any]:
    """The source ``config.json`` with its dtype field(s) set to the model's parameter dtype.

    Refuses a source whose config does not parse to the model's architecture (another model's
    directory passed by mistake would otherwise produce a checkpoint that loads as garbage).
    """
    raw = read_json(source_dir / "config.json", "config")
    dtype = np.dtype(model.cfg.dtype).name
    if parse_config(raw, dtype) != model.cfg:
        raise InputError(f"source_dir {source_dir}: its config.json describes another "
                         "architecture than the model being exported (vocabulary, layers, "
                         "heads, RoPE or attention patterns differ); pass the directory the "
                         "model was loaded from")
    out = dict(raw)
    keys = [k for k in ("dtype", "torch_dtype") if k in out] or ["dtype"]
    for k in keys:
        out[k] = _DTYPE_NAMES[dtype]
    return out


def plan_shards(sizes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
    """Tensor names grouped into shards of at most ``max_shard_bytes`` (a tensor larger than
    the limit gets a shard of its own, as transformers does), in name order."""
    shards: list[list[str]] = [[]]
    used = 0
    for name in sorted(sizes):
        if shards[-1] and used + sizes[name] > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += sizes[name]
    return shards


def _write_weights(model: CausalLM, tmp: Path, max_shard_bytes: int) -> list[str]:
    """safetensors file(s) (+ index when sharded) into ``tmp``; returns the files written.

    Streamed (:func:`write_safetensors`): each tensor is copied to the host, transposed and
    written before the next, so the export holds the model plus about one tensor. With
    ``safetensors.numpy.save_file`` the dict of every host tensor was a second full copy.
    """
    names = hf_tensors(model)
    specs: dict[str, tuple[tuple[int, ...], Any]] = {}
    for name, (path, transpose) in names.items():
        val = _param(model, path)
        specs[name] = (tuple(val.shape)[::-1] if transpose else tuple(val.shape), val.dtype)
    sizes = {n: int(np.prod(s, dtype=np.int64)) * np.dtype(d).itemsize
             for n, (s, d) in specs.items()}
    shards = plan_shards(sizes, max_shard_bytes)
    meta = {"format": "pt"}  # transformers refuses safetensors files without a known format

    def write(fname: str, group: list[str]) -> None:
        write_safetensors(tmp / fname, {n: specs[n] for n in group},
                          lambda n: _finite(n, _host_tensor(model, *names[n])), metadata=meta)

    if len(shards) == 1:
        write(SINGLE_FILE, shards[0])
        return [SINGLE_FILE]
    files, weight_map = [], {}
    for i, group in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        write(fname, group)
        weight_map.update({n: fname for n in group})
        files.append(fname)
    index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
    (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return [*files, INDEX_FILE]


def check_no_overlap(out: Path, protected: Mapping[str, str | Path | None]) -> None:
    """An :class:`InputError` when ``out`` is, holds, or lies inside a path an export reads
    (``protected``: its label → path, e.g. ``{"--checkpoint-dir": run}``): replacing ``out``
    would delete it. Compared as resolved paths, so links and ``..`` do not hide an overlap."""
    where = out.resolve()
    for label, path in protected.items():
        if path is None:
            continue
        p = Path(path).resolve()
        if where == p or p.is_relative_to(where) or where.is_relative_to(p):
            how = ("is" if where == p else "holds" if p.is_relative_to(where) else "lies inside")
            raise InputError(f"out_dir {out} {how} {label} {path}: writing it would replace "
                             "what the export reads; export into a directory outside it")


def check_out_dir(out: Path, source: Path | None, overwrite: bool,
                  protected: Mapping[str, str | Path | None] | None = None) -> None:
    """An :class:`InputError` for an output directory an export must not write (the source,
    what holds it or lies inside it, or another ``protected`` path; a file; a non-empty
    directory without ``overwrite``; a missing parent)."""
    check_no_overlap(out, {"the source directory": source, **(protected or {})})
    if out.exists() and not out.is_dir():
        raise InputError(f"out_dir {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise InputError(f"out_dir {out} is not empty; choose an empty or new directory, or "
                         "pass overwrite=True (--overwrite) to replace its contents")
    if not out.parent.is_dir():
        raise InputError(f"out_dir {out}: parent directory {out.parent} does not exist")


_RENAME_EXCHANGE = 2  # linux/fs.h: swap two paths atomically


def _exchange(a: Path, b: Path) -> bool:
    """Swap ``a`` and ``b`` in one atomic step (Linux ``renameat2(RENAME_EXCHANGE)``); False
    where the kernel, libc or file system cannot, and nothing was changed."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd = -100
    rc = renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE)
    return rc == 0


def swap_into_place(tmp: Path, out: Path) -> None:
    """Rename ``tmp`` to ``out``. An existing ``out`` is exchanged with ``tmp`` atomically, so
    at every moment ``out`` is the old directory or the new one, never missing (a kill between
    two renames used to leave none); where the system cannot exchange, it is moved aside first
    and deleted after — and moved back when anything (a signal's exception included) stops the
    second rename, so ``out`` is not left missing with the old copy hidden beside it."""
    if not out.exists():
        os.rename(tmp, out)
        return
    if _exchange(tmp, out):
        shutil.rmtree(tmp, ignore_errors=True)  # tmp now holds the old directory
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    try:
        os.rename(out, old / out.name)
        os.rename(tmp, out)
    except BaseException:
        if not out.exists() and (old / out.name).exists():
            os.rename(old / out.name, out)
        raise
    finally:
        shutil.rmtree(old, ignore_errors=True)  # empty, or the old copy once out is the new


def export_pretrained(model: CausalLM, out_dir: str | Path, *, source_dir: str | Path,
                      overwrite: bool = False,
                      max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> list[str]:
    """Write ``model`` as a Hugging Face checkpoint directory transformers can load.

    Args:
      model: a :class:`CausalLM` (from :func:`load_pretrained`, possibly fine-tuned or cast).
      out_dir: the directory to create. An existing non-empty one is refused unless
        ``overwrite``; it is replaced only once the new checkpoint is complete.
      source_dir: the checkpoint the model was loaded from: its ``config.json`` (dtype updated)
        and tokenizer/generation files are reused.
      max_shard_bytes: above this total, the weights are split into shards of at most this
        many bytes with a ``model.safetensors.index.json``.

    Returns the names of the files written.
    """
    if not isinstance(model, CausalLM):
        raise InputError(f"export_pretrained needs a jaxrl_sym.models.hf CausalLM, got "
                         f"{type(model).__name__}")
    if max_shard_bytes < 1:
        raise InputError(f"max_shard_bytes={max_shard_bytes} must be >= 1")
    out, source = Path(out_dir).absolute(), Path(source_dir)
    if not (source / "config.json").is_file():
        raise InputError(f"source_dir {source} has no config.json; pass the Hugging Face "
                         "directory the model was loaded from")
    check_out_dir(out, source, overwrite)
    config = export_config(model, source)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:  # any exception (a signal's, from the CLI's handler, too) removes the partial copy
        written = _write_weights(model, tmp, max_shard_bytes)
        for name in COPIED_FILES:
            if (source / name).is_file():
                shutil.copyfile(source / name, tmp / name)
                written.append(name)
        # config.json last: a directory with it is a checkpoint (and tmp is renamed anyway).
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        written.append("config.json")
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
        swap_into_place(tmp, out)
    except OSError as e:  # a full disk, a quota, a device gone: the user's --out, named
        shutil.rmtree(tmp, ignore_errors=True)
        raise InputError(f"out_dir {out}: writing the checkpoint failed ({e.strerror or e}"
                         f"{': ' + str(e.filename) if e.filename else ''}); nothing was "
                         "written there (the partial copy was removed)") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return sorted(written)
