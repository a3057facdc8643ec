"""Hugging Face ``config.json`` → one frozen architecture config for the decoder families.

Why one config for several families: Qwen2/Qwen2.5, Qwen3, Llama 3.x, Mistral, Gemma 2 and
Gemma 3 (text) are all the same decoder (RMSNorm, RoPE with rotate-half, GQA, a gated MLP) and
differ only in fields — which projections carry biases, q/k norms (Qwen3, Gemma 3), Gemma's
``1 + weight`` norms with extra post-attention/feed-forward norms, GeGLU instead of SwiGLU, a
scaled embedding, the softmax scale, logit soft-caps (Gemma 2), how RoPE frequencies are scaled
and whether local layers use another base (Gemma 3), which layers use a sliding window, whether
the head is tied. Reading those fields into one :class:`HFConfig` keeps the modeling code free of
family branches and puts every config quirk (old and new spellings of the same field, the
defaults each transformers config class fills in) in this file.

The RoPE inverse frequencies are computed here, once, in float32 exactly as transformers computes
them (``_compute_default_rope_parameters`` / ``_compute_llama3_parameters`` /
``_compute_linear_scaling_rope_parameters``), and stored in the config as a tuple so the config
stays hashable and the model needs no family logic for RoPE. Anything this loader does not
implement (another rope type, bidirectional attention, another activation) is an error naming
``config.json`` and the key, never a model that silently computes different logits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxrl_sym.errors import InputError
from jaxrl_sym.ops.attention import Causal, Pattern, Window

SUPPORTED_MODEL_TYPES = ("qwen2", "llama", "qwen3", "mistral", "gemma2", "gemma3_text")
GEMMA_TYPES = ("gemma2", "gemma3_text")

# What each transformers config class fills in for a key config.json omits, where that is not
# the generic fallback below (head_dim = hidden / heads, rope_theta 1e4, no window, untied).
_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen2": {"max_window_layers": 28, "sliding_window": 4096},
    "qwen3": {"max_window_layers": 28, "sliding_window": 4096, "head_dim": 128},
    "mistral": {"sliding_window": 4096},
    "gemma2": {"head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 4096,
               "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0,
               "tie_word_embeddings": True, "hidden_activation": "gelu_pytorch_tanh"},
    "gemma3_text": {"head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 4096,
                    "tie_word_embeddings": True, "hidden_activation": "gelu_pytorch_tanh"},
}
# transformers' ACT2FN names → the activations the MLP implements.
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh",
                "gelu": "gelu"}

_DTYPES: dict[str, Any] = {
    "float32": jnp.float32, "fp32": jnp.float32,
    "bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16,
    "float16": jnp.float16, "fp16": jnp.float16,
}


@dataclass(frozen=True)
class HFConfig:
    """Architecture of a supported checkpoint. Frozen: a hashable, static config.

    The fields after ``patterns`` have defaults so a Qwen2/Llama config reads as before: Llama
    norms, SwiGLU, ``head_dim ** -0.5`` softmax scale, no caps, one RoPE for every layer.
    """

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
    qk_norm: bool = False          # RMSNorm of q and k over head_dim before RoPE (Qwen3, Gemma 3)
    gemma_norm: bool = False       # norms scale by (1 + weight), in float32, then cast (Gemma)
    sandwich_norms: bool = False   # norms after attention/MLP too, + pre-MLP norm (Gemma)
    hidden_act: str = "silu"       # gated MLP activation: silu, gelu_tanh or gelu
    embed_scale: float | None = None       # embeddings times this (Gemma: sqrt(hidden_size))
    attn_scale: float | None = None        # softmax scale; None = head_dim ** -0.5
    attn_softcap: float | None = None      # c * tanh(s / c) on attention scores (Gemma 2)
    final_softcap: float | None = None     # c * tanh(z / c) on output logits (Gemma 2/3)
    inv_freq_local: tuple[float, ...] | None = None  # RoPE of sliding layers if not inv_freq
    # positions the checkpoint was trained for (None: its config does not say); RoPE computes
    # any position, so past this the model extrapolates and :func:`check_positions` refuses
    max_position_embeddings: int | None = None


def check_positions(limit: int | None, longest: int, what: str, fix: str,
                    allow: bool = False) -> None:
    """Refuse ``longest`` positions (prompt + new tokens) past ``limit`` (a checkpoint's
    ``max_position_embeddings``; None: unknown): generation and training there ran without a
    word and gave a model's guesses outside the range it was trained on. ``what`` names the
    user's thing, ``fix`` the way out; ``allow`` (an explicit opt-in) extrapolates on purpose."""
    if limit is not None and longest > limit and not allow:
        raise InputError(f"{what} needs {longest} positions, but the checkpoint was trained "
                         f"for max_position_embeddings={limit}; {fix}")


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
    key = "rope_scaling" if raw.get("rope_scaling") else "rope_parameters"
    return _positive({"rope_theta": theta}, "rope_theta"), _scaling(scaling, raw, key)


