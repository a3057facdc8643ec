"""jaxrl_sym: symbolic-shape dependence graphs for JAX — generation and training on exact-size
buffers instead of MAX_LEN padding.

Pipeline (data flows one way): symbols → tracer → PDG → passes → runtime.
"""

from jaxrl_sym.errors import (
    InputError,
    NonCausalMixingError,
    PatternError,
    SymbolError,
    SymError,
    UnsupportedPrimitiveError,
)
from jaxrl_sym.generation import GenerationConfig, GenerationResult
from jaxrl_sym.ops.attention import Block, Causal, Linear, Window, attend, parse_pattern

__all__ = [
    "Block",
    "Causal",
    "GenerationConfig",
    "GenerationResult",
    "InputError",
    "Linear",
    "NonCausalMixingError",
    "PatternError",
    "SymError",
    "SymbolError",
    "UnsupportedPrimitiveError",
    "Window",
    "attend",
    "parse_pattern",
]
