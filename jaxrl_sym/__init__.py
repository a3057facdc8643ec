"""jaxrl_sym: symbolic-shape dependence graphs for JAX — generation and training on exact-size
buffers instead of MAX_LEN padding.

Pipeline (data flows one way): symbols → tracer → PDG → passes → runtime, with systems, RL and
the CLI on top.

This module is the public face: ``from jaxrl_sym import SymbolicLM, padded_generate, RLTrainer,
load_pretrained, attend, GenerationConfig, ...`` is all a user (and the README) imports. The
names are loaded on first use (PEP 562 ``__getattr__``), not at import: every ``jaxrl_sym.*``
module imports this package first, and the CLI must be able to reject a bad flag before paying
JAX's multi-second import. ``_HOME`` is the one table of where each public name lives.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jaxrl_sym import systems
    from jaxrl_sym.baselines.padded import padded_generate
    from jaxrl_sym.errors import (
        InputError,
        NonCausalMixingError,
        PatternError,
        SymbolError,
        SymError,
        UnsupportedPrimitiveError,
    )
    from jaxrl_sym.generation import GenerationConfig, GenerationResult
    from jaxrl_sym.models.contract import check_model
    from jaxrl_sym.models.hf import export_pretrained, load_pretrained
    from jaxrl_sym.models.lm import DecoderLM, LMConfig, init_model, preset
    from jaxrl_sym.ops.attention import (
        Block,
        Causal,
        Linear,
        Pattern,
        Window,
        attend,
        parse_pattern,
    )
    from jaxrl_sym.rl import (
        AlgorithmConfig,
        ExecutionConfig,
        OptimizerConfig,
        PartialConfig,
        RLConfig,
        RLTrainer,
        SamplingConfig,
        get_task,
    )
    from jaxrl_sym.rl.run.train import train
    from jaxrl_sym.runtime.engine import SymbolicLM
    from jaxrl_sym.runtime.options import EngineOptions, Speculation
    from jaxrl_sym.runtime.speculative.lm import SpeculativeLM

_HOME = {
    **dict.fromkeys(("InputError", "NonCausalMixingError", "PatternError", "SymbolError",
                     "SymError", "UnsupportedPrimitiveError"), "jaxrl_sym.errors"),
    **dict.fromkeys(("GenerationConfig", "GenerationResult"), "jaxrl_sym.generation"),
    **dict.fromkeys(("Block", "Causal", "Linear", "Pattern", "Window", "attend",
                     "parse_pattern"), "jaxrl_sym.ops.attention"),
    "check_model": "jaxrl_sym.models.contract",
    **dict.fromkeys(("DecoderLM", "LMConfig", "init_model", "preset"), "jaxrl_sym.models.lm"),
    **dict.fromkeys(("export_pretrained", "load_pretrained"), "jaxrl_sym.models.hf"),
    "SymbolicLM": "jaxrl_sym.runtime.engine",
    **dict.fromkeys(("EngineOptions", "Speculation"), "jaxrl_sym.runtime.options"),
    "SpeculativeLM": "jaxrl_sym.runtime.speculative.lm",
    "padded_generate": "jaxrl_sym.baselines.padded",
    **dict.fromkeys(("AlgorithmConfig", "ExecutionConfig", "OptimizerConfig", "PartialConfig",
                     "RLConfig", "RLTrainer", "SamplingConfig", "get_task"), "jaxrl_sym.rl"),
    "train": "jaxrl_sym.rl.run.train",
}
# Public subpackages, also loaded on first use: ``jaxrl_sym.systems`` is the registry of
# generation systems (JAX-free; ``systems.get("padded").bind(model, options)``).
_SUBMODULES = ("systems",)

__all__ = [
    "AlgorithmConfig",
    "Block",
    "Causal",
    "DecoderLM",
    "EngineOptions",
    "ExecutionConfig",
    "GenerationConfig",
    "GenerationResult",
    "InputError",
    "LMConfig",
    "Linear",
    "NonCausalMixingError",
    "OptimizerConfig",
    "PartialConfig",
    "Pattern",
    "PatternError",
    "RLConfig",
    "RLTrainer",
    "SamplingConfig",
    "Speculation",
    "SpeculativeLM",
    "SymError",
    "SymbolError",
    "SymbolicLM",
    "UnsupportedPrimitiveError",
    "Window",
    "attend",
    "check_model",
    "export_pretrained",
    "get_task",
    "init_model",
    "load_pretrained",
    "padded_generate",
    "parse_pattern",
    "preset",
    "systems",
    "train",
]


def __getattr__(name: str) -> Any:
    """Import the module that defines ``name`` (or the subpackage ``name``) on first access and
    cache the value here."""
    if name in _SUBMODULES:
        value = importlib.import_module(f"jaxrl_sym.{name}")
    elif name in _HOME:
        value = getattr(importlib.import_module(_HOME[name]), name)
    else:
        raise AttributeError(f"module 'jaxrl_sym' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
