"""GGUF files in: logits, greedy tokens, tokenizer and chat template against transformers.

The oracle is transformers' own GGUF loader: ``scripts/make_gguf_fixture.py`` wrote tiny random
models as llama.cpp would (llama.cpp's names and metadata, Llama's q/k rows permuted, a byte-level
BPE vocabulary and SmolLM2's chat template) — ``tied/`` Llama in Q4_1 + Q8_0 + F16 + F32 like
SmolLM2-135M-Instruct.Q4_1, ``untied/`` Llama in Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/F16/F32 with an output
head, Llama 3's split regex and a BOS, ``qwen2/`` (q/k/v biases, tied) and ``qwen3/`` (q/k
norms, head_dim 128 from ``attention.key_length``) with Qwen2's split regex — loaded them with
``from_pretrained(dir, gguf_file=...)`` and stored the logits, ``generate(do_sample=False)``
tokens and tokenizer outputs. Error tests rewrite copies of the files with ``gguf.GGUFWriter``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_sym import GenerationConfig
from jaxrl_sym.cli import main
from jaxrl_sym.errors import InputError
from jaxrl_sym.models.hf import gguf as gguf_mod
from jaxrl_sym.models.hf import load_pretrained, load_tokenizer
from jaxrl_sym.models.hf.text import HFText, find_eos_ids

FIXTURE = Path(__file__).parent / "fixtures" / "hf" / "gguf_llama"
ORACLE = json.loads((FIXTURE / "oracle.json").read_text())["variants"]
VARIANTS = tuple(ORACLE)


def gguf_path(variant: str) -> Path:
    return FIXTURE / ORACLE[variant]["file"]


def expected(variant: str) -> dict[str, np.ndarray]:
    with np.load(FIXTURE / "expected.npz") as z:
        return {k.removeprefix(f"{variant}_"): v for k, v in z.items()
                if k.startswith(f"{variant}_")}


def forward(model, prompt: np.ndarray) -> np.ndarray:
    toks = jnp.asarray(prompt[None], jnp.int32)
    pos = jnp.arange(len(prompt), dtype=jnp.int32)[None]
    return np.asarray(model(toks, pos, jnp.zeros_like(pos)))[0]


@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_match_transformers(variant: str) -> None:
    """A file itself (tied) or its directory (the others) loads as transformers loads it."""
    src = gguf_path(variant) if variant == "tied" else gguf_path(variant).parent
    model, tok, gen = load_pretrained(src)
    exp, want = expected(variant), ORACLE[variant]["config"]
    cfg = model.cfg
    head_dim = want["head_dim"] or want["hidden_size"] // want["num_attention_heads"]  # Qwen2
    assert (cfg.model_type, cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.num_heads,
            cfg.num_kv_heads, cfg.head_dim, cfg.tie_word_embeddings) == (
        ORACLE[variant]["model_type"], want["vocab_size"], want["hidden_size"],
        want["num_hidden_layers"], want["num_attention_heads"], want["num_key_value_heads"],
        head_dim, want["tie_word_embeddings"])
    assert model.model.embed_tokens.embedding[...].dtype == jnp.float32  # quantized: float32
    for i in (0, 1):
        diff = float(np.max(np.abs(forward(model, exp[f"prompt{i}"]) - exp[f"logits{i}"])))
        assert diff < 1e-4, f"{variant} prompt {i}: max |logit diff| {diff}"
    assert tok is not None and tok.get_vocab_size() == ORACLE[variant]["vocab_size"]
    assert gen == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}


def test_greedy_matches_transformers() -> None:
    """Symbolic runtime == transformers' generate(do_sample=False) on both files."""
    from jaxrl_sym.runtime.engine import SymbolicLM

    for variant in VARIANTS:
        model, _, _ = load_pretrained(gguf_path(variant))
        exp = expected(variant)
        assert exp["margin"] > 0.05  # no near tie among transformers' greedy steps
        prompts = [exp["prompt0"], exp["prompt1"]]
        gen = GenerationConfig(max_new_tokens=len(exp["greedy0"]), eos_id=None)
        res = SymbolicLM(model).generate(prompts, gen)
        for i in (0, 1):
            assert res.tokens[i].tolist() == exp[f"greedy{i}"].tolist(), (variant, i)


@pytest.mark.parametrize("variant", VARIANTS)
def test_tokenizer_and_chat_template_match_transformers(variant: str) -> None:
    want = ORACLE[variant]
    text = HFText(gguf_path(variant))
    for s, ids in zip(want["texts"], want["ids"], strict=True):
        assert text.encode(s) == ids, s
    for ids, plain, special in zip(want["ids"], want["decoded"], want["decoded_special"],
                                   strict=True):
        assert text.decode(ids) == plain
        assert text.decode(ids, skip_special_tokens=False) == special
    for msgs, rendered, ids in zip(want["messages"], want["chat"], want["chat_ids"],
                                   strict=True):
        assert text.render_chat(msgs) == rendered
        assert text.encode_chat(msgs) == ids
    assert text.special_tokens == want["special"]
    assert text.vocab_size == want["vocab_size"]
    assert text.eos_ids() == (2,) == find_eos_ids(gguf_path(variant))
    assert load_tokenizer(gguf_path(variant).parent).encode(want["texts"][0]).ids == want["ids"][0]


