"""Models the memory benchmarks run besides the suite's DecoderLM presets: two of the test zoo's
(no DecoderLM code) and a Hugging Face checkpoint read by the loader.

Why: the ledger (``jaxrl_sym.runtime.memory.ledger``, ``jaxrl_sym.rl.step.ledger``) must
explain what a step holds on models it was not written around (issue 27: one HF checkpoint
fixture and two non-DecoderLM zoo models), so ``python -m bench project --model NAME`` (the RL
step) and ``--workload decode --runs NAME:ATTENTION=N`` (generation) take these names. Each is
scaled up from its test-sized config so that a step's transient bytes (tens of MB) stand well
above the noise of a process's RSS.

- ``zoo-gpt2``: the zoo's GPT-2-like model (learned positions, LayerNorm with bias, fused QKV),
  full attention.
- ``zoo-gemmaish``: the zoo's Gemma-like model (sliding-window and global layers alternating,
  attention and final logit soft-caps, parallel attention + MLP): ring-window and growing
  stores in one model.
- ``hf-llama``: the transformers-made Llama fixture (``tests/fixtures/hf/llama_tied_sharded``)
  with its shape fields scaled up and seeded random weights, written once to the temporary
  folder and loaded by :func:`jaxrl_sym.models.hf.loader.load_pretrained`.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.lib.child import ROOT

# name -> the attention label a decode run names it by (the model decides its attention)
ATTENTION = {"zoo-gpt2": "full", "zoo-gemmaish": "local+global", "hf-llama": "full"}
NAMES = tuple(ATTENTION)
HF_LLAMA = {"hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
            "vocab_size": 2048, "max_position_embeddings": 8192}


def build(name: str, seed: int = 0, attention: str | None = None) -> Any:
    """The model called ``name`` (one of :data:`NAMES`), its weights seeded by ``seed``.
    ``attention``, when given, must be the label :data:`ATTENTION` names it by."""
    if name not in ATTENTION:
        raise ValueError(f"model {name!r}: choose one of {', '.join(NAMES)}")
    if attention is not None and attention != ATTENTION[name]:
        raise ValueError(f"{name} has {ATTENTION[name]} attention, not {attention!r}")
    if name == "hf-llama":
        from jaxrl_sym.models.hf.loader import load_pretrained

        return load_pretrained(_hf_llama(seed))[0]
    from flax import nnx

    if str(ROOT / "tests") not in sys.path:
        sys.path.insert(0, str(ROOT / "tests"))
    import zoo

    if name == "zoo-gpt2":
        # 16,384 learned positions: reasoning-length steps (bench/results/cpu/reasoning_measured)
        # run a 510-token prompt plus a 4,096-token response, past a 4,096-slot table
        cfg = zoo.GPTConfig(vocab=512, n_embd=128, n_head=4, n_layer=4, block_size=16384)
        return zoo.GPT2Like(cfg, rngs=nnx.Rngs(seed))
    cfg = zoo.GemmaishConfig(num_embed=1024, embed_dim=128, num_heads=4, num_kv_heads=1,
                             head_dim=64, hidden_dim=512, sliding_window_size=64)
    return zoo.GemmaishLM(cfg, rngs=nnx.Rngs(seed))


@functools.cache
def vocab_size(name: str, seed: int = 0) -> int:
    """The vocabulary of ``name`` (as the contract reads it off the model)."""
    from jaxrl_sym.models.contract import check_model

    return check_model(build(name, seed)).vocab_size


def _hf_llama(seed: int) -> Path:
    """The scaled-up Llama checkpoint's directory, written on first use (same seed, same bytes)."""
    from bench.lib.checkpoints import write_random_checkpoint

    out = Path(tempfile.gettempdir()) / "bench-models" / f"hf-llama-seed{seed}"
    if not (out / "model.safetensors").is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        part = Path(tempfile.mkdtemp(dir=out.parent))  # whole or absent, never half-written
        write_random_checkpoint(part, HF_LLAMA, seed=seed)
        with contextlib.suppress(OSError):  # another process wrote it first
            os.rename(part, out)
    return out
