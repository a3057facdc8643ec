"""Errors that name the user's thing (issue 29): bytes that are not UTF-8 in a prompt flag or a
text to encode, and prompts given as something other than a list — each either works as a list
would or is refused with a sentence naming what was given, never a library traceback."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from jaxrl_sym.errors import InputError
from jaxrl_sym.generation import GenerationConfig

TEXT = Path(__file__).parent / "fixtures" / "text" / "chatml_qwen2"


def test_a_prompt_flag_with_bytes_that_are_not_utf8_names_the_flag(
        capsys: pytest.CaptureFixture[str]) -> None:
    """argv keeps undecodable bytes as lone surrogates; the tokenizer refused them with
    ``TypeError: TextInputSequence must be str``."""
    from jaxrl_sym.cli import main

    bad = b"caf\xc3\xa9 caf\xe9".decode("utf-8", "surrogateescape")  # what Python makes of argv
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--model", str(TEXT), "--prompt", bad])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "argument --prompt: holds bytes that are not UTF-8 at character 9 (b'\\xe9')" in err


@pytest.mark.parametrize("text", ["caf\udce9", "\ud800x"])
def test_encoding_text_that_is_not_unicode_is_refused(text: str) -> None:
    from jaxrl_sym.models.hf.text import HFText

    with pytest.raises(InputError, match=r"text to encode holds a character that is not valid "
                                         r"Unicode at index \d"):
        HFText(TEXT).encode(text)


@pytest.mark.parametrize("given", ["1 2 3", b"\x01\x02", {"a": [1, 2]}, np.int32(3), 7])
def test_prompts_that_are_not_a_collection_of_prompts_are_named(given: object) -> None:
    from jaxrl_sym.generation import validate_prompts

    with pytest.raises(InputError, match=rf"prompts: got {type(given).__name__}; pass a list"):
        validate_prompts(given, 16, GenerationConfig(max_new_tokens=2))  # type: ignore[arg-type]


@pytest.mark.parametrize("which", ["decoder", "gpt2"])
def test_a_generator_of_prompts_generates_what_the_list_does(which: str) -> None:
    """Both systems read a generator once; three ragged prompts (an odd batch) give the tokens
    of the same prompts as a list, and those equal re-running the plain model greedily
    (``zoo.naive_generate``, no shared interpreter) — on the library's DecoderLM and on a
    GPT-2-like model written like public Flax code, with an unseen seed."""
    from flax import nnx
    from zoo import GPT2Like, GPTConfig, naive_generate

    from jaxrl_sym import SymbolicLM, padded_generate
    from jaxrl_sym.models.lm import init_model, preset

    model = (init_model(preset("tiny", vocab_size=32), 7) if which == "decoder"
             else GPT2Like(GPTConfig(), rngs=nnx.Rngs(7)))
    prompts = [np.array([1, 2, 3], np.int32), np.array([4, 5], np.int32),
               np.array([6, 7, 8, 9, 10], np.int32)]
    cfg = GenerationConfig(max_new_tokens=4)

    def tokens(result):
        return [np.asarray(t).tolist() for t in result.tokens]

    want = tokens(padded_generate(model, prompts, cfg))
    assert tokens(padded_generate(model, (p for p in prompts), cfg)) == want
    assert tokens(SymbolicLM(model).generate((p for p in prompts), cfg)) == want
    assert want == [naive_generate(model, p, 4)[0].tolist() for p in prompts]
