"""jaxrl_sym: symbolic-shape dependence graphs for JAX — generation and training on exact-size
buffers instead of MAX_LEN padding.

Pipeline (data flows one way): symbols → tracer → PDG → passes → runtime.

The public names below are loaded on first use (PEP 562 ``__getattr__``), not at import: every
``jaxrl_sym.*`` module imports this package first, and the CLI must be able to reject a bad flag
before paying JAX's multi-second import.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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

_HOME = {
    **dict.fromkeys(("InputError", "NonCausalMixingError", "PatternError", "SymbolError",
                     "SymError", "UnsupportedPrimitiveError"), "jaxrl_sym.errors"),
    **dict.fromkeys(("GenerationConfig", "GenerationResult"), "jaxrl_sym.generation"),
    **dict.fromkeys(("Block", "Causal", "Linear", "Window", "attend", "parse_pattern"),
                    "jaxrl_sym.ops.attention"),
}

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


def __getattr__(name: str) -> Any:
    """Import the module that defines ``name`` on first access and cache the value here."""
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'jaxrl_sym' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
