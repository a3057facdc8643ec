"""PEFT adapter directories (``jaxrl_sym.weights.peft``) against transformers + peft.

Oracle: ``tests/fixtures/hf/peft_<case>/`` (``scripts/make_peft_fixture.py``, run with torch,
transformers and peft): the adapter directory peft saved for a LoRA with non-zero A and B on a
checkpoint fixture, with peft's logits (adapter active), ``merge_and_unload()``'s logits and the
base logits. transformers + peft also load our exports, in the oracle interpreter
(``tests/hf_oracle.py``; ``make test`` requires it).

Tolerance: float32 logits here reach ~58, where one float32 ulp is 3.8e-6, and peft's own
merged and unmerged forwards differ by up to 1.9e-5 on these fixtures (``merged{i}`` vs
``logits{i}``); so "equal within 1e-5" is read relative to the logits' scale:
``|ours - peft| <= 1e-6 * max|logits|`` (about 5e-5 here; observed ~2.3e-5).
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_oracle import oracle_python, run_oracle
from safetensors.numpy import load_file, save_file

from jaxrl_sym import init_model, preset
from jaxrl_sym.errors import InputError
from jaxrl_sym.models.hf import load_pretrained
from jaxrl_sym.weights.lora import merged_model, plan_lora
from jaxrl_sym.weights.lora_config import LoraConfig
from jaxrl_sym.weights.peft import export_merged, export_peft, load_peft

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
CASES = ("qwen2_tied", "llama_tied_sharded")
MODULES = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def expected(case: str) -> dict[str, np.ndarray]:
    with np.load(FIXTURES / f"peft_{case}" / "expected.npz") as z:
        return dict(z)


def forward(model, prompt: np.ndarray) -> np.ndarray:
    toks = jnp.asarray(prompt[None], jnp.int32)
    pos = jnp.arange(len(prompt), dtype=jnp.int32)[None]
    return np.asarray(model(toks, pos, jnp.zeros_like(pos)))[0]


def close(got: np.ndarray, want: np.ndarray) -> None:
    tol = 1e-6 * float(np.abs(want).max())
    assert float(np.abs(got - want).max()) <= tol, (float(np.abs(got - want).max()), tol)


@pytest.mark.parametrize("case", CASES)
def test_load_peft_gives_peft_logits(case: str) -> None:
    base, _, _ = load_pretrained(FIXTURES / case)
    cfg, plan, adapters = load_peft(FIXTURES / f"peft_{case}", base)
    assert (cfg.rank, cfg.alpha, plan.scale, len(plan.names)) == (4, 8, 2.0, 14)
    assert {n.split(".")[-2] for n in plan.names} == MODULES
    exp = expected(case)
    merged = merged_model(base, plan, adapters)
    for i in (0, 1):
        got = forward(merged, exp[f"prompt{i}"])
        assert float(np.abs(exp[f"logits{i}"] - exp[f"base{i}"]).max()) > 1.0  # it bites
        close(got, exp[f"logits{i}"])
        close(got, exp[f"merged{i}"])
    # adapters off is the base model: zero B gives its logits bit for bit
    off = [{"a": ad["a"], "b": jnp.zeros_like(ad["b"])} for ad in adapters]
    p = exp["prompt0"]
    assert np.array_equal(forward(merged_model(base, plan, off), p), forward(base, p))


@pytest.mark.parametrize("case", CASES)
def test_export_peft_reproduces_peft_files(case: str, tmp_path: Path) -> None:
    """Same tensor names, shapes and values (the very bytes of the file peft saved), and a
    config with peft's values for every field that decides the adapter."""
    src = FIXTURES / f"peft_{case}"
    base, _, _ = load_pretrained(FIXTURES / case)
    _, plan, adapters = load_peft(src, base)
    files = export_peft(plan, adapters, base, tmp_path / "out",
                        base_model_name_or_path=f"tests/fixtures/hf/{case}")
    assert files == ["adapter_config.json", "adapter_model.safetensors"]
    theirs = load_file(str(src / "adapter_model.safetensors"))
    ours = load_file(str(tmp_path / "out" / "adapter_model.safetensors"))
    assert sorted(ours) == sorted(theirs)
    for name, arr in theirs.items():
        assert ours[name].shape == arr.shape and np.array_equal(ours[name], arr), name
    assert (tmp_path / "out" / "adapter_model.safetensors").read_bytes() == (
        src / "adapter_model.safetensors").read_bytes()
    mine = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    ref = json.loads((src / "adapter_config.json").read_text())
    for key in ("peft_type", "task_type", "r", "lora_alpha", "lora_dropout", "bias",
                "fan_in_fan_out", "use_rslora", "use_dora", "modules_to_save",
                "layers_to_transform", "rank_pattern", "alpha_pattern",
                "base_model_name_or_path", "inference_mode"):
        assert mine[key] == ref[key], key
    assert set(mine) <= set(ref)  # no field peft does not know
    assert sorted(mine["target_modules"]) == sorted(MODULES)
    _, plan2, again = load_peft(tmp_path / "out", base)
    assert plan2 == plan
    assert all(np.array_equal(a["a"], b["a"]) and np.array_equal(a["b"], b["b"])
               for a, b in zip(again, adapters, strict=True))


