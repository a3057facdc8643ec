"""Baselines the symbolic runtime is measured against: padded/masked XLA and per-shape jit.

These are the baselines' own functions; as *systems* (by name, with capabilities, estimates and
work counts, beside ``sym`` and the Tunix peers) they are bound through :mod:`jaxrl_sym.systems`
(``systems.get("padded").bind(model)``), which is what the CLI and the benchmarks use."""

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
