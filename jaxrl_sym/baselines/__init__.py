"""Baselines the symbolic runtime is measured against: padded/masked XLA and per-shape jit."""

from jaxrl_sym.baselines.padded import (
    LeftPadded,
    left_pad_prompts,
    padded_forward,
    padded_generate,
    padded_sequence_logprobs,
    padded_token_logprobs,
)
from jaxrl_sym.baselines.pershape import pershape_generate

__all__ = [
    "LeftPadded",
    "left_pad_prompts",
    "padded_forward",
    "padded_generate",
    "padded_sequence_logprobs",
    "padded_token_logprobs",
    "pershape_generate",
]
