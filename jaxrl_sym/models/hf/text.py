"""Text in and out of a Hugging Face checkpoint directory, without transformers.

:class:`HFText` is what ``transformers.AutoTokenizer`` + ``GenerationConfig`` give a generation
loop, built from the files themselves:

* **Encode/decode** with the ``tokenizers`` library from ``tokenizer.json`` — the same Rust
  tokenizer transformers' fast tokenizers wrap, so ids are identical (``encode`` applies the
  file's post-processor, e.g. a Llama BOS, as ``tokenizer(text)`` does).
* **Chat template** rendered with jinja2 the way transformers renders it (sandboxed,
  ``trim_blocks``/``lstrip_blocks``, ``loopcontrols``, ``raise_exception``, ``tojson``,
  ``strftime_now``, a pass-through ``{% generation %}`` tag, the special tokens as variables), from
  ``chat_template.jinja`` (transformers 5) or ``tokenizer_config.json["chat_template"]`` (4.x;
  a string or a list of named templates). The rendered text is encoded without adding special
  tokens again, as ``apply_chat_template(tokenize=True)`` does.
* **EOS ids** from ``generation_config.json``, else ``config.json`` (``eos_token_id``: an int
  or a list — instruct models end on several), else ``tokenizer_config.json``'s ``eos_token``.
  A directory with none of them is an error naming every file looked at: generating without an
  end token runs every row to its limit, which should be asked for, not fallen into.

All checked against transformers' own outputs in ``tests/test_hf_text.py``.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from jaxrl_sym.errors import InputError
from jaxrl_sym.models.hf.file_checks import check_readable, denied, refuse_unreadable
from jaxrl_sym.models.hf.gguf import config_dict, find_gguf, open_gguf
from jaxrl_sym.models.hf.gguf_text import eos_ids

SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                "mask_token")


def read_json(path: Path, what: str = "") -> dict[str, Any]:
    """A JSON object from ``path``; an unreadable or non-object file is an error naming it (and
    ``what`` it is), a file this user may not read with the permission it needs
    (:func:`~jaxrl_sym.models.hf.file_checks.denied`: "[Errno 13] Permission denied" said
    neither which permission nor where). Here, JAX-free, so the CLI's flag checks and the loader
    share it."""
    name = f"{what} {path}" if what else str(path)
    try:
        data = json.loads(path.read_text())
    except PermissionError as err:
        raise denied(err, what or "file", path) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise InputError(f"cannot read {name}: {err}") from None
    if not isinstance(data, dict):
        raise InputError(f"{name} does not hold a JSON object")
    return data


def _read_json(path: Path) -> dict[str, Any] | None:
    """A JSON object from ``path``, None when the file does not exist."""
    return read_json(path) if path.is_file() else None


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json spells it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _eos_field(value: Any, where: Path) -> tuple[int, ...] | None:
    """``eos_token_id`` as a tuple of ids (int or list of ints), None when unset."""
    if value is None or value == []:
        return None
    ids = value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise InputError(f"{where}: eos_token_id={value!r} must be an int >= 0 or a list of them")
    return tuple(dict.fromkeys(ids))  # order kept, duplicates dropped


def find_eos_ids(root: str | Path, tokenizer: Any = None) -> tuple[int, ...]:
    """The ids that end a response, by transformers' precedence (see the module docstring);
    for a GGUF file, its own (:func:`jaxrl_sym.models.hf.gguf_text.eos_ids`)."""
    root = Path(root)
    gguf_file = find_gguf(root)
    if gguf_file is not None:
        return eos_ids(open_gguf(gguf_file))
    looked = []
    for name in ("generation_config.json", "config.json"):
        data = _read_json(root / name)
        looked.append(f"{root / name} ({'absent' if data is None else 'no eos_token_id'})")
        ids = _eos_field((data or {}).get("eos_token_id"), root / name)
        if ids:
            return ids
    conf = _read_json(root / "tokenizer_config.json")
    text = _token_text((conf or {}).get("eos_token"))
    if text is not None and tokenizer is not None and tokenizer.token_to_id(text) is not None:
        return (int(tokenizer.token_to_id(text)),)
    why = ("absent" if conf is None else "no eos_token" if text is None
           else f"eos_token {text!r} not in tokenizer.json's vocabulary")
    looked.append(f"{root / 'tokenizer_config.json'} ({why})")
    raise InputError("no EOS token id found; looked in " + ", ".join(looked) + ". Set "
                     "eos_token_id in generation_config.json, or give the id explicitly "
                     "(--eos-id), or ask for every row to run to its limit (--ignore-eos)")


def _chat_template(root: Path, conf: dict[str, Any]) -> tuple[str | None, Path | None]:
    """(template source, the file it came from), by transformers 5's precedence."""
    jinja_file = root / "chat_template.jinja"
    if jinja_file.is_file():
        with refuse_unreadable("chat template", jinja_file):
            return jinja_file.read_text(), jinja_file
    tpl = conf.get("chat_template")
    where = root / "tokenizer_config.json"
    if tpl is None:
        extra = _read_json(root / "chat_template.json") or {}
        tpl, where = extra.get("chat_template"), root / "chat_template.json"
    if isinstance(tpl, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", …}]
        named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
        tpl = named.get("default")
    if tpl is not None and not isinstance(tpl, str):
        raise InputError(f"{where}: chat_template must be a string or a list of named "
                         "templates with a 'default'")
    return tpl, (where if tpl is not None else None)


def _jinja_env() -> Any:
    """transformers' chat-template environment (``_compile_jinja_template``)."""
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """``{% generation %}…{% endgeneration %}`` marks assistant text for masks in
        transformers; rendering it is a pass-through."""

        tags = {"generation"}  # noqa: RUF012 - jinja2's API

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_render", []), [], [], body
                                   ).set_lineno(lineno)

        def _render(self, caller: Any) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _check_messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise InputError("messages must be a non-empty list of {'role': ..., 'content': ...}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
            raise InputError(f"messages[{i}]={m!r}: each message needs a 'role' string and a "
                             "'content'")
    return messages


class HFText:
    """Tokenizer, chat template and EOS ids of one checkpoint directory (or GGUF file)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self._compiled: Any = None
        self._is_gguf = False
        gguf_file = find_gguf(self.root)
        if gguf_file is not None:
            self._init_gguf(gguf_file)
            return
        tok_file = self.root / "tokenizer.json"
        if not tok_file.is_file():
            raise InputError(f"{self.root} has no tokenizer.json; text needs the checkpoint's "
                             "tokenizer (pass token ids instead, e.g. --prompt-ids)")
        from tokenizers import Tokenizer

        check_readable(tok_file, "tokenizer")  # the Rust reader's error would call it damaged
        try:
            self.tokenizer = Tokenizer.from_file(str(tok_file))
        except Exception as err:  # the Rust side raises its own Exception type
            raise InputError(f"cannot read tokenizer {tok_file}: {err}") from None
        conf = _read_json(self.root / "tokenizer_config.json") or {}
        special = _read_json(self.root / "special_tokens_map.json") or {}
        self.special_tokens = {k: t for k in SPECIAL_KEYS
                               if (t := _token_text(conf.get(k, special.get(k)))) is not None}
        self.chat_template, self.chat_template_file = _chat_template(self.root, conf)

    def _init_gguf(self, path: Path) -> None:
        """The same fields from a GGUF file's metadata (``gguf_text``)."""
        from jaxrl_sym.models.hf import gguf_text
        g = open_gguf(path)
        self._is_gguf = True
        problem = gguf_text.tokenizer_problem(g)
        if problem is not None:
            raise InputError(f"{problem}; text needs a tokenizer (pass token ids instead, e.g. "
                             "--prompt-ids)")
        self.tokenizer = gguf_text.gguf_tokenizer(g)
        self.special_tokens = gguf_text.special_tokens(g)
        self.chat_template = gguf_text.chat_template(g)
        self.chat_template_file = path if self.chat_template is not None else None

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))

    @property
    def max_positions(self) -> int | None:
        """The checkpoint's ``max_position_embeddings`` (``config.json``, or the GGUF file's
        context length); None when it states none."""
        gguf_file = find_gguf(self.root)
        raw = (config_dict(open_gguf(gguf_file)) if gguf_file is not None
               else read_json(self.root / "config.json", "config"))
        v = raw.get("max_position_embeddings")
        return v if isinstance(v, int) and not isinstance(v, bool) and v >= 1 else None

    def eos_ids(self) -> tuple[int, ...]:
        """See :func:`find_eos_ids` (an :class:`InputError` naming the files when none)."""
        return find_eos_ids(self.root, self.tokenizer)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` as ``tokenizer(text)["input_ids"]`` gives them."""
        if not isinstance(text, str):
            raise InputError(f"text to encode must be a str, got {type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as err:  # lone surrogates: the tokenizer raises a TypeError
            raise InputError(f"text to encode holds a character that is not valid Unicode at "
                             f"index {err.start} ({text[err.start:err.end]!r}, e.g. bytes that "
                             "were not UTF-8 decoded with surrogateescape); give UTF-8 text"
                             ) from None
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Any, skip_special_tokens: bool = True) -> str:
        """Text of ``ids`` (``tokenizer.decode``; special tokens dropped by default)."""
        return self.tokenizer.decode([int(i) for i in ids],
                                     skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    **extra: Any) -> str:
        """The chat template applied to ``messages`` (``apply_chat_template(tokenize=False)``)."""
        if self.chat_template is None:
            where = ("tokenizer.chat_template in its metadata" if self._is_gguf else
                     "chat_template.jinja and chat_template in tokenizer_config.json")
            raise InputError(f"{self.root} has no chat template (looked for {where}); send "
                             "plain text")
        import jinja2

        try:
            if self._compiled is None:
                self._compiled = _jinja_env().from_string(self.chat_template)
            return self._compiled.render(messages=_check_messages(messages),
                                         add_generation_prompt=add_generation_prompt,
                                         **self.special_tokens, **extra)
        except jinja2.exceptions.TemplateError as err:
            raise InputError(f"chat template of {self.chat_template_file}: {err}") from None

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    **extra: Any) -> list[int]:
        """Ids of the rendered chat; special tokens are in the text, so none are added."""
        text = self.render_chat(messages, add_generation_prompt, **extra)
        return self.encode(text, add_special_tokens=False)