def _scaling(scaling: Any, raw: dict[str, Any], key: str) -> dict[str, Any] | None:
    """A rope scaling dict normalised to ``rope_type`` (None for the default RoPE)."""
    if scaling is None:
        return None
    if not isinstance(scaling, dict):
        raise InputError(f"config.json: {key}={scaling!r} is not a dict")
    if float(scaling.get("partial_rotary_factor") or 1.0) != 1.0:
        raise InputError(f"config.json: {key}.partial_rotary_factor != 1 is not supported by "
                         "this loader (every supported family rotates the whole head)")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in (None, "default"):
        return None
    # transformers falls back to max_position_embeddings for the original length
    return {"original_max_position_embeddings": raw.get("max_position_embeddings"),
            **{k: v for k, v in scaling.items() if v is not None}, "rope_type": kind,
            "key": key}


def _gemma3_rope(raw: dict[str, Any]) -> tuple[tuple[float, dict[str, Any] | None], float]:
    """((global theta, global scaling), local theta) of a Gemma 3 config.

    transformers 5 writes ``rope_parameters`` keyed by layer type; older configs write
    ``rope_theta`` + ``rope_scaling`` for the global (full-attention) layers and
    ``rope_local_base_freq`` for the local ones, which never scale (``Gemma3TextConfig
    .convert_rope_params_to_dict``). Defaults: 1e6 global, 1e4 local.
    """
    params = raw.get("rope_parameters")
    if params is None:
        theta = _positive_or(raw, "rope_theta", 1_000_000.0)
        local = _positive_or(raw, "rope_local_base_freq", 10_000.0)
        return (theta, _scaling(raw.get("rope_scaling"), raw, "rope_scaling")), local
    if not isinstance(params, dict) or not set(params) <= {"full_attention",
                                                            "sliding_attention"}:
        raise InputError("config.json: rope_parameters of a gemma3_text model must map "
                         f"'full_attention'/'sliding_attention' to dicts, got {params!r}")
    # an old-style rope_scaling next to rope_parameters updates the global layers' dict
    full = {**(params.get("full_attention") or {}), **(raw.get("rope_scaling") or {})}
    local = params.get("sliding_attention") or {}
    if _scaling(local, raw, "rope_parameters.sliding_attention") is not None:
        raise InputError("config.json: rope_parameters.sliding_attention has a rope scaling "
                         "type; this loader scales only Gemma 3's global layers")
    theta = _positive({"rope_theta": full.get("rope_theta") or raw.get("rope_theta")
                       or 1_000_000.0}, "rope_theta")
    local_theta = _positive({"rope_theta (sliding_attention)": local.get("rope_theta")
                             or raw.get("rope_local_base_freq") or 10_000.0},
                            "rope_theta (sliding_attention)")
    return (theta, _scaling(full, raw, "rope_parameters.full_attention")), local_theta


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> np.ndarray:
    """RoPE inverse frequencies in float32, as transformers computes them.

    Default: ``1 / theta ** (arange(0, d, 2) / d)``. ``linear``: those divided by ``factor``.
    ``llama3`` (Llama 3.1+): wavelengths longer
    than ``original_max_position_embeddings / low_freq_factor`` are divided by ``factor``,
    shorter than ``… / high_freq_factor`` kept, and the band between interpolated smoothly —
    transcribed from ``_compute_llama3_parameters``.
    """
    exps = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv_freq = (np.float32(1.0) / (np.float32(theta) ** exps)).astype(np.float32)
    if scaling is None:
        return inv_freq
    kind = scaling["rope_type"]
    if kind == "linear":  # _compute_linear_scaling_rope_parameters: positions / factor
        try:
            return (inv_freq / np.float32(scaling["factor"])).astype(np.float32)
        except KeyError:
            raise InputError("config.json: linear rope scaling lacks 'factor'") from None
    if kind != "llama3":
        raise InputError(f"config.json: {scaling.get('key', 'rope_scaling')}.rope_type="
                         f"{kind!r} is not supported; this loader implements the default RoPE, "
                         "'linear' and 'llama3' (Llama 3.1+)")
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


