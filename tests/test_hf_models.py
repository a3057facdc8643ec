"""Hugging Face checkpoints in: logits and greedy tokens against transformers' own outputs.

The oracle is transformers: ``scripts/make_hf_fixtures.py`` built tiny random Qwen2/Llama
checkpoints with transformers (tied/untied heads, a sliding window on one layer, Llama 3.1 RoPE
scaling, sharded and single-file) and stored its logits and ``generate(do_sample=False)`` tokens
next to them (``tests/fixtures/hf/``). These tests load the same files with ``load_pretrained``
and compare, with no torch installed (see that script for why). Error tests mutate copies.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxrl_sym import Causal, GenerationConfig, Window
from jaxrl_sym.errors import InputError
from jaxrl_sym.models.contract import check_model
from jaxrl_sym.models.hf import load_pretrained, parse_config
from jaxrl_sym.models.hf.config import rope_inv_freq

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
CASES = ("qwen2_tied", "qwen2_sliding_sharded", "llama3_scaled", "llama_tied_sharded")


def expected(case: str) -> dict[str, np.ndarray]:
    with np.load(FIXTURES / case / "expected.npz") as z:
        return dict(z)


def n_prompts(exp: dict[str, np.ndarray]) -> int:
    return sum(1 for k in exp if k.startswith("prompt"))


def forward(model, prompt: np.ndarray) -> np.ndarray:
    toks = jnp.asarray(prompt[None], jnp.int32)
    pos = jnp.arange(len(prompt), dtype=jnp.int32)[None]
    return np.asarray(model(toks, pos, jnp.zeros_like(pos)))[0]


@pytest.mark.parametrize("case", CASES)
def test_logits_match_transformers(case: str) -> None:
    model, tok, gen = load_pretrained(FIXTURES / case)
    exp = expected(case)
    assert check_model(model).vocab_size == 128
    for i in range(n_prompts(exp)):
        ours = forward(model, exp[f"prompt{i}"])
        diff = float(np.max(np.abs(ours - exp[f"logits{i}"])))
        assert diff < 1e-4, f"{case} prompt {i}: max |logit diff| {diff}"
    assert tok is not None and tok.encode("w5 w17").ids == [5, 17]
    assert isinstance(gen, dict) and gen.get("pad_token_id") == 0


def test_config_patterns_and_rope() -> None:
    """Sliding window only where HF applies it; llama3 scaling changes low frequencies only."""
    raw = json.loads((FIXTURES / "qwen2_sliding_sharded" / "config.json").read_text())
    assert parse_config(raw).patterns == (Causal(), Window(4))
    old = {k: v for k, v in raw.items() if k != "layer_types"}  # transformers 4.x spelling
    assert parse_config(old).patterns == (Causal(), Window(4))
    assert parse_config({**old, "use_sliding_window": False}).patterns == (Causal(), Causal())
    scaled = rope_inv_freq(64, 500000.0, {"rope_type": "llama3", "factor": 8.0,
                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 8192})
    plain = rope_inv_freq(64, 500000.0, None)
    assert scaled[0] == plain[0] and np.isclose(scaled[-1], plain[-1] / 8)


@pytest.mark.parametrize("case", CASES)
def test_bf16_load_close_to_fp32(case: str) -> None:
    """dtype="bfloat16": params stored in bf16, logits still float32 and close to fp32's."""
    model, _, _ = load_pretrained(FIXTURES / case, dtype="bfloat16")
    assert model.model.embed_tokens.embedding[...].dtype == jnp.bfloat16
    exp = expected(case)
    ours = forward(model, exp["prompt0"])
    assert ours.dtype == np.float32
    ref = exp["logits0"]
    rel = np.max(np.abs(ours - ref)) / np.max(np.abs(ref))
    assert rel < 0.1, f"{case}: bf16 relative logit error {rel}"


def _copy(case: str, tmp_path: Path) -> Path:
    dst = tmp_path / case
    shutil.copytree(FIXTURES / case, dst)
    return dst