def test_cli_generates_from_a_gguf_chat(capsys: pytest.CaptureFixture[str]) -> None:
    """``jaxrl-sym generate --model FILE.gguf --chat``: transformers' chat ids and greedy."""
    exp, want = expected("tied"), ORACLE["tied"]
    rc = main(["generate", "--model", str(gguf_path("tied")), "--chat", "--system", "padded",
               "--prompt", want["messages"][0][0]["content"],
               "--max-new-tokens", str(len(exp["greedy1"])), "--json"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    rep = json.loads(out.out.strip().splitlines()[-1])
    row = rep["rows"][0]
    assert rep["eos_ids"] == [2]
    assert row["prompt_ids"] == want["chat_ids"][0] == exp["prompt1"].tolist()
    assert row["tokens"] == exp["greedy1"].tolist() and row["stop"] == "length"
    assert row["text"] == HFText(gguf_path("tied")).decode(exp["greedy1"])


def test_qk_permutation_is_exercised(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without undoing llama.cpp's q/k row order the fixture's logits move: the oracle sees it."""
    monkeypatch.setattr(gguf_mod, "_unpermute", lambda w, n_head: w)
    model, _, _ = load_pretrained(gguf_path("untied"))
    exp = expected("untied")
    assert np.max(np.abs(forward(model, exp["prompt1"]) - exp["logits1"])) > 0.1


def rewrite(src: Path, dst: Path, *, arch: str | None = None,
            retype: tuple[str, gguf.GGMLQuantizationType] | None = None,
            strings: dict[str, str] | None = None) -> Path:
    """A copy of a GGUF file, optionally under another architecture name, with one tensor
    stored (as zero blocks) in another quantization type, or string metadata replaced."""
    r = gguf.GGUFReader(str(src))
    old = r.fields["general.architecture"].contents()
    new = arch or old
    w = gguf.GGUFWriter(str(dst), new)
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key.replace(f"{old}.", f"{new}.", 1) if key.startswith(f"{old}.")
                        else key, (strings or {}).get(key, f.contents()), f.types[0],
                        sub_type=sub)
    for t in r.tensors:
        if retype is not None and t.name == retype[0]:
            rows, cols = (int(d) for d in reversed(t.shape.tolist()))
            block, size = gguf.GGML_QUANT_SIZES[retype[1]]
            w.add_tensor(t.name, np.zeros((rows, cols // block * size), np.uint8),
                         raw_dtype=retype[1])
        else:
            plain = t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)
            w.add_tensor(t.name, np.asarray(t.data), raw_dtype=None if plain else t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def test_copy_loads_the_same(tmp_path: Path) -> None:
    """The rewriting helper the error tests use changes nothing by itself."""
    model, _, _ = load_pretrained(rewrite(gguf_path("tied"), tmp_path / "same.gguf"))
    exp = expected("tied")
    assert np.max(np.abs(forward(model, exp["prompt0"]) - exp["logits0"])) < 1e-4


def test_unsupported_quant_type_named(tmp_path: Path) -> None:
    """Q8_1 (llama.cpp's activation type) has no dequantizer in the gguf package."""
    bad = rewrite(gguf_path("tied"), tmp_path / "bad.gguf",
                  retype=("blk.0.ffn_up.weight", gguf.GGMLQuantizationType.Q8_1))
    with pytest.raises(InputError, match=r"bad\.gguf: tensor 'blk\.0\.ffn_up\.weight' has "
                                         r"quantization type Q8_1.*llama-quantize"):
        load_pretrained(bad)


def test_unsupported_architecture_named(tmp_path: Path) -> None:
    bad = rewrite(gguf_path("tied"), tmp_path / "m.gguf", arch="mamba")
    with pytest.raises(InputError, match=r"m\.gguf holds a 'mamba' model.*llama"):
        load_pretrained(bad)


def test_paths_and_malformed_files_named(tmp_path: Path) -> None:
    for name in ("a.gguf", "b.gguf"):
        shutil.copy(gguf_path("tied"), tmp_path / name)
    with pytest.raises(InputError, match=r"holds 2 GGUF files \(a\.gguf, b\.gguf\)"):
        load_pretrained(tmp_path)
    junk = tmp_path / "junk" / "x.gguf"
    junk.parent.mkdir()
    junk.write_bytes(b"not a gguf file at all")
    with pytest.raises(InputError, match=r"cannot read GGUF file .*x\.gguf"):
        load_pretrained(junk.parent)
    (junk.parent / "config.json").write_text("{}")  # a Hugging Face directory wins
    with pytest.raises(InputError, match=r"config\.json: model_type=None"):
        load_pretrained(junk.parent)


def test_a_gguf_exports_as_a_directory_that_loads_to_the_same_model(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``export --model FILE.gguf``: config.json, tokenizer and generation files rebuilt from
    the file's metadata beside the dequantized weights; loaded back as a Hugging Face directory
    (the safetensors path, not the GGUF reader) it gives the transformers oracle's logits, and
    its tokenizer and chat template encode as the GGUF's do."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    src = gguf_path("tied")
    rc = main(["export", "--model", str(src), "--out", str(tmp_path / "o"), "--json"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    files = set(json.loads(out.out.strip().splitlines()[-1])["files"])
    assert {"config.json", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= files
    exported, _, _ = load_pretrained(tmp_path / "o")
    exp = expected("tied")
    np.testing.assert_allclose(forward(exported, exp["prompt0"]), exp["logits0"],
                               rtol=2e-4, atol=2e-4)
    a, b = HFText(tmp_path / "o"), HFText(src)
    chat = [{"role": "user", "content": "What is 2 + 3?"}]
    assert a.encode("hello world 42") == b.encode("hello world 42")
    assert a.encode_chat(chat) == b.encode_chat(chat)
    assert find_eos_ids(tmp_path / "o", a.tokenizer) == find_eos_ids(src, b.tokenizer)


def test_sentencepiece_vocabulary_loads_for_ids_only(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """A tokenizer kind not built here (SentencePiece, ``llama``): the model still loads and
    generates from ids; text prompts are refused naming the kind."""
    sp = rewrite(gguf_path("tied"), tmp_path / "sp.gguf",
                 strings={"tokenizer.ggml.model": "llama"})
    model, tok, _ = load_pretrained(sp)
    assert tok is None and model.cfg.vocab_size == ORACLE["tied"]["vocab_size"]
    exp = expected("tied")
    rc = main(["generate", "--model", str(sp), "--system", "padded", "--max-new-tokens", "3",
               "--prompt-ids", ",".join(map(str, exp["prompt0"])), "--json"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    rep = json.loads(out.out.strip().splitlines()[-1])
    assert rep["rows"][0]["tokens"] == exp["greedy0"][:3].tolist() and rep["eos_ids"] == [2]
    rc = main(["generate", "--model", str(sp), "--prompt", "hi"])
    assert rc == 2 and "holds a 'llama' tokenizer" in capsys.readouterr().err



def test_train_fine_tunes_a_gguf_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``train --model FILE.gguf``: the run reads the file's tokenizer, chat template and EOS and
    steps the dequantized model (the weights move away from the file's); the run exports as a
    Hugging Face directory (config and tokenizer rebuilt from the file) holding the trained
    parameters, and ``eval --checkpoint-dir`` reads it."""
    from jaxrl_sym.rl.run.export import export_checkpoint
    from jaxrl_sym.rl.run.train import train
    from jaxrl_sym.rl.step.state import params_sha256

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the rebuilt config's home
    path = FIXTURE / "tied" / "model-Q4_1.gguf"
    leaves = jax.tree_util.tree_leaves(nnx.state(load_pretrained(path)[0]))
    # an entropy bonus: a non-zero gradient whatever the rewards (all 0 for a random model,
    # and the pretrained recipe has no bonus)
    # short prompts: the fixture states 256 positions, a word problem in its byte-level
    # vocabulary takes ~390 tokens (and positions past the limit are refused)
    task = tmp_path / "sums.jsonl"
    task.write_text('{"prompt": "What is 2 + 3?", "answer": 5}\n'
                    '{"prompt": "What is 4 + 4?", "answer": 8}\n')
    out = train("grpo", f"jsonl:{task}", steps=1, seed=0, prompts_per_step=1, group_size=2,
                model_dir=str(path), eval_prompts=0, progress=False,
                checkpoint_dir=str(tmp_path / "run"),
                config={"max_new_tokens": 4, "entropy_coef": 0.01})
    assert out["steps"] == 1 and out["params_sha256"] != params_sha256({"lm": leaves})
    files, meta = export_checkpoint(tmp_path / "run", tmp_path / "out")
    assert "config.json" in files and "tokenizer.json" in files
    trained = load_pretrained(tmp_path / "out")[0]
    assert params_sha256({"lm": jax.tree_util.tree_leaves(nnx.state(trained))}) \
        == out["params_sha256"] == meta["params_sha256"]
    rc = main(["eval", "--checkpoint-dir", str(tmp_path / "run"), "--dataset", str(task),
               "--max-new-tokens", "3", "--system", "padded"])
    assert rc == 0
