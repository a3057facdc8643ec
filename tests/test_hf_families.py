"""Qwen3, Mistral, Gemma 2 and Gemma 3 (text) checkpoints against transformers' own outputs.

Same oracle as ``tests/test_hf_models.py`` (whose helpers this file uses): tiny random
checkpoints that ``scripts/make_hf_fixtures.py`` built with transformers, stored with its logits,
greedy tokens and their log-probs. Each fixture exercises its family's features where they
change the result — ``oracle.json``'s ``feature_effects`` records by how much transformers' own
logits move when the feature is switched off, and :func:`test_fixtures_exercise_features`
checks those numbers are large, so a loader that ignored a soft-cap, a window or the q/k norms
would fail the logit comparison by far more than its tolerance.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest
from test_hf_models import FIXTURES, _copy, _rewrite, expected, forward, n_prompts

from jaxrl_sym import Causal, GenerationConfig, Window
from jaxrl_sym.errors import InputError
from jaxrl_sym.models.contract import check_model
from jaxrl_sym.models.hf import load_pretrained, parse_config
from jaxrl_sym.models.hf.config import rope_inv_freq

FAMILY_CASES = ("qwen3_qknorm_sliding", "mistral_sliding_sharded", "gemma2_softcap_bf16",
                "gemma3_local_global")
# Observed max |logit diff| in fp32 is <= 7e-6 for every case; 2e-5 leaves room for another
# CPU's summation order while staying far below any feature's effect (>= 0.8, oracle.json).
LOGIT_TOL = 2e-5
LOGPROB_TOL = 1e-4  # observed <= 3e-6 (sym and padded, every case)


def _config(case: str) -> dict[str, Any]:
    return json.loads((FIXTURES / case / "config.json").read_text())


@pytest.mark.parametrize("case", FAMILY_CASES)
def test_logits_match_transformers(case: str) -> None:
    """fp32 logits on both prompts; the gemma2 case's weights are bf16 on disk, its oracle ran
    them in fp32, so loading with dtype=float32 must match as tightly as the others."""
    model, tok, _ = load_pretrained(FIXTURES / case, dtype="float32")
    assert check_model(model).vocab_size == 128
    exp = expected(case)
    for i in range(n_prompts(exp)):
        diff = float(np.max(np.abs(forward(model, exp[f"prompt{i}"]) - exp[f"logits{i}"])))
        assert diff < LOGIT_TOL, f"{case} prompt {i}: max |logit diff| {diff}"
    assert tok is not None and tok.encode("w5 w17").ids == [5, 17]


@pytest.mark.parametrize("case", FAMILY_CASES)
def test_fixtures_exercise_features(case: str) -> None:
    """Every feature the case is built for moves transformers' logits by >= 0.5 when off, and
    the greedy runs have no near tie (top-2 gap >= 0.05), so token equality below is a real
    check of those features, not luck."""
    oracle = json.loads((FIXTURES / case / "oracle.json").read_text())
    effects = oracle["feature_effects"]
    assert effects and min(effects.values()) >= 0.5, effects
    assert float(expected(case)["margin"]) >= 0.05


def test_gemma2_bf16_matches_transformers_bf16() -> None:
    """Loaded as saved (bf16): as close to transformers' bf16 logits as bf16 allows (the
    logits are ~10, one bf16 step there is 0.0625), and no farther from the fp32 oracle than
    transformers' own bf16 run is."""
    case = "gemma2_softcap_bf16"
    model, _, _ = load_pretrained(FIXTURES / case)
    assert model.model.embed_tokens.embedding[...].dtype == jnp.bfloat16
    exp = expected(case)
    for i in range(n_prompts(exp)):
        ours = forward(model, exp[f"prompt{i}"])
        hf16, hf32 = exp[f"logits_bf16{i}"], exp[f"logits{i}"]
        assert np.max(np.abs(ours - hf16)) < 0.15
        assert np.max(np.abs(ours - hf32)) <= 1.25 * np.max(np.abs(hf16 - hf32))
        assert (ours.argmax(-1) == hf16.argmax(-1)).all()


@pytest.mark.slow
@pytest.mark.parametrize("case", FAMILY_CASES)
def test_greedy_tokens_and_logprobs_match_transformers(case: str) -> None:
    """SymbolicLM and padded_generate both reproduce transformers' generate(do_sample=False):
    same tokens, per-token log-probs within 1e-4. The longer row reaches 25 tokens, past every
    case's window (4 or 5 keys), so the runtimes' window stores are exercised while decoding."""
    from jaxrl_sym.baselines.padded import padded_generate
    from jaxrl_sym.runtime.engine import SymbolicLM
    from jaxrl_sym.runtime.options import EngineOptions

    model, _, _ = load_pretrained(FIXTURES / case, dtype="float32")
    exp = expected(case)
    prompts = [exp[f"prompt{i}"] for i in range(n_prompts(exp))]
    gen = GenerationConfig(max_new_tokens=len(exp["greedy0"]), eos_id=None)
    results = {"sym": SymbolicLM(model, EngineOptions(compact_min_rows=1)).generate(prompts, gen),
               "padded": padded_generate(model, prompts, gen)}
    for name, res in results.items():
        for i in range(len(prompts)):
            assert res.tokens[i].tolist() == exp[f"greedy{i}"].tolist(), f"{case} {name} row {i}"
            lp_diff = float(np.max(np.abs(res.logprobs[i] - exp[f"logprobs{i}"])))
            assert lp_diff < LOGPROB_TOL, f"{case} {name} row {i}: |Δ log-prob| {lp_diff}"


