"""Regenerate tests/fixtures/text/: tokenizers, chat templates and a tiny text model, with what
transformers makes of them (token ids, rendered chat prompts, EOS ids, greedy tokens, logits).

Why a script of its own (not ``make_hf_fixtures.py``): those fixtures pin model families with a
word-level tokenizer; these pin *text*: a byte-level BPE tokenizer as Qwen/Llama use, chat
templates in both places transformers keeps them (``chat_template.jinja`` as transformers 5
saves it, ``tokenizer_config.json["chat_template"]`` as 4.x did), several EOS ids, BOS added by
a post-processor. Like the model fixtures, transformers runs once here and its outputs are
committed, so ``tests/test_hf_text.py`` and ``tests/test_hf_cli.py`` need no torch.

    .venv-oracle/bin/python scripts/make_text_fixtures.py

Cases:

* ``chatml_qwen2``: ChatML template in ``chat_template.jinja``, eos ``<|im_end|>``, and a tiny
  Qwen2 model saved by transformers whose ``generation_config.json`` lists two EOS ids (the
  second one a token the model emits greedily mid-answer, so stopping is exercised).
  ``expected.json`` holds encodings, chat renderings, decodes, and per text prompt transformers'
  ``generate(do_sample=False)`` tokens with the log-softmax of its logits at each step.
* ``llama3_bos``: BOS prepended by a ``TemplateProcessing`` post-processor, a Llama-3-style
  template in ``tokenizer_config.json`` using ``bos_token``, no ``generation_config.json``: the
  EOS id comes from ``config.json`` (an int).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "text"
CORPUS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips "
    "in May. How many clips did Natalia sell altogether in April and May?",
    "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting.",
    "Betty is saving money for a new wallet which costs $100. The answer is #### 5",
    "Tom has 7 apples and buys 15 more. He gives 3 to his sister. How many apples are left?",
    "The final answer is \\boxed{42}. Let me think step by step: 3 + 4 = 7, 7 * 6 = 42.",
    "A train travels 120 kilometres in 2 hours; its speed is 60 kilometres per hour.",
    "Question: what is 1,234 plus 5,678? Answer: 6,912.",
]
CHATML = (  # Qwen2.5's shape: default system turn, attribute access, whitespace control
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}\n"
    "{%- for message in messages %}"
    "{%- if not (message.role == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}\n"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}\n"
)
LLAMA3 = (
    "{{- bos_token }}{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + "
    "message['content'] | trim + '<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)
TEXTS = [
    "Tom has 7 apples and buys 15 more.",
    "  two  spaces\n\nnew line\ttab ",
    "Café naïve — 你好 🙂 1,234.56",
    "The answer is <|im_end|> #### 42",
    "x",
]
CHATS = [
    [{"role": "user", "content": "What is 3 + 4?"}],
    [{"role": "system", "content": "Answer with #### N."},
     {"role": "user", "content": "Tom has 7 apples. How many?"},
     {"role": "assistant", "content": "He has 7. #### 7"},
     {"role": "user", "content": "  And now?  "}],
]
PROMPTS = ["Tom has 7 apples and buys 15 more. How many?", "The answer is", "Weng earns $12"]
NEW_TOKENS = 10


def bpe(special: list[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE trained on the corpus above (offline, deterministic)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer)
    return tok


def text_expectations(tok: PreTrainedTokenizerFast) -> dict:
    """transformers' ids for TEXTS (default special tokens), chat renderings and decodes."""
    enc = [tok(t)["input_ids"] for t in TEXTS]
    chats = []
    for msgs in CHATS:
        for gen_prompt in (True, False):
            text = tok.apply_chat_template(msgs, add_generation_prompt=gen_prompt, tokenize=False)
            ids = tok.apply_chat_template(msgs, add_generation_prompt=gen_prompt, tokenize=True,
                                          return_dict=False)
            chats.append({"messages": msgs, "add_generation_prompt": gen_prompt, "text": text,
                          "ids": list(ids)})
    decodes = [{"ids": ids, "skip_special": tok.decode(ids, skip_special_tokens=True),
                "keep_special": tok.decode(ids, skip_special_tokens=False)}
               for ids in [*enc, chats[1]["ids"]]]
    return {"texts": TEXTS, "encodings": enc, "chats": chats, "decodes": decodes}