def _default_layer_types(raw: dict[str, Any], n_layers: int) -> list[str]:
    """The layer types each transformers config class derives when config.json has none.

    Qwen2/Qwen3: with ``use_sliding_window`` true, layers ``i >= max_window_layers``. Gemma 2:
    every other layer local, starting with layer 0. Gemma 3: every ``sliding_window_pattern``-th
    layer (1-based) global, the rest local. Llama: none.
    """
    t = raw["model_type"]
    if t == "gemma2":
        return ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n_layers)]
    if t == "gemma3_text":
        every = raw.get("sliding_window_pattern", raw.get("_sliding_window_pattern", 6))
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise InputError(f"config.json: sliding_window_pattern={every!r} must be an int >= 1")
        return ["sliding_attention" if (i + 1) % every else "full_attention"
                for i in range(n_layers)]
    use = bool(raw.get("use_sliding_window", False)) and raw.get("sliding_window") is not None
    first = raw.get("max_window_layers", n_layers)
    return ["sliding_attention" if use and i >= first else "full_attention"
            for i in range(n_layers)]


def _layer_patterns(raw: dict[str, Any], n_layers: int) -> tuple[Pattern, ...]:
    """Per-layer attention pattern where transformers applies a sliding window.

    ``layer_types`` (transformers 5 writes it) wins, else each family's default rule
    (:func:`_default_layer_types`). Mistral is the exception: ``MistralForCausalLM`` applies
    ``sliding_window`` (when not null) to every layer and ignores ``layer_types``. A window of
    ``w`` sees ``w`` keys including the query's own (HF's mask: ``kv > q - w``), which is exactly
    :class:`Window`.
    """
    t = raw["model_type"]
    window = raw.get("sliding_window")
    if t == "mistral":
        return tuple(Causal() if window is None else Window(_int(raw, "sliding_window"))
                     for _ in range(n_layers))
    layer_types = raw.get("layer_types")
    if layer_types is None:
        layer_types = _default_layer_types(raw, n_layers)
    elif t in ("qwen2", "qwen3") and not raw.get("use_sliding_window", False):
        window = None  # Qwen2Config/Qwen3Config drop sliding_window without use_sliding_window
    if not isinstance(layer_types, list) or len(layer_types) != n_layers:
        raise InputError(f"config.json: layer_types={layer_types!r} must be a list of "
                         f"num_hidden_layers={n_layers} entries")
    pats: list[Pattern] = []
    for i, kind in enumerate(layer_types):
        if kind == "sliding_attention" and t in GEMMA_TYPES:
            pats.append(Window(_int(raw, "sliding_window")))  # Gemma needs a window there
        elif kind == "full_attention" or (kind == "sliding_attention" and window is None):
            pats.append(Causal())
        elif kind == "sliding_attention":
            pats.append(Window(_int(raw, "sliding_window")))
        else:
            raise InputError(f"config.json: layer_types[{i}]={kind!r} is not supported; "
                             "expected 'full_attention' or 'sliding_attention'")
    return tuple(pats)


def _positive(raw: dict[str, Any], key: str) -> float:
    """A finite number > 0 from config.json."""
    val = raw.get(key)
    if isinstance(val, bool) or not isinstance(val, int | float) or not 0 < val < math.inf:
        raise InputError(f"config.json: {key}={val!r} must be a finite number > 0")
    return float(val)


def _positive_or(raw: dict[str, Any], key: str, default: float) -> float:
    """:func:`_positive` where config.json has the key (null: ``default``), else ``default``."""
    return default if raw.get(key) is None else _positive(raw, key)


def _bool(raw: dict[str, Any], key: str, default: bool) -> bool:
    """A JSON true/false: the string "false" would read as true, the head silently dropped."""
    val = raw.get(key, default)
    if not isinstance(val, bool):
        raise InputError(f"config.json: {key}={val!r} must be true or false (a JSON boolean, "
                         "not a string or number)")
    return val


def _cap(raw: dict[str, Any], key: str) -> float | None:
    """A soft-cap: a finite number > 0, or None where config.json says null (no cap)."""
    return None if raw.get(key) is None else _positive(raw, key)