# --------------------------------------------------------------------------- config rules


def test_family_layer_patterns() -> None:
    """Windows where transformers puts them, from layer_types or each family's default."""
    q3 = _config("qwen3_qknorm_sliding")
    assert parse_config(q3).patterns == (Causal(), Window(4))
    assert parse_config({**q3, "use_sliding_window": False}).patterns == (Causal(), Causal())
    mis = _config("mistral_sliding_sharded")
    assert parse_config(mis).patterns == (Window(5), Window(5))
    assert parse_config({**mis, "sliding_window": None}).patterns == (Causal(), Causal())
    g2 = {k: v for k, v in _config("gemma2_softcap_bf16").items() if k != "layer_types"}
    assert parse_config({**g2, "num_hidden_layers": 3}).patterns == (Window(4), Causal(),
                                                                    Window(4))
    g3 = {k: v for k, v in _config("gemma3_local_global").items() if k != "layer_types"}
    pats = parse_config({**g3, "num_hidden_layers": 7, "sliding_window_pattern": 3}).patterns
    assert pats == (Window(5), Window(5), Causal()) * 2 + (Window(5),)
    assert parse_config({**g3, "num_hidden_layers": 6}).patterns == (Window(5),) * 5 + (Causal(),)


def test_family_fields() -> None:
    """The per-family switches that the fixtures test end to end, read from their configs."""
    q3 = parse_config(_config("qwen3_qknorm_sliding"))
    assert (q3.qk_norm, q3.qkv_bias, q3.o_bias, q3.head_dim) == (True, True, True, 16)
    assert not q3.gemma_norm and q3.attn_scale == 16 ** -0.5
    g2 = parse_config(_config("gemma2_softcap_bf16"))
    assert (g2.attn_softcap, g2.final_softcap, g2.attn_scale) == (1.5, 10.0, 8 ** -0.5)
    assert g2.gemma_norm and g2.sandwich_norms and not g2.qk_norm
    assert g2.hidden_act == "gelu_tanh" and g2.embed_scale == math.sqrt(32)
    g3 = parse_config(_config("gemma3_local_global"))
    assert g3.qk_norm and g3.gemma_norm and g3.sandwich_norms and not g3.tie_word_embeddings
    assert (g3.attn_softcap, g3.final_softcap, g3.attn_scale) == (None, 10.0, 16 ** -0.5)
    assert g3.inv_freq_local is not None and g3.inv_freq_local != g3.inv_freq
    mis = parse_config(_config("mistral_sliding_sharded"))
    assert not (mis.qkv_bias or mis.o_bias or mis.qk_norm) and mis.head_dim == 16


def test_gemma3_rope_both_spellings() -> None:
    """transformers 5's per-layer-type rope_parameters and the older rope_theta /
    rope_local_base_freq / rope_scaling spelling give the same frequencies: global layers
    at base 1e6 divided by the linear factor 4, local layers at base 1e4 unscaled."""
    new = _config("gemma3_local_global")
    old = {k: v for k, v in new.items() if k != "rope_parameters"}
    old.update(rope_theta=1e6, rope_local_base_freq=1e4,
               rope_scaling={"rope_type": "linear", "factor": 4.0})
    a, b = parse_config(new), parse_config(old)
    assert a.inv_freq == b.inv_freq and a.inv_freq_local == b.inv_freq_local
    np.testing.assert_array_equal(np.float32(a.inv_freq), rope_inv_freq(16, 1e6, None) / 4)
    np.testing.assert_array_equal(np.float32(a.inv_freq_local), rope_inv_freq(16, 1e4, None))
    # as in Gemma3TextConfig: an old rope_scaling beside rope_parameters updates the global dict
    c = parse_config({**new, "rope_scaling": {"rope_type": "linear", "factor": 2.0}})
    np.testing.assert_array_equal(np.float32(c.inv_freq), rope_inv_freq(16, 1e6, None) / 2)
    assert c.inv_freq_local == a.inv_freq_local


def test_defaults_follow_transformers_config_classes() -> None:
    """Keys a config.json omits take the family's transformers default, not a generic one."""
    g2 = _config("gemma2_softcap_bf16")
    bare = {k: v for k, v in g2.items() if k not in (
        "head_dim", "query_pre_attn_scalar", "attn_logit_softcapping",
        "final_logit_softcapping", "tie_word_embeddings")}
    cfg = parse_config(bare)
    assert (cfg.head_dim, cfg.attn_scale) == (256, 256 ** -0.5)
    assert (cfg.attn_softcap, cfg.final_softcap, cfg.tie_word_embeddings) == (50.0, 30.0, True)
    mis = {k: v for k, v in _config("mistral_sliding_sharded").items() if k != "sliding_window"}
    assert parse_config(mis).patterns == (Window(4096), Window(4096))


