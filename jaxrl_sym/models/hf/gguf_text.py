"""A GGUF file's tokenizer, special tokens, EOS ids and chat template, from its metadata.

A GGUF has no ``tokenizer.json``: llama.cpp stores the vocabulary (``tokenizer.ggml.tokens``),
the BPE merges, each token's type, the special token ids and the chat template as metadata. For
a byte-level BPE (``tokenizer.ggml.model = gpt2``: GPT-2, Llama 3, Qwen2, SmolLM, …) this
module builds the ``tokenizers.Tokenizer`` transformers' GGUF loader builds
(``integrations/gguf/gguf_tokenizer_mapping.py``), so ids, decodes and chat prompts are those of
``AutoTokenizer.from_pretrained(dir, gguf_file=...)`` — checked in ``tests/test_hf_gguf.py``:

* tokens not already spelled in GPT-2's byte alphabet are re-spelled into it;
* the pre-tokenizer is the split regex llama.cpp names in ``tokenizer.ggml.pre`` where
  transformers knows it (Llama 3, Qwen2, GPT-4o families), else GPT-2's byte-level split;
* CONTROL tokens (type 3) become special tokens, USER_DEFINED ones (type 4) added tokens, so
  ``<|im_start|>`` in a chat prompt stays one token;
* BOS/EOS are added on ``encode`` only where ``tokenizer.ggml.add_bos_token`` /
  ``add_eos_token`` say so.

SentencePiece vocabularies (``tokenizer.ggml.model = llama``, Llama 2 / Mistral / Gemma) are not
built: :class:`~jaxrl_sym.models.hf.text.HFText` then says so (token-id prompts still work).
"""

from __future__ import annotations

import functools
from typing import Any

from jaxrl_sym.errors import InputError
from jaxrl_sym.models.hf.gguf import GGUFFile

CONTROL, USER_DEFINED = 3, 4
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
           r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
          r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
          r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> split regex (transformers' GGUF_PRE_TOKENIZER_SPLITS)
SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
                     "midm-2.0", "lfm2", "jina-v5-nano", "dbrx", "smaug-bpe"), _LLAMA3),
    "tekken": _TEKKEN,
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2),
    "qwen35": _QWEN35,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O),
}
_SPECIAL_IDS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id",
                "unk_token": "unknown_token_id", "pad_token": "padding_token_id"}


@functools.cache
def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte → printable character map (``bytes_to_unicode``)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
            *range(ord("\u00ae"), ord("\u00ff") + 1)]
    chars = list(keep)
    n = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(keep, (chr(c) for c in chars), strict=True))


def _tokens(g: GGUFFile) -> list[str] | None:
    tokens = g.get("tokenizer.ggml.tokens")
    return tokens if isinstance(tokens, list) and tokens else None


def _special_id(g: GGUFFile, key: str, n_tokens: int) -> int | None:
    val = g.get(f"tokenizer.ggml.{key}")
    if val is None:
        return None
    if not isinstance(val, int) or isinstance(val, bool) or not 0 <= val < n_tokens:
        raise InputError(f"GGUF file {g.path}: tokenizer.ggml.{key}={val!r} is not a token id "
                         f"in [0, {n_tokens})")
    return val


def special_tokens(g: GGUFFile) -> dict[str, str]:
    """``bos_token``/``eos_token``/``unk_token``/``pad_token`` texts, for the chat template."""
    tokens = _tokens(g) or []
    out = {}
    for name, key in _SPECIAL_IDS.items():
        i = _special_id(g, key, len(tokens))
        if i is not None:
            out[name] = tokens[i]
    return out


def token_ids(g: GGUFFile) -> dict[str, Any]:
    """The generation-config dict a GGUF implies: its bos/eos/pad ids (None where unset)."""
    n = len(_tokens(g) or [])
    ids = {"bos_token_id": "bos_token_id", "eos_token_id": "eos_token_id",
           "pad_token_id": "padding_token_id"}
    return {k: _special_id(g, key, n) for k, key in ids.items()} if n else {}


def eos_ids(g: GGUFFile) -> tuple[int, ...]:
    """The ids that end a response: ``eos_token_id``, then llama.cpp's end-of-turn and
    end-of-message ids (``eot_token_id``, ``eom_token_id``) where set; an error if none."""
    n = len(_tokens(g) or [])
    ids = [_special_id(g, k, n) for k in ("eos_token_id", "eot_token_id", "eom_token_id")]
    found = tuple(dict.fromkeys(i for i in ids if i is not None))
    if not found:
        raise InputError(f"GGUF file {g.path} names no EOS token (no tokenizer.ggml."
                         "eos_token_id); give the id explicitly (--eos-id), or ask for every "
                         "row to run to its limit (--ignore-eos)")
    return found


