"""Models: a small reference decoder LM (one contract model among many) and the KV caches the
baselines keep outside any model."""

from jaxrl_sym.models.cache import ExactKVCache, PaddedKVCache
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
    "init_model",
    "preset",
    "preset_names",
    "rope",
]
