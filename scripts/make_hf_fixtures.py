"""Regenerate tests/fixtures/hf/: tiny random checkpoints and transformers' outputs on them.

Why fixtures and not a live transformers oracle in CI: PyPI's ``torch`` for Linux x86_64 is a
CUDA build (several GB of nvidia-* wheels, and it pins a newer ``triton`` than the ``interp``
extra's), and this project's CI reaches PyPI only, where no CPU wheel for Python 3.12 exists. So
transformers runs once, here, and its logits and greedy tokens are committed next to the
checkpoints it saved; ``tests/test_hf_models.py`` compares against them with no torch installed.

Run (any Python with torch + transformers + tokenizers; on this project's machines a CPU torch
for Python 3.11 is available):

    python3.11 -m venv /tmp/hf-oracle
    /tmp/hf-oracle/bin/pip install torch==2.13.0 transformers tokenizers safetensors numpy
    /tmp/hf-oracle/bin/python scripts/make_hf_fixtures.py

Each case directory holds what ``save_pretrained(..., safe_serialization=True)`` wrote (config,
safetensors — sharded where the case says so —, generation config), a small ``tokenizer.json``
and ``expected.npz``: ``prompt{i}`` token ids, ``logits{i}`` (float32 ``[T, vocab]`` for the
prompt, one forward), ``greedy{i}`` (``generate(do_sample=False)`` new tokens) and ``margin``
(the smallest top-1 minus top-2 logit gap over the greedy steps, so a test can see that argmax
is not a near tie).
"""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "hf"
COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              bos_token_id=None, eos_token_id=None, pad_token_id=0)
PROMPTS = ([5, 17, 99, 3, 64, 12, 7], [42, 8, 8, 100, 1, 77, 31, 9, 55, 2, 120, 66, 13])
NEW_TOKENS = 12

CASES = {
    # Qwen2.5-0.5B-like: tied head, q/k/v biases, large rope_theta.
    "qwen2_tied": (Qwen2Config, Qwen2ForCausalLM,
                   dict(tie_word_embeddings=True, rope_theta=1e6, rms_norm_eps=1e-6), None),
    # Untied head, sliding window (4 keys) on layers >= 1, sharded into several files.
    "qwen2_sliding_sharded": (Qwen2Config, Qwen2ForCausalLM,
                              dict(tie_word_embeddings=False, use_sliding_window=True,
                                   sliding_window=4, max_window_layers=1, rms_norm_eps=1e-5),
                              "100KB"),
    # Llama 3.1-style rope scaling (short original context so every frequency band is hit).
    "llama3_scaled": (LlamaConfig, LlamaForCausalLM,
                      dict(tie_word_embeddings=False, rope_theta=500000.0, rms_norm_eps=1e-5,
                           rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 32}), None),
    # Llama 3.2-1B-like tied head, no scaling, sharded.
    "llama_tied_sharded": (LlamaConfig, LlamaForCausalLM,
                           dict(tie_word_embeddings=True, rope_theta=10000.0, rms_norm_eps=1e-6),
                           "150KB"),
}


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights with O(1) logit spread, so greedy argmax is never a near tie (transformers'
    std-0.02 init gives nearly flat logits); norm weights and biases are non-trivial too."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif p.ndim == 1:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif "embed" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:  # lm_head x4: a wider logit spread
                gain = 4.0 if name.startswith("lm_head") else 1.0
                p.copy_(gain * torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]))


def write_tokenizer(path: Path) -> None:
    """A 128-entry word-level tokenizer: enough to test that ``tokenizer.json`` is loaded."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{f"w{i}": i for i in range(1, 128)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))


def make_case(name: str, cfg_cls: type, model_cls: type, extra: dict, shard: str | None,
              seed: int) -> None:
    out = OUT / name
    shutil.rmtree(out, ignore_errors=True)
    torch.manual_seed(seed)
    cfg = cfg_cls(**COMMON, **extra)
    cfg._attn_implementation = "eager"
    model = model_cls(cfg).eval()
    randomize(model, seed)
    kw = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(out, safe_serialization=True, **kw)
    write_tokenizer(out / "tokenizer.json")
    arrays: dict[str, np.ndarray] = {}
    margin = math.inf
    for i, prompt in enumerate(PROMPTS):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            arrays[f"logits{i}"] = model(ids).logits[0].float().numpy()
            gen = model.generate(ids, do_sample=False, max_new_tokens=NEW_TOKENS,
                                 min_new_tokens=NEW_TOKENS, output_scores=True,
                                 return_dict_in_generate=True, pad_token_id=0)
        arrays[f"prompt{i}"] = np.asarray(prompt, np.int32)
        arrays[f"greedy{i}"] = gen.sequences[0, len(prompt):].numpy().astype(np.int32)
        for s in gen.scores:
            top = torch.topk(s[0].float(), 2).values
            margin = min(margin, float(top[0] - top[1]))
    arrays["margin"] = np.asarray(margin, np.float32)
    np.savez(out / "expected.npz", **arrays)
    (out / "oracle.json").write_text(json.dumps(
        {"transformers": transformers.__version__, "torch": torch.__version__,
         "seed": seed, "min_greedy_margin": margin}, indent=1) + "\n")
    print(f"{name}: {sorted(p.name for p in out.iterdir())} margin={margin:.4f}")


def main() -> None:
    torch.set_num_threads(2)
    only = set(sys.argv[1:])
    for seed, (name, (cfg_cls, model_cls, extra, shard)) in enumerate(CASES.items()):
        if not only or name in only:
            make_case(name, cfg_cls, model_cls, extra, shard, seed)


if __name__ == "__main__":
    main()