def _activation(raw: dict[str, Any], key: str) -> str:
    name = raw.get(key, "silu")
    if name not in _ACTIVATIONS:
        raise InputError(f"config.json: {key}={name!r} is not supported; this loader "
                         f"implements {', '.join(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


def _arch_fields(raw: dict[str, Any], head_dim: int) -> dict[str, Any]:
    """The fields where the families differ: biases, norms, activation, scales, soft-caps.

    Each line transcribes the family's transformers modeling file: Qwen2 biases q/k/v only;
    Llama biases q/k/v/o with ``attention_bias`` and the MLP with ``mlp_bias``; Qwen3 and Gemma
    bias q/k/v/o with ``attention_bias``; Mistral has no biases. Gemma 3 passes no soft-cap to
    its attention (``Gemma3Attention.forward``), so its ``attn_logit_softcapping`` is unused.
    """
    t = raw["model_type"]
    bias = bool(raw.get("attention_bias", False))
    if t in GEMMA_TYPES:
        if raw.get("use_bidirectional_attention"):
            raise InputError("config.json: use_bidirectional_attention=true (an encoder-style "
                             "Gemma) is not supported; this loader builds causal decoders")
        return dict(qkv_bias=bias, o_bias=bias, mlp_bias=False, qk_norm=t == "gemma3_text",
                    gemma_norm=True, sandwich_norms=True,
                    hidden_act=_activation(raw, "hidden_activation"),
                    embed_scale=float(_int(raw, "hidden_size")) ** 0.5,
                    attn_scale=_positive(raw, "query_pre_attn_scalar") ** -0.5,
                    attn_softcap=_cap(raw, "attn_logit_softcapping") if t == "gemma2" else None,
                    final_softcap=_cap(raw, "final_logit_softcapping"))
    return dict(qkv_bias=t == "qwen2" or (t != "mistral" and bias),
                o_bias=t in ("llama", "qwen3") and bias,
                mlp_bias=t == "llama" and bool(raw.get("mlp_bias", False)),
                qk_norm=t == "qwen3", hidden_act=_activation(raw, "hidden_act"),
                attn_scale=head_dim ** -0.5)


def _rope_fields(raw: dict[str, Any], head_dim: int) -> dict[str, Any]:
    """``inv_freq`` (and Gemma 3's ``inv_freq_local``) as float tuples."""
    if raw.get("partial_rotary_factor") not in (None, 1, 1.0):
        raise InputError("config.json: partial_rotary_factor != 1 is not supported by this "
                         "loader (every supported family rotates the whole head)")
    as_tuple = lambda f: tuple(float(x) for x in f)
    if raw["model_type"] == "gemma3_text":
        (theta, scaling), local_theta = _gemma3_rope(raw)
        return dict(inv_freq=as_tuple(rope_inv_freq(head_dim, theta, scaling)),
                    inv_freq_local=as_tuple(rope_inv_freq(head_dim, local_theta, None)))
    theta, scaling = _rope_params(raw)
    return dict(inv_freq=as_tuple(rope_inv_freq(head_dim, theta, scaling)))


def parse_config(raw: dict[str, Any], dtype: Any = None) -> HFConfig:
    """An :class:`HFConfig` from a parsed ``config.json``.

    ``dtype`` (None: the checkpoint's ``torch_dtype``/``dtype``, else float32) is what the
    parameters are stored and computed in. Keys config.json omits take the value the family's
    transformers config class would (``_DEFAULTS``), not a generic one.
    """
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        hint = (" (a multimodal Gemma 3; its text_config is model_type 'gemma3_text')"
                if model_type == "gemma3" else "")
        raise InputError(f"config.json: model_type={model_type!r} is not supported{hint}; "
                         f"supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}")
    raw = {**_DEFAULTS.get(model_type, {}), **raw}
    hidden = _int(raw, "hidden_size")
    heads = _int(raw, "num_attention_heads")
    kv_heads = _int(raw, "num_key_value_heads", heads)
    head_dim = _int(raw, "head_dim") if raw.get("head_dim") is not None else hidden // heads
    if heads % kv_heads:
        raise InputError(f"config.json: num_attention_heads={heads} is not a multiple of "
                         f"num_key_value_heads={kv_heads}")
    n_layers = _int(raw, "num_hidden_layers")
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
        head_dim=head_dim,
        rms_norm_eps=_positive_or(raw, "rms_norm_eps", 1e-6),
        tie_word_embeddings=_bool(raw, "tie_word_embeddings", False),
        patterns=_layer_patterns(raw, n_layers),
        dtype=dtype or jnp.float32,
        max_position_embeddings=(None if raw.get("max_position_embeddings") is None
                                 else _int(raw, "max_position_embeddings")),
        **_rope_fields(raw, head_dim),
        **_arch_fields(raw, head_dim),
    )