def _rewrite(path: Path, edit) -> None:
    """Rewrite a single-file checkpoint with ``edit(dict of arrays)`` applied."""
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def test_bf16_checkpoint_loads(tmp_path: Path) -> None:
    """A checkpoint saved in bf16 (numpy has no bfloat16: safetensors hands ml_dtypes arrays)."""
    d = _copy("qwen2_tied", tmp_path)

    def to_bf16(t: dict) -> None:
        for k in t:
            t[k] = t[k].astype(ml_dtypes.bfloat16)

    _rewrite(d / "model.safetensors", to_bf16)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "dtype": "bfloat16"}))
    model, _, _ = load_pretrained(d)
    assert model.model.layers[0].self_attn.q_proj.kernel[...].dtype == jnp.bfloat16
    model32, _, _ = load_pretrained(d, dtype="float32")
    exp = expected("qwen2_tied")
    rel = np.max(np.abs(forward(model32, exp["prompt0"]) - exp["logits0"]))
    assert rel / np.max(np.abs(exp["logits0"])) < 0.05


def test_missing_tensor_named(tmp_path: Path) -> None:
    d = _copy("qwen2_tied", tmp_path)
    _rewrite(d / "model.safetensors", lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(InputError, match=r"lacks tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        load_pretrained(d)


def test_misshaped_tensor_named(tmp_path: Path) -> None:
    d = _copy("qwen2_tied", tmp_path)

    def shrink(t: dict) -> None:
        t["model.layers.0.self_attn.k_proj.bias"] = t["model.layers.0.self_attn.k_proj.bias"][:8]

    _rewrite(d / "model.safetensors", shrink)
    with pytest.raises(InputError, match=r"'model\.layers\.0\.self_attn\.k_proj\.bias'.*\[8\]"):
        load_pretrained(d)


def test_unexpected_tensor_named(tmp_path: Path) -> None:
    d = _copy("qwen2_tied", tmp_path)

    def add(t: dict) -> None:
        t["model.layers.0.self_attn.q_norm.weight"] = np.ones(16, np.float32)

    _rewrite(d / "model.safetensors", add)
    with pytest.raises(InputError, match=r"unexpected tensor 'model\.layers\.0\.self_attn\.q_norm"):
        load_pretrained(d)


def test_untied_checkpoint_without_head_is_refused(tmp_path: Path) -> None:
    d = _copy("llama3_scaled", tmp_path)
    _rewrite(d / "model.safetensors", lambda t: t.pop("lm_head.weight"))
    with pytest.raises(InputError, match=r"lacks tensor 'lm_head\.weight'"):
        load_pretrained(d)


def test_sharded_index_disagreement_named(tmp_path: Path) -> None:
    d = _copy("llama_tied_sharded", tmp_path)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = "model-00001-of-00003.safetensors"
    if index["weight_map"]["model.norm.weight"] == json.loads(
            (FIXTURES / "llama_tied_sharded" / "model.safetensors.index.json").read_text()
    )["weight_map"]["model.norm.weight"]:
        index["weight_map"]["model.norm.weight"] = "model-00002-of-00003.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(InputError, match=r"'model\.norm\.weight'"):
        load_pretrained(d)


def test_unsupported_model_type_named(tmp_path: Path) -> None:
    d = _copy("qwen2_tied", tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "model_type": "mamba"}))
    with pytest.raises(InputError, match=r"model_type='mamba'.*qwen2, llama"):
        load_pretrained(d)


def test_not_a_checkpoint_named(tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"no config\.json"):
        load_pretrained(tmp_path)
    (tmp_path / "config.json").write_text((FIXTURES / "qwen2_tied" / "config.json").read_text())
    with pytest.raises(InputError, match=r"neither model\.safetensors nor"):
        load_pretrained(tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_greedy_generation_matches_transformers(case: str) -> None:
    """Symbolic runtime == padded baseline == transformers' generate(do_sample=False)."""
    from jaxrl_sym.baselines.padded import padded_generate
    from jaxrl_sym.runtime.engine import SymbolicLM

    model, _, _ = load_pretrained(FIXTURES / case)
    exp = expected(case)
    prompts = [exp[f"prompt{i}"] for i in range(n_prompts(exp))]
    want = [exp[f"greedy{i}"] for i in range(len(prompts))]
    gen = GenerationConfig(max_new_tokens=len(want[0]), eos_id=None)
    sym = SymbolicLM(model).generate(prompts, gen)
    pad = padded_generate(model, prompts, gen)
    for i, w in enumerate(want):
        assert sym.tokens[i].tolist() == w.tolist(), f"{case} row {i}: sym vs transformers"
        assert pad.tokens[i].tolist() == w.tolist(), f"{case} row {i}: padded vs transformers"
