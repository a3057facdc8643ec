"""A GGUF file → the same Flax model a Hugging Face directory gives.

The file is read by :mod:`~jaxrl_sym.models.hf.gguf` (JAX-free, so the CLI can check
``--model`` before JAX loads); this module builds the model: the metadata's config through
``parse_config``, each tensor dequantized, un-permuted, transposed and cast on the host, then
placed by the shared name table (:mod:`~jaxrl_sym.models.hf.targets`) one at a time, so there
are never two copies of the weights.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxrl_sym.errors import InputError
from jaxrl_sym.models.hf.config import parse_config
from jaxrl_sym.models.hf.gguf import (
    ARCHS,
    ROPE_FREQS,
    GGUFFile,
    check_types,
    config_dict,
    default_dtype,
    dequantized,
    open_gguf,
    tensor_map,
)
from jaxrl_sym.models.hf.gguf_text import gguf_tokenizer, token_ids
from jaxrl_sym.models.hf.modeling import abstract_model
from jaxrl_sym.models.hf.targets import parameter_targets, variable_at


def _rope_freqs(g: GGUFFile, cfg: Any) -> Any:
    """``cfg`` with RoPE frequencies divided by the file's ``rope_freqs`` factors, as llama.cpp
    applies them (transformers' GGUF loader drops this tensor)."""
    t = g.tensors.get(ROPE_FREQS)
    if t is None:
        return cfg
    factors = dequantized(t, cfg, False).reshape(-1)
    if factors.shape[0] != len(cfg.inv_freq):
        raise InputError(f"GGUF file {g.path}: {ROPE_FREQS} has {factors.shape[0]} values, "
                         f"RoPE has {len(cfg.inv_freq)} frequencies")
    inv = (np.asarray(cfg.inv_freq, np.float32) / factors).astype(np.float32)
    return dataclasses.replace(cfg, inv_freq=tuple(float(x) for x in inv))


def _assign(model: Any, targets: dict[str, Any], by_hf: dict[str, Any], cfg: Any,
            permuted: bool) -> None:
    """Dequantize, transpose and cast each tensor on the host, put it on the device into its
    parameter (the loader's placement), then drop the host copy before the next."""
    np_dtype = np.dtype(cfg.dtype)
    for hf, t in by_hf.items():
        target = targets[hf]
        arr = dequantized(t, cfg, permuted)
        if target.transpose:
            arr = arr.T
        arr = np.ascontiguousarray(arr, dtype=np_dtype)
        variable_at(model, target.path).set_value(jax.device_put(arr))
        del arr


def load_gguf(path: Path, dtype: Any = None) -> tuple[Any, Any, dict[str, Any]]:
    """``load_pretrained`` for a GGUF file: ``(model, tokenizer or None, generation dict)``."""
    g = open_gguf(path)
    raw = config_dict(g)
    check_types(g)
    try:
        cfg = parse_config(raw, dtype if dtype is not None else default_dtype(g))
    except InputError as err:
        raise InputError(f"GGUF file {g.path}: its metadata gives an unsupported model: "
                         f"{err}") from None
    cfg = _rope_freqs(g, cfg)
    model = abstract_model(cfg)
    targets = parameter_targets(model)
    _assign(model, targets, tensor_map(g, targets), cfg, ARCHS[g.arch][1])
    return model, gguf_tokenizer(g), token_ids(g)
