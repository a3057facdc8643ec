"""Hugging Face checkpoints as contract models: Qwen2/Qwen2.5, Qwen3, Llama 3.x, Mistral,
Gemma 2 and Gemma 3 (text, ``Gemma3ForCausalLM``).

``load_pretrained(dir)`` reads ``config.json`` + safetensors (single or sharded) lazily into a
Flax NNX :class:`CausalLM` that follows the model contract, so every system of the library
(symbolic runtime, padded baseline, RL trainer) runs it unchanged. Logits are checked against
transformers in ``tests/test_hf_models.py`` and ``tests/test_hf_families.py``.
"""

from jaxrl_sym.models.hf.config import SUPPORTED_MODEL_TYPES, HFConfig, parse_config
from jaxrl_sym.models.hf.export import export_pretrained
from jaxrl_sym.models.hf.loader import load_pretrained, load_tokenizer
from jaxrl_sym.models.hf.modeling import CausalLM, build_model
from jaxrl_sym.models.hf.text import HFText, find_eos_ids

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "CausalLM",
    "HFConfig",
    "HFText",
    "build_model",
    "export_pretrained",
    "find_eos_ids",
    "load_pretrained",
    "load_tokenizer",
    "parse_config",
]