def chat_template(g: GGUFFile) -> str | None:
    """``tokenizer.chat_template`` (llama.cpp writes the checkpoint's default template there)."""
    tpl = g.get("tokenizer.chat_template")
    if tpl is not None and not isinstance(tpl, str):
        raise InputError(f"GGUF file {g.path}: tokenizer.chat_template is not a string")
    return tpl


def _bpe(tokens: list[str], merges: list[str]) -> Any:
    """The byte-level BPE model, every token spelled in GPT-2's byte alphabet."""
    from tokenizers import models

    spelling = byte_alphabet()
    alphabet = set(spelling.values())
    vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
             for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ")) for m in merges]
    return models.BPE(vocab=vocab, merges=pairs, dropout=None, continuing_subword_prefix="",
                      end_of_word_suffix="", fuse_unk=False)


def _pre_tokenizer(pre: Any) -> Any:
    from tokenizers import Regex, pre_tokenizers

    split = SPLITS.get(pre)
    if split is None:
        return pre_tokenizers.ByteLevel(add_prefix_space=False)
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                             use_regex=False)])


def _post_processor(g: GGUFFile, tokens: list[str]) -> Any:
    """BOS/EOS around each sequence where the file asks (``update_post_processor``)."""
    from tokenizers import processors

    n = len(tokens)
    bos, eos = _special_id(g, "bos_token_id", n), _special_id(g, "eos_token_id", n)
    add_bos = bool(g.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
    add_eos = bool(g.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    single = " ".join([*([f"{tokens[bos]}:0"] if add_bos else []), "$A:0",
                       *([f"{tokens[eos]}:0"] if add_eos else [])])
    pair = " ".join([single, *([f"{tokens[bos]}:1"] if add_bos else []), "$B:1",
                     *([f"{tokens[eos]}:1"] if add_eos else [])])
    special = [*([(tokens[bos], bos)] if add_bos else []),
               *([(tokens[eos], eos)] if add_eos else [])]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


def gguf_tokenizer(g: GGUFFile) -> Any:
    """The file's tokenizer as a ``tokenizers.Tokenizer``; None when the file has no
    vocabulary or a kind this module does not build (see :func:`tokenizer_problem`)."""
    if tokenizer_problem(g) is not None:
        return None
    from tokenizers import AddedToken, Tokenizer, decoders

    tokens = _tokens(g) or []
    merges = g.get("tokenizer.ggml.merges") or []
    types = g.get("tokenizer.ggml.token_type") or []
    try:
        tok = Tokenizer(_bpe(tokens, merges))
    except Exception as err:  # the Rust side raises its own Exception type
        raise InputError(f"GGUF file {g.path}: cannot build its BPE tokenizer: {err}") from None
    tok.pre_tokenizer = _pre_tokenizer(g.get("tokenizer.ggml.pre"))
    tok.decoder = decoders.ByteLevel()
    alphabet = set(byte_alphabet().values())
    control = [AddedToken(t, normalized=False, special=True)
               for t, kind in zip(tokens, types, strict=False)
               if kind == CONTROL and set(t) <= alphabet]  # else a llama.cpp mislabel
    if control:
        tok.add_special_tokens(control)
    vocab = tok.get_vocab()
    user = [AddedToken(t, normalized=False, special=False)
            for t, kind in zip(tokens, types, strict=False) if kind == USER_DEFINED and t in vocab]
    if user:
        tok.add_tokens(user)
    tok.post_processor = _post_processor(g, tokens)
    return tok


def tokenizer_problem(g: GGUFFile) -> str | None:
    """Why no tokenizer can be built from this file, or None when one can."""
    if _tokens(g) is None:
        return f"GGUF file {g.path} holds no vocabulary (no tokenizer.ggml.tokens)"
    kind = g.get("tokenizer.ggml.model")
    if kind != "gpt2":
        return (f"GGUF file {g.path} holds a {kind!r} tokenizer (tokenizer.ggml.model); this "
                "loader builds byte-level BPE ('gpt2') tokenizers only")
    return None
