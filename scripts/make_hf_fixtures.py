"""Regenerate tests/fixtures/hf/: tiny random checkpoints and transformers' outputs on them.

Why fixtures and not a live transformers oracle in CI: PyPI's ``torch`` for Linux x86_64 is a
CUDA build (several GB of nvidia-* wheels, and it pins a newer ``triton`` than the ``interp``
extra's), and this project's CI reaches PyPI only, where no CPU wheel for Python 3.12 exists. So
transformers runs once, here, and its logits and greedy tokens are committed next to the
checkpoints it saved; ``tests/test_hf_models.py`` compares against them with no torch installed.

Run (any Python with torch + transformers + tokenizers; ``make oracle-venv`` builds one, Python
3.11 with torch's CPU build):

    make oracle-venv
    .venv-oracle/bin/python scripts/make_hf_fixtures.py

Each case directory holds what ``save_pretrained(..., safe_serialization=True)`` wrote (config,
safetensors — sharded where the case says so —, generation config), a small ``tokenizer.json``
and ``expected.npz``: ``prompt{i}`` token ids, ``logits{i}`` (float32 ``[T, vocab]`` for the
prompt, one forward), ``greedy{i}`` (``generate(do_sample=False)`` new tokens) and ``margin``
(the smallest top-1 minus top-2 logit gap over the greedy steps, so a test can see that argmax
is not a near tie). Cases for the newer families also hold ``logprobs{i}`` (log-softmax of
transformers' raw logits at each greedy token), ``logits_bf16{i}`` where the case computes in
bf16 too, and ``oracle.json`` records ``feature_effects``: how far each family feature (a
soft-cap, the sliding window) moves transformers' own logits when switched off, so the fixture
provably exercises it.

Regenerate only some cases by naming them:
``python scripts/make_hf_fixtures.py gemma2_softcap_bf16``.
"""

from __future__ import annotations

import copy
import json
import math
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "hf"
COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              bos_token_id=None, eos_token_id=None, pad_token_id=0)
# The newer families' cases are smaller (tens of KB): width 32, explicit head_dim 16 (!= 32 / 4,
# as in Qwen3 and Gemma checkpoints), so a loader that derives head_dim from the width fails.
SMALL = {**COMMON, "hidden_size": 32, "intermediate_size": 32, "head_dim": 16}
PROMPTS = ([5, 17, 99, 3, 64, 12, 7], [42, 8, 8, 100, 1, 77, 31, 9, 55, 2, 120, 66, 13])
NEW_TOKENS = 12


@dataclass(frozen=True)
class Case:
    """One fixture: which transformers classes, which config, how it is saved.

    ``ablations`` name a family feature and switch it off on a copy of the torch model; the
    resulting logit change is recorded so a reader can see the feature is exercised.
    """

    cfg_cls: type
    model_cls: type
    extra: dict[str, Any]
    shard: str | None = None
    common: dict[str, Any] = field(default_factory=lambda: COMMON)
    bf16: bool = False  # save bf16 weights; fp32 oracle from them, plus a bf16 oracle
    ablations: dict[str, Callable[[torch.nn.Module], None]] = field(default_factory=dict)
    seed: int | None = None  # None: the case's index; set where that seed's greedy run had a
    #                          near tie (top-2 gap < 0.05), so tests compare clear argmaxes


def _all_full(model: torch.nn.Module) -> None:
    """Every layer full attention: the sliding window switched off (mask and layer types)."""
    cfg = model.config
    cfg.layer_types = ["full_attention"] * cfg.num_hidden_layers
    for layer in model.model.layers:
        layer.self_attn.sliding_window = None
        if hasattr(layer.self_attn, "layer_type"):
            layer.self_attn.layer_type = "full_attention"


def _no_window_mistral(model: torch.nn.Module) -> None:
    model.config.sliding_window = None


def _no_attn_softcap(model: torch.nn.Module) -> None:
    for layer in model.model.layers:
        layer.self_attn.attn_logit_softcapping = None


def _no_final_softcap(model: torch.nn.Module) -> None:
    model.config.final_logit_softcapping = None


def _no_qk_norm(model: torch.nn.Module) -> None:
    for layer in model.model.layers:
        layer.self_attn.q_norm = torch.nn.Identity()
        layer.self_attn.k_norm = torch.nn.Identity()