@pytest.mark.parametrize("case", CASES)
def test_merged_export_is_merge_and_unload(case: str, tmp_path: Path) -> None:
    base, _, _ = load_pretrained(FIXTURES / case)
    _, plan, adapters = load_peft(FIXTURES / f"peft_{case}", base)
    export_merged(plan, adapters, base, tmp_path / "merged", source_dir=FIXTURES / case)
    again, _, _ = load_pretrained(tmp_path / "merged")
    exp = expected(case)
    for i in (0, 1):
        close(forward(again, exp[f"prompt{i}"]), exp[f"merged{i}"])


def test_partial_targets_export_full_module_names(tmp_path: Path) -> None:
    """Adapters on layer 0's q/v only: peft's suffix rule on 'q_proj' would take layer 1 too,
    so target_modules lists full module names; reading it back gives the same plan."""
    base, _, _ = load_pretrained(FIXTURES / "qwen2_tied")
    cfg = LoraConfig(rank=2, alpha=3.0, targets=r"model\.layers\.0\.self_attn\.(q|v)_proj\.kernel")
    plan = plan_lora(base, cfg)
    adapters = [{"a": jax.random.normal(jax.random.key(i), (n_in, 2)),
                 "b": jax.random.normal(jax.random.key(i + 9), (2, n_out))}
                for i, (n_in, n_out) in enumerate(plan.shapes)]
    export_peft(plan, adapters, base, tmp_path / "ad")
    written = json.loads((tmp_path / "ad" / "adapter_config.json").read_text())
    assert written["target_modules"] == ["model.layers.0.self_attn.q_proj",
                                         "model.layers.0.self_attn.v_proj"]
    assert written["lora_alpha"] == 3
    cfg2, plan2, again = load_peft(tmp_path / "ad", base)
    assert plan2.names == plan.names and cfg2.scale == 1.5
    p = expected("qwen2_tied")["prompt1"]
    assert np.array_equal(forward(merged_model(base, plan2, again), p),
                          forward(merged_model(base, plan, adapters), p))


