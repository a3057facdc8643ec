"""Text in/out of a checkpoint directory against transformers' own tokenizer outputs.

``scripts/make_text_fixtures.py`` ran transformers' ``AutoTokenizer`` on the committed tokenizer
files (byte-level BPE; ChatML template in ``chat_template.jinja``; Llama-3-style template in
``tokenizer_config.json`` with a BOS post-processor) and stored its ids, chat renderings, decodes
and EOS ids in ``tests/fixtures/text/*/expected.json``; :class:`HFText` must reproduce them
with no transformers installed.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from jaxrl_sym.errors import InputError
from jaxrl_sym.models.hf.text import HFText, find_eos_ids

FIXTURES = Path(__file__).parent / "fixtures" / "text"
CASES = ("chatml_qwen2", "llama3_bos")


def expected(case: str) -> dict:
    return json.loads((FIXTURES / case / "expected.json").read_text())


@pytest.mark.parametrize("case", CASES)
def test_encode_matches_transformers(case: str) -> None:
    text, exp = HFText(FIXTURES / case), expected(case)
    for s, ids in zip(exp["texts"], exp["encodings"], strict=True):
        assert text.encode(s) == ids, repr(s)
    if case == "llama3_bos":  # the post-processor's BOS, as tokenizer(text) adds it
        assert all(ids[0] == text.tokenizer.token_to_id("<|begin_of_text|>")
                   for ids in exp["encodings"])


@pytest.mark.parametrize("case", CASES)
def test_chat_template_matches_transformers(case: str) -> None:
    text, exp = HFText(FIXTURES / case), expected(case)
    assert text.chat_template_file is not None
    for chat in exp["chats"]:
        args = (chat["messages"], chat["add_generation_prompt"])
        assert text.render_chat(*args) == chat["text"]
        assert text.encode_chat(*args) == chat["ids"]


@pytest.mark.parametrize("case", CASES)
def test_decode_matches_transformers(case: str) -> None:
    text, exp = HFText(FIXTURES / case), expected(case)
    for d in exp["decodes"]:
        assert text.decode(d["ids"]) == d["skip_special"]
        assert text.decode(d["ids"], skip_special_tokens=False) == d["keep_special"]


@pytest.mark.parametrize("case", CASES)
def test_eos_ids_as_transformers_resolves_them(case: str) -> None:
    """generation_config.json's list (chatml_qwen2: two ids), else config.json's int."""
    exp = expected(case)
    assert HFText(FIXTURES / case).eos_ids() == tuple(exp["eos_ids"])
    if case == "chatml_qwen2":
        assert len(exp["eos_ids"]) == 2


def _copy(case: str, tmp_path: Path) -> Path:
    dst = tmp_path / case
    shutil.copytree(FIXTURES / case, dst)
    return dst


def _edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    for k, v in changes.items():
        if v is None:
            data.pop(k, None)
        else:
            data[k] = v
    path.write_text(json.dumps(data))


def test_eos_fallbacks_and_missing_eos_named(tmp_path: Path) -> None:
    d = _copy("chatml_qwen2", tmp_path)
    (d / "generation_config.json").unlink()
    text = HFText(d)
    assert text.eos_ids() == (text.tokenizer.token_to_id("<|im_end|>"),)  # config.json's int
    _edit_json(d / "config.json", eos_token_id=[5, 5, 7])
    assert find_eos_ids(d) == (5, 7)
    _edit_json(d / "config.json", eos_token_id=None)
    assert text.eos_ids() == (text.tokenizer.token_to_id("<|im_end|>"),)  # tokenizer_config's
    _edit_json(d / "tokenizer_config.json", eos_token=None)
    with pytest.raises(InputError) as err:
        text.eos_ids()
    msg = str(err.value)
    for name in ("generation_config.json (absent)", "config.json (no eos_token_id)",
                 "tokenizer_config.json", "--eos-id"):
        assert name in msg
    _edit_json(d / "config.json", eos_token_id="2")
    with pytest.raises(InputError, match=r"config\.json: eos_token_id='2' must be an int"):
        find_eos_ids(d)


def test_template_errors_and_missing_files_named(tmp_path: Path) -> None:
    d = _copy("chatml_qwen2", tmp_path)
    (d / "chat_template.jinja").write_text(
        "{% if messages|length > 1 %}{{ raise_exception('only one turn') }}{% endif %}"
        "{% generation %}{{ messages[0]['content'] | tojson }}{% endgeneration %}")
    text = HFText(d)
    assert text.render_chat([{"role": "user", "content": "héllo"}]) == '"héllo"'
    with pytest.raises(InputError, match=r"chat_template\.jinja: only one turn"):
        text.render_chat([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    with pytest.raises(InputError, match=r"messages\[0\]"):
        text.render_chat([{"content": "no role"}])
    (d / "chat_template.jinja").unlink()
    with pytest.raises(InputError, match=r"has no chat template"):
        HFText(d).render_chat([{"role": "user", "content": "a"}])
    (d / "tokenizer.json").unlink()
    with pytest.raises(InputError, match=r"has no tokenizer\.json"):
        HFText(d)


def test_named_template_list(tmp_path: Path) -> None:
    """tokenizer_config.json may hold [{"name", "template"}]: the 'default' one is used."""
    d = _copy("llama3_bos", tmp_path)
    conf = json.loads((d / "tokenizer_config.json").read_text())
    _edit_json(d / "tokenizer_config.json", chat_template=[
        {"name": "tool_use", "template": "tools"},
        {"name": "default", "template": conf["chat_template"]}])
    chat = expected("llama3_bos")["chats"][0]
    assert HFText(d).render_chat(chat["messages"], chat["add_generation_prompt"]) == chat["text"]