CASES = {
    # Qwen2.5-0.5B-like: tied head, q/k/v biases, large rope_theta.
    "qwen2_tied": Case(Qwen2Config, Qwen2ForCausalLM,
                       dict(tie_word_embeddings=True, rope_theta=1e6, rms_norm_eps=1e-6)),
    # Untied head, sliding window (4 keys) on layers >= 1, sharded into several files.
    "qwen2_sliding_sharded": Case(Qwen2Config, Qwen2ForCausalLM,
                                  dict(tie_word_embeddings=False, use_sliding_window=True,
                                       sliding_window=4, max_window_layers=1, rms_norm_eps=1e-5),
                                  "100KB"),
    # Llama 3.1-style rope scaling (short original context so every frequency band is hit).
    "llama3_scaled": Case(LlamaConfig, LlamaForCausalLM,
                          dict(tie_word_embeddings=False, rope_theta=500000.0, rms_norm_eps=1e-5,
                               rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                             "original_max_position_embeddings": 32})),
    # Llama 3.2-1B-like tied head, no scaling, sharded.
    "llama_tied_sharded": Case(LlamaConfig, LlamaForCausalLM,
                               dict(tie_word_embeddings=True, rope_theta=10000.0,
                                    rms_norm_eps=1e-6), "150KB"),
    # Qwen3: q/k RMSNorm over head_dim, biases on q/k/v/o (attention_bias), explicit head_dim,
    # a 4-key window on layer 1 (prompt + response up to 25 tokens), untied head.
    "qwen3_qknorm_sliding": Case(Qwen3Config, Qwen3ForCausalLM,
                                 dict(tie_word_embeddings=False, rope_theta=1e6,
                                      rms_norm_eps=1e-6, attention_bias=True,
                                      use_sliding_window=True, sliding_window=4,
                                      max_window_layers=1),
                                 common=SMALL, seed=14,
                                 ablations={"sliding_window": _all_full,
                                            "qk_norm": _no_qk_norm}),
    # Mistral: a 5-key window on every layer, explicit head_dim, sharded into several files.
    "mistral_sliding_sharded": Case(MistralConfig, MistralForCausalLM,
                                    dict(tie_word_embeddings=False, rope_theta=1e6,
                                         rms_norm_eps=1e-5, sliding_window=5),
                                    shard="40KB", common=SMALL, seed=37,
                                    ablations={"sliding_window": _no_window_mistral}),
    # Gemma 2: default alternating layers (0 sliding with 4 keys, 1 full), attention soft-cap 1.5
    # and final soft-cap 10 (small enough to bend the logits), query_pre_attn_scalar != head_dim,
    # sandwich norms, GeGLU, scaled embedding, tied head. Saved in bf16: the fp32 oracle runs the
    # same (bf16-exact) weights in fp32, a second oracle runs them in bf16.
    "gemma2_softcap_bf16": Case(Gemma2Config, Gemma2ForCausalLM,
                                dict(rope_theta=10000.0, rms_norm_eps=1e-6, sliding_window=4,
                                     query_pre_attn_scalar=8, attn_logit_softcapping=1.5,
                                     final_logit_softcapping=10.0,
                                     hidden_activation="gelu_pytorch_tanh"),
                                common=SMALL, bf16=True, seed=9,
                                ablations={"sliding_window": _all_full,
                                           "attn_softcap": _no_attn_softcap,
                                           "final_softcap": _no_final_softcap}),
    # Gemma 3 text: local (5-key window, rope base 1e4) and global (rope base 1e6, linear
    # scaling x4) layers, q/k norms, Gemma norms, final soft-cap on, untied head.
    "gemma3_local_global": Case(Gemma3TextConfig, Gemma3ForCausalLM,
                                dict(rope_theta=1e6, rope_local_base_freq=1e4,
                                     rope_scaling={"rope_type": "linear", "factor": 4.0},
                                     rms_norm_eps=1e-6, sliding_window=5,
                                     layer_types=["sliding_attention", "full_attention"],
                                     query_pre_attn_scalar=16, final_logit_softcapping=10.0,
                                     tie_word_embeddings=False),
                                common=SMALL, seed=21,
                                ablations={"sliding_window": _all_full,
                                           "qk_norm": _no_qk_norm,
                                           "final_softcap": _no_final_softcap}),
}


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights with O(1) logit spread, so greedy argmax is never a near tie (transformers'
    std-0.02 init gives nearly flat logits); norm weights and biases are non-trivial too.
    Gemma norms scale by ``1 + weight``, so theirs are drawn around 0, not 1."""
    g = torch.Generator().manual_seed(seed)
    norm_center = 0.0 if "Gemma" in type(model).__name__ else 1.0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(norm_center + 0.2 * torch.randn(p.shape, generator=g))
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


def greedy(model: torch.nn.Module, prompt: list[int], arrays: dict[str, np.ndarray], i: int,
           logprobs: bool) -> float:
    """transformers' greedy tokens (and their log-probs) for one prompt; returns the smallest
    top-1 minus top-2 logit gap over the steps."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        gen = model.generate(ids, do_sample=False, max_new_tokens=NEW_TOKENS,
                             min_new_tokens=NEW_TOKENS, output_scores=True, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
    new = gen.sequences[0, len(prompt):]
    arrays[f"greedy{i}"] = new.numpy().astype(np.int32)
    if logprobs:
        lps = [torch.log_softmax(lg[0].float(), -1)[t]
               for lg, t in zip(gen.logits, new, strict=True)]
        arrays[f"logprobs{i}"] = torch.stack(lps).numpy().astype(np.float32)
    margin = math.inf
    for s in gen.scores:
        top = torch.topk(s[0].float(), 2).values
        margin = min(margin, float(top[0] - top[1]))
    return margin