def _copy_adapter(tmp_path: Path, edit_cfg=None, edit_tensors=None) -> Path:
    src = FIXTURES / "peft_qwen2_tied"
    out = tmp_path / "bad"
    out.mkdir(exist_ok=True)
    cfg = json.loads((src / "adapter_config.json").read_text())
    tensors = load_file(str(src / "adapter_model.safetensors"))
    if edit_cfg:
        edit_cfg(cfg)
    if edit_tensors:
        edit_tensors(tensors)
    (out / "adapter_config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    return out


A0 = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
REFUSALS = [
    (lambda c: c.update(use_rslora=True), None, r"use_rslora=True.*alpha/sqrt\(r\)"),
    (lambda c: c.update(use_dora=True), None, r"use_dora=True.*DoRA"),
    (lambda c: c.update(bias="all"), None, r"bias='all'"),
    (lambda c: c.update(fan_in_fan_out=True), None, r"fan_in_fan_out=True"),
    (lambda c: c.update(rank_pattern={"q_proj": 8}), None, r"rank_pattern"),
    (lambda c: c.update(layers_to_transform=[0]), None, r"layers_to_transform=\[0\]"),
    (lambda c: c.update(peft_type="IA3"), None, r"peft_type='IA3'"),
    (lambda c: c.update(init_lora_weights="pissa"), None, r"pissa.*modified base"),
    (lambda c: c.update(target_modules=["embed_tokens"]), None,
     r"select model\.embed_tokens, which is not a Linear"),
    (lambda c: c.update(target_modules=["nope"]), None, r"match no module.*self_attn\.k_proj"),
    (None, lambda t: t.pop(A0), r"lacks tensor 'base_model\.model\.model\.layers\.0\.self_attn"
                                r"\.q_proj\.lora_A\.weight'"),
    (None, lambda t: t.update({"base_model.model.model.layers.0.self_attn.q_proj"
                               ".lora_magnitude_vector": np.ones(64, np.float32)}),
     r"holds tensor '.*lora_magnitude_vector'.*DoRA"),
    (None, lambda t: t.update({A0: np.zeros((3, 64), np.float32)}),
     r"q_proj\.lora_A\.weight' .* is F32\[3, 64\]; expected .*\[4, 64\]"),
]


@pytest.mark.parametrize("edit_cfg,edit_tensors,match", REFUSALS)
def test_load_refuses_what_it_cannot_represent(tmp_path: Path, edit_cfg, edit_tensors,
                                               match: str) -> None:
    base, _, _ = load_pretrained(FIXTURES / "qwen2_tied")
    bad = _copy_adapter(tmp_path, edit_cfg, edit_tensors)
    with pytest.raises(InputError, match=match) as err:
        load_peft(bad, base)
    assert str(bad) in str(err.value)  # the file is named


def test_load_and_export_refusals(tmp_path: Path) -> None:
    base, _, _ = load_pretrained(FIXTURES / "qwen2_tied")
    with pytest.raises(InputError, match=r"has no adapter_config\.json"):
        load_peft(tmp_path, base)
    only_bin = tmp_path / "bin"
    only_bin.mkdir()
    (only_bin / "adapter_config.json").write_text(
        (FIXTURES / "peft_qwen2_tied" / "adapter_config.json").read_text())
    (only_bin / "adapter_model.bin").write_bytes(b"")
    with pytest.raises(InputError, match=r"no adapter_model\.safetensors.*safe_serialization"):
        load_peft(only_bin, base)
    _, plan, adapters = load_peft(FIXTURES / "peft_qwen2_tied", base)
    with pytest.raises(InputError, match=r"bin is not empty.*overwrite"):
        export_peft(plan, adapters, base, only_bin)
    with pytest.raises(InputError, match=r"needs a jaxrl_sym\.models\.hf CausalLM"):
        export_peft(plan, adapters, init_model(preset("tiny"), 0), tmp_path / "x")
    emb = plan_lora(base, LoraConfig(rank=2, targets=r"model\.embed_tokens\.embedding"))
    with pytest.raises(InputError, match=r"embed_tokens\.embedding is not a Linear weight"):
        export_peft(emb, [{"a": jnp.zeros((128, 2)), "b": jnp.zeros((2, 64))}], base,
                    tmp_path / "x")
    export_peft(plan, adapters, base, only_bin, overwrite=True)
    assert sorted(p.name for p in only_bin.iterdir()) == ["adapter_config.json",
                                                          "adapter_model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bin"]  # no temp dirs left


ORACLE_SCRIPT = """
import json, sys
import numpy as np, torch
from peft import LoraConfig, PeftModel
from transformers import AutoModelForCausalLM
base_dir, prompts_file = sys.argv[1], sys.argv[2]
prompts = np.load(prompts_file)
out = {}
for kind, d in zip(sys.argv[3::2], sys.argv[4::2]):
    if kind == "peft":
        LoraConfig.from_pretrained(d)  # peft accepts the config on its own
        base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        model = PeftModel.from_pretrained(base, d).eval()
    else:
        model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    rows = []
    for i in range(2):
        ids = torch.tensor(prompts[f"prompt{i}"][None].astype(np.int64))
        with torch.no_grad():
            rows.append(model(ids).logits[0].float().numpy().tolist())
    out[d] = rows
print(json.dumps(out))
"""


def test_transformers_and_peft_load_our_exports(tmp_path: Path) -> None:
    """transformers + peft load our adapter exports (the fixture's adapters, and new ones on a
    subset of modules with a non-integer scale) and the merged export, and give our logits."""
    python = oracle_python("peft")
    case = "qwen2_tied"
    base, _, _ = load_pretrained(FIXTURES / case)
    _, plan, adapters = load_peft(FIXTURES / f"peft_{case}", base)
    sub = plan_lora(base, LoraConfig(rank=3, alpha=5.0, targets=r".*layers\.1\..*(k|up)_proj"
                                                                 r"\.kernel"))
    rng = np.random.default_rng(0)
    sub_ads = [{"a": jnp.asarray(rng.normal(0, 0.2, (i, 3)), jnp.float32),
                "b": jnp.asarray(rng.normal(0, 0.2, (3, o)), jnp.float32)} for i, o in sub.shapes]
    export_peft(plan, adapters, base, tmp_path / "fixture_ad")
    export_peft(sub, sub_ads, base, tmp_path / "sub_ad")
    export_merged(plan, adapters, base, tmp_path / "merged", source_dir=FIXTURES / case)
    exp = expected(case)
    np.savez(tmp_path / "prompts.npz", prompt0=exp["prompt0"], prompt1=exp["prompt1"])
    runs = {"fixture_ad": ("peft", merged_model(base, plan, adapters)),
            "sub_ad": ("peft", merged_model(base, sub, sub_ads)),
            "merged": ("full", merged_model(base, plan, adapters))}
    args = [a for name, (kind, _) in runs.items() for a in (kind, str(tmp_path / name))]
    res = run_oracle(python, ORACLE_SCRIPT, [str(FIXTURES / case),
                                             str(tmp_path / "prompts.npz"), *args], tmp_path)
    for name, (_, ours) in runs.items():
        for i in (0, 1):
            theirs = np.asarray(res[str(tmp_path / name)][i], np.float32)
            close(forward(ours, exp[f"prompt{i}"]), theirs)
    for i in (0, 1):  # our merged weights are peft's merge_and_unload (bit-equal when observed)
        close(np.asarray(res[str(tmp_path / "merged")][i], np.float32), exp[f"merged{i}"])
