"""Models: a small decoder LM written for the tracer, and the baselines' KV caches."""

from jaxrl_sym.models.cache import (
    ExactKVCache,
    PaddedKVCache,
    init_exact_caches,
    init_padded_caches,
)
from jaxrl_sym.models.lm import (
    MLP,
    Attention,
    DecoderBlock,
    DecoderLM,
    LMConfig,
    init_model,
    preset,
    preset_names,
    rope,
)

__all__ = [
    "MLP",
    "Attention",
    "DecoderBlock",
    "DecoderLM",
    "ExactKVCache",
    "LMConfig",
    "PaddedKVCache",
    "init_exact_caches",
    "init_model",
    "init_padded_caches",
    "preset",
    "preset_names",
    "rope",
]