def feature_effects(model: torch.nn.Module, case: Case) -> dict[str, float]:
    """Max |logit change| on the longer prompt when each ablated feature is switched off."""
    ids = torch.tensor([PROMPTS[1]])
    with torch.no_grad():
        ref = model(ids).logits[0]
        out = {}
        for name, ablate in case.ablations.items():
            m = copy.deepcopy(model)
            ablate(m)
            out[name] = float((m(ids).logits[0] - ref).abs().max())
    return out


def make_case(name: str, case: Case, seed: int) -> None:
    out = OUT / name
    shutil.rmtree(out, ignore_errors=True)
    torch.manual_seed(seed)
    cfg = case.cfg_cls(**case.common, **case.extra)
    cfg._attn_implementation = "eager"
    model = case.model_cls(cfg).eval()
    randomize(model, seed)
    kw = {"max_shard_size": case.shard} if case.shard else {}
    if case.bf16:  # round the weights to bf16, save them so, compute the fp32 oracle from them
        with torch.no_grad():  # not model.to(bf16).float(): that would round buffers too
            for p in model.parameters():
                p.copy_(p.to(torch.bfloat16).float())
        copy.deepcopy(model).to(torch.bfloat16).save_pretrained(out, safe_serialization=True,
                                                                 **kw)
    else:
        model.save_pretrained(out, safe_serialization=True, **kw)
    write_tokenizer(out / "tokenizer.json")
    new_family = bool(case.ablations)
    arrays: dict[str, np.ndarray] = {}
    margin = math.inf
    for i, prompt in enumerate(PROMPTS):
        with torch.no_grad():
            arrays[f"logits{i}"] = model(torch.tensor([prompt])).logits[0].float().numpy()
        arrays[f"prompt{i}"] = np.asarray(prompt, np.int32)
        margin = min(margin, greedy(model, prompt, arrays, i, logprobs=new_family))
    if case.bf16:  # transformers run in bf16 as a user would load it (dtype from config.json)
        m16 = case.model_cls.from_pretrained(out, attn_implementation="eager").eval()
        assert m16.dtype == torch.bfloat16, m16.dtype
        for i, prompt in enumerate(PROMPTS):
            with torch.no_grad():
                arrays[f"logits_bf16{i}"] = m16(torch.tensor([prompt])).logits[0].float().numpy()
    arrays["margin"] = np.asarray(margin, np.float32)
    np.savez(out / "expected.npz", **arrays)
    info: dict[str, Any] = {"transformers": transformers.__version__, "torch": torch.__version__,
                            "seed": seed, "min_greedy_margin": margin}
    if new_family:
        info["feature_effects"] = feature_effects(model, case)
    (out / "oracle.json").write_text(json.dumps(info, indent=1) + "\n")
    print(f"{name}: {sorted(p.name for p in out.iterdir())} margin={margin:.4f} "
          f"{info.get('feature_effects', '')}")


def main() -> None:
    torch.set_num_threads(2)
    only = set(sys.argv[1:])
    unknown = only - set(CASES)
    if unknown:
        sys.exit(f"unknown case(s) {sorted(unknown)}; cases: {', '.join(CASES)}")
    for seed, (name, case) in enumerate(CASES.items()):
        if not only or name in only:
            make_case(name, case, seed if case.seed is None else case.seed)


if __name__ == "__main__":
    main()
