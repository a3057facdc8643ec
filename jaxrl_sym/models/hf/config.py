"""Hugging Face ``config.json`` → one frozen architecture config for the decoder families.

Why one config for several families: Qwen2/Qwen2.5 and Llama 3.x are the same pre-norm decoder
(RMSNorm, RoPE with rotate-half, GQA, SwiGLU) and differ only in fields — which projections carry
biases, how RoPE frequencies are scaled, which layers use a sliding window, whether the head is
tied. Reading those fields into one :class:`HFConfig` keeps the modeling code free of family
branches and puts every config quirk (old and new spellings of the same field) in this file.

The RoPE inverse frequencies are computed here, once, in float32 exactly as transformers computes
them (``_compute_default_rope_parameters`` / ``_compute_llama3_parameters``), and stored in the
config as a tuple so the config stays hashable and the model needs no family logic for RoPE.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxrl_sym.errors import InputError
from jaxrl_sym.ops.attention import Causal, Pattern, Window

SUPPORTED_MODEL_TYPES = ("qwen2", "llama")

_DTYPES: dict[str, Any] = {
    "float32": jnp.float32, "fp32": jnp.float32,
    "bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16,
    "float16": jnp.float16, "fp16": jnp.float16,
}


@dataclass(frozen=True)
class HFConfig:
    """Architecture of a Qwen2- or Llama-style checkpoint. Frozen: a hashable, static config."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    inv_freq: tuple[float, ...]   # RoPE inverse frequencies (float32 values), head_dim // 2
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    tie_word_embeddings: bool
    patterns: tuple[Pattern, ...]
    dtype: Any = jnp.float32


def parse_dtype(value: Any, what: str) -> Any:
    """A JAX dtype from a name (``"bfloat16"``, ``"float32"``, …), a numpy/JAX dtype or None."""
    if value is None:
        return None
    if isinstance(value, str):
        name = value.removeprefix("torch.")
        if name in _DTYPES:
            return _DTYPES[name]
        raise InputError(f"{what}={value!r} is not a supported dtype; use one of "
                         "float32, bfloat16, float16")
    try:
        dt = jnp.dtype(value)
    except TypeError:
        raise InputError(f"{what}={value!r} is not a dtype; use float32, bfloat16 or "
                         "float16") from None
    if dt.name not in _DTYPES:
        raise InputError(f"{what}={dt.name} is not supported; use float32, bfloat16 or float16")
    return _DTYPES[dt.name]


def _int(raw: dict[str, Any], key: str, default: int | None = None) -> int:
    val = raw.get(key, default)
    if not isinstance(val, int) or isinstance(val, bool) or val < 1:
        raise InputError(f"config.json: {key}={val!r} must be an int >= 1")
    return val