def randomize(model: torch.nn.Module, seed: int) -> None:
    """O(1) logit spread so greedy argmax is never a near tie (as make_hf_fixtures.py)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif p.ndim == 1:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]))


def greedy(model: Qwen2ForCausalLM, ids: list[int], eos: list[int] | None) -> dict:
    out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=NEW_TOKENS,
                         output_logits=True, return_dict_in_generate=True, eos_token_id=eos,
                         pad_token_id=0)
    toks = out.sequences[0, len(ids):].tolist()[:len(out.logits)]
    lps = [float(torch.log_softmax(lg[0].double(), -1)[t]) for lg, t in zip(out.logits, toks,
                                                                              strict=True)]
    margin = min(float(torch.topk(lg[0], 2).values.diff().abs()) for lg in out.logits)
    return {"tokens": toks, "logprobs": lps, "margin": margin}


def chatml_qwen2() -> None:
    out = OUT / "chatml_qwen2"
    shutil.rmtree(out, ignore_errors=True)
    raw = bpe(["<|endoftext|>", "<|im_start|>", "<|im_end|>"], 320)
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>")
    tok.chat_template = CHATML
    tok.save_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    torch.manual_seed(0)
    # max_position_embeddings 1024: word-problem prompts in the chat template reach ~290 tokens
    # with this small vocabulary, and positions past the limit are refused (it changes no weight)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=1024, tie_word_embeddings=True, rope_theta=1e6,
                      bos_token_id=None, eos_token_id=im_end, pad_token_id=0)
    cfg._attn_implementation = "eager"
    model = Qwen2ForCausalLM(cfg).eval()
    randomize(model, 7)
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    # The second EOS id: a token row 0 emits greedily mid-answer, so stopping at it is tested.
    second = greedy(model, ids[0], None)["tokens"][4]
    eos = [im_end, second]
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=0)
    model.save_pretrained(out, safe_serialization=True)
    rows = [{"prompt": p, "prompt_ids": i, **greedy(model, i, eos)}
            for p, i in zip(PROMPTS, ids, strict=True)]
    logits = {f"logits{k}": model(torch.tensor([i])).logits[0].detach().float().numpy()
              for k, i in enumerate(ids)}
    np.savez(out / "logits.npz", **logits)
    exp = {**text_expectations(tok), "eos_ids": eos, "greedy": rows,
           "max_new_tokens": NEW_TOKENS}
    write(out, exp)


def llama3_bos() -> None:
    out = OUT / "llama3_bos"
    shutil.rmtree(out, ignore_errors=True)
    special = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
               "<|end_header_id|>", "<|eot_id|>"]
    raw = bpe(special, 300)
    raw.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
        special_tokens=[("<|begin_of_text|>", raw.token_to_id("<|begin_of_text|>"))])
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<|begin_of_text|>",
                                  eos_token="<|eot_id|>")
    tok.save_pretrained(out)
    (out / "chat_template.jinja").unlink(missing_ok=True)
    conf = json.loads((out / "tokenizer_config.json").read_text())
    conf["chat_template"] = LLAMA3  # the transformers 4.x place
    (out / "tokenizer_config.json").write_text(json.dumps(conf, indent=2) + "\n")
    eot = raw.token_to_id("<|eot_id|>")
    LlamaConfig(vocab_size=raw.get_vocab_size(), hidden_size=32, intermediate_size=64,
                num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                bos_token_id=raw.token_to_id("<|begin_of_text|>"),
                eos_token_id=eot).save_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.chat_template == LLAMA3
    write(out, {**text_expectations(tok), "eos_ids": [eot]})


def write(out: Path, exp: dict) -> None:
    exp["oracle"] = {"transformers": transformers.__version__, "torch": torch.__version__}
    (out / "expected.json").write_text(json.dumps(exp, indent=1, ensure_ascii=False) + "\n")
    print(f"{out.name}: {sorted(p.name for p in out.iterdir())}")


def main() -> None:
    torch.set_num_threads(2)
    chatml_qwen2()
    llama3_bos()


if __name__ == "__main__":
    main()