# --------------------------------------------------------------------------- clear errors


@pytest.mark.parametrize(("case", "edit", "match"), [
    ("qwen3_qknorm_sliding",
     {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}},
     r"config\.json: rope_parameters\.rope_type='yarn' is not supported"),
    ("mistral_sliding_sharded", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
     r"config\.json: rope_scaling\.rope_type='dynamic' is not supported"),
    ("gemma2_softcap_bf16", {"use_bidirectional_attention": True},
     r"config\.json: use_bidirectional_attention=true"),
    ("gemma2_softcap_bf16", {"hidden_activation": "relu"},
     r"config\.json: hidden_activation='relu' is not supported"),
    ("gemma3_local_global", {"sliding_window": None},
     r"config\.json: sliding_window=None must be an int"),
    ("gemma3_local_global",
     {"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 8.0}}},
     r"config\.json: rope_parameters\.full_attention\.rope_type='yarn'"),
    ("gemma3_local_global", {"model_type": "gemma3"},
     r"model_type='gemma3' is not supported \(a multimodal Gemma 3; its text_config"),
    # values outside their domain, and strings where JSON has booleans (issue 29): each named
    ("gemma3_local_global", {"rope_parameters": {
        "full_attention": {"factor": 4.0, "rope_theta": 1e6, "rope_type": "linear"},
        "sliding_attention": {"rope_theta": -5, "rope_type": "default"}}},
     r"config\.json: rope_theta \(sliding_attention\)=-5 must be a finite number > 0"),
    ("qwen3_qknorm_sliding", {"rms_norm_eps": 0},
     r"config\.json: rms_norm_eps=0 must be a finite number > 0"),
    ("qwen3_qknorm_sliding", {"rms_norm_eps": "1e-6"},
     r"config\.json: rms_norm_eps='1e-6' must be a finite number > 0"),
    ("qwen3_qknorm_sliding", {"rope_theta": -1.0, "rope_parameters": None},
     r"config\.json: rope_theta=-1\.0 must be a finite number > 0"),
    ("qwen3_qknorm_sliding", {"tie_word_embeddings": "false"},
     r"config\.json: tie_word_embeddings='false' must be true or false \(a JSON boolean"),
])
def test_unsupported_option_named(tmp_path: Path, case: str, edit: dict, match: str) -> None:
    """An option this loader does not implement is refused naming config.json and the key,
    before any weight is read — never a model that silently computes other logits."""
    d = _copy(case, tmp_path)
    (d / "config.json").write_text(json.dumps({**_config(case), **edit}))
    with pytest.raises(InputError, match=match):
        load_pretrained(d)


def test_missing_qk_norm_tensor_named(tmp_path: Path) -> None:
    """Names map by rule: a Gemma 3 checkpoint without a layer's k_norm is refused by name."""
    d = _copy("gemma3_local_global", tmp_path)
    _rewrite(d / "model.safetensors", lambda t: t.pop("model.layers.1.self_attn.k_norm.weight"))
    with pytest.raises(InputError, match=r"lacks tensor 'model\.layers\.1\.self_attn\.k_norm"):
        load_pretrained(d)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_weight_is_refused_naming_tensor_and_file(tmp_path: Path, bad: float) -> None:
    """A damaged checkpoint (issue 29): one NaN or infinite weight is refused as it loads,
    naming the file and the tensor — in a bf16 checkpoint as well as an fp32 one."""
    name = "model.layers.0.mlp.down_proj.weight"
    for case in ("qwen3_qknorm_sliding", "gemma2_softcap_bf16"):
        d = _copy(case, tmp_path)

        def poison(t: dict) -> None:
            w = np.array(t[name])
            w.reshape(-1)[7] = bad
            t[name] = w

        _rewrite(d / "model.safetensors", poison)
        with pytest.raises(InputError, match=rf"model\.safetensors: tensor '{name}' holds 1 NaN"):
            load_pretrained(d)


@pytest.mark.parametrize("how", ["truncated", "empty", "garbage header"])
def test_damaged_safetensors_file_is_named(tmp_path: Path, how: str) -> None:
    """safetensors' own SafetensorError derives from Exception only and escaped the loader as a
    traceback (issue 29); now each damage is an InputError naming the file."""
    d = _copy("qwen3_qknorm_sliding", tmp_path)
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes({"truncated": data[: len(data) // 2], "empty": b"",
                   "garbage header": data[:8] + b"\xff" * 12 + data[20:]}[how])
    with pytest.raises(InputError, match=rf"cannot read safetensors file .*{f.name}: .*damaged"):
        load_pretrained(d)