def _rope_params(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling dict or None) from either spelling transformers has written.

    transformers < 5 writes ``rope_theta`` and ``rope_scaling``; transformers 5 writes one
    ``rope_parameters`` dict holding ``rope_theta`` and ``rope_type``. Old scaling dicts say
    ``type`` instead of ``rope_type``.
    """
    params = raw.get("rope_parameters")
    scaling = raw.get("rope_scaling")
    theta = raw.get("rope_theta")
    if isinstance(params, dict):
        theta = params.get("rope_theta", theta)
        scaling = scaling or params
    if theta is None:
        theta = 10000.0
    if isinstance(scaling, dict):
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind in (None, "default"):
            scaling = None
        else:  # transformers falls back to max_position_embeddings for the original length
            scaling = {"original_max_position_embeddings": raw.get("max_position_embeddings"),
                       **{k: v for k, v in scaling.items() if v is not None}, "rope_type": kind}
    elif scaling is not None:
        raise InputError(f"config.json: rope_scaling={scaling!r} is not a dict")
    if float((params or {}).get("partial_rotary_factor", 1.0)) != 1.0:
        raise InputError("config.json: partial_rotary_factor != 1 is not supported by this "
                         "loader (Qwen2 and Llama rotate the whole head)")
    return float(theta), scaling


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> np.ndarray:
    """RoPE inverse frequencies in float32, as transformers computes them.

    Default: ``1 / theta ** (arange(0, d, 2) / d)``. ``llama3`` (Llama 3.1+): wavelengths longer
    than ``original_max_position_embeddings / low_freq_factor`` are divided by ``factor``,
    shorter than ``… / high_freq_factor`` kept, and the band between interpolated smoothly —
    transcribed from ``_compute_llama3_parameters``.
    """
    exps = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv_freq = (np.float32(1.0) / (np.float32(theta) ** exps)).astype(np.float32)
    if scaling is None:
        return inv_freq
    kind = scaling["rope_type"]
    if kind != "llama3":
        raise InputError(f"config.json: rope scaling type {kind!r} is not supported; this "
                         "loader implements the default RoPE and 'llama3' (Llama 3.1+)")
    try:
        factor = np.float32(scaling["factor"])
        low = np.float32(scaling["low_freq_factor"])
        high = np.float32(scaling["high_freq_factor"])
        old_len = np.float32(scaling["original_max_position_embeddings"])
    except KeyError as err:
        raise InputError(f"config.json: llama3 rope scaling lacks {err.args[0]!r}") from None
    low_wavelen = old_len / low
    high_wavelen = old_len / high
    wavelen = (np.float32(2 * math.pi) / inv_freq).astype(np.float32)
    scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq).astype(np.float32)
    smooth = ((old_len / wavelen - low) / (high - low)).astype(np.float32)
    smoothed = ((1 - smooth) * scaled / factor + smooth * scaled).astype(np.float32)
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _layer_patterns(raw: dict[str, Any], n_layers: int) -> tuple[Pattern, ...]:
    """Per-layer attention pattern where transformers applies a sliding window.

    ``layer_types`` (transformers 5 writes it) wins; otherwise Qwen2's rule: with
    ``use_sliding_window`` true, layers ``i >= max_window_layers`` use ``sliding_window``. A
    window of ``w`` sees ``w`` keys including the query's own (HF: ``q - k < w``), which is
    exactly :class:`Window`.
    """
    window = raw.get("sliding_window")
    layer_types = raw.get("layer_types")
    if layer_types is None:
        use = bool(raw.get("use_sliding_window", False)) and window is not None
        first = raw.get("max_window_layers", n_layers)
        layer_types = ["sliding_attention" if use and i >= first else "full_attention"
                       for i in range(n_layers)]
    elif raw.get("model_type") == "qwen2" and not raw.get("use_sliding_window", False):
        window = None  # Qwen2Config drops sliding_window when use_sliding_window is false
    if len(layer_types) != n_layers:
        raise InputError(f"config.json: layer_types has {len(layer_types)} entries for "
                         f"num_hidden_layers={n_layers}")
    pats: list[Pattern] = []
    for i, kind in enumerate(layer_types):
        if kind == "full_attention" or (kind == "sliding_attention" and window is None):
            pats.append(Causal())
        elif kind == "sliding_attention":
            pats.append(Window(_int(raw, "sliding_window")))
        else:
            raise InputError(f"config.json: layer_types[{i}]={kind!r} is not supported; "
                             "expected 'full_attention' or 'sliding_attention'")
    return tuple(pats)


def parse_config(raw: dict[str, Any], dtype: Any = None) -> HFConfig:
    """An :class:`HFConfig` from a parsed ``config.json``.

    ``dtype`` (None: the checkpoint's ``torch_dtype``/``dtype``, else float32) is what the
    parameters are stored and computed in.
    """
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise InputError(f"config.json: model_type={model_type!r} is not supported; supported "
                         f"model types: {', '.join(SUPPORTED_MODEL_TYPES)}")
    hidden = _int(raw, "hidden_size")
    heads = _int(raw, "num_attention_heads")
    kv_heads = _int(raw, "num_key_value_heads", heads)
    head_dim = raw.get("head_dim") or hidden // heads
    if heads % kv_heads:
        raise InputError(f"config.json: num_attention_heads={heads} is not a multiple of "
                         f"num_key_value_heads={kv_heads}")
    n_layers = _int(raw, "num_hidden_layers")
    theta, scaling = _rope_params(raw)
    attention_bias = bool(raw.get("attention_bias", False))
    if dtype is None:
        dtype = parse_dtype(raw.get("dtype") or raw.get("torch_dtype"), "config.json dtype")
    else:
        dtype = parse_dtype(dtype, "dtype")
    return HFConfig(
        model_type=model_type,
        vocab_size=_int(raw, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=_int(raw, "intermediate_size"),
        num_layers=n_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=int(head_dim),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        inv_freq=tuple(float(f) for f in rope_inv_freq(int(head_dim), theta, scaling)),
        qkv_bias=model_type == "qwen2" or attention_bias,
        o_bias=model_type == "llama" and attention_bias,
        mlp_bias=model_type == "llama" and bool(raw.get("mlp_bias", False)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        patterns=_layer_patterns(raw, n_layers),
        dtype=dtype or jnp.float32,
    )
