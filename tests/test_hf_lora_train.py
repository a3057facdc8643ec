"""A LoRA run on a Hugging Face checkpoint: trained, checkpointed (adapters only), exported
both ways — merged into the source model, and as a PEFT adapter directory.

Oracle: PEFT's merge rule applied in numpy to the files themselves — the source checkpoint's
tensors and the exported adapter's (``W' = W + (lora_alpha / r) · B @ A`` in torch's
``[out, in]`` layout; ``tests/test_hf_lora.py`` checks those names and layouts against
transformers + peft) — must give the merged export's tensors, and every other tensor must be
the source's unchanged. A LoRA run's checkpoint must not hold the frozen base.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from jaxrl_sym.errors import InputError
from jaxrl_sym.models.hf import load_pretrained
from jaxrl_sym.rl.run.checkpoint import Checkpointer
from jaxrl_sym.rl.run.export import export_checkpoint
from jaxrl_sym.rl.run.train import train

pytestmark = pytest.mark.share_compiles

MODEL = Path(__file__).parent / "fixtures" / "text" / "chatml_qwen2"
PROBLEMS = [{"prompt": f"What is {a} + {b}?", "answer": a + b} for a, b in
            [(3, 4), (12, 5), (7, 7), (20, 1)]]


def _logits(model, prompt: list[int]) -> np.ndarray:
    toks = jnp.asarray([prompt], jnp.int32)
    pos = jnp.arange(len(prompt), dtype=jnp.int32)[None]
    return np.asarray(model(toks, pos, jnp.zeros_like(pos)))[0]


def test_lora_run_exports_merged_and_peft(tmp_path: Path) -> None:
    tasks = tmp_path / "sums.jsonl"
    tasks.write_text("".join(json.dumps(p) + "\n" for p in PROBLEMS))
    run = tmp_path / "run"
    out = train("grpo", f"jsonl:{tasks}", 2, model_dir=str(MODEL), checkpoint_dir=str(run),
                prompts_per_step=2, group_size=2, progress=False, eval_prompts=0, seed=3,
                config={"max_new_tokens": 6, "lr": 1e-2, "entropy_coef": 0.01}, beta=0.04,
                lora={"rank": 2, "alpha": 4.0})
    assert out["steps"] == 2
    # the checkpoint holds the adapters (every saved parameter has the rank as one dimension)
    # and no reference: the frozen base is the reference, and the source model gives it back
    meta = Checkpointer(run, create=False)._read_meta(2)
    shapes = [shape for shape, _ in meta["fingerprint"]["params"]]
    assert shapes and all(2 in shape for shape in shapes), shapes
    assert set(meta["digests"]) == {"params", "opt_state"}

    export_checkpoint(run, tmp_path / "merged")
    files, info = export_checkpoint(run, tmp_path / "peft", peft=True)
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(files)
    assert info["step"] == 2

    # PEFT's rule, from the files: W' = W + (lora_alpha / r) * B @ A in torch's [out, in]
    cfg = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    tensors = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    scale = cfg["lora_alpha"] / cfg["r"]
    base = load_file(MODEL / "model.safetensors")
    merged_files = load_file(tmp_path / "merged" / "model.safetensors")
    moved = 0
    for key in [k for k in tensors if k.endswith("lora_A.weight")]:
        name = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight") + ".weight"
        b = tensors[key.replace("lora_A", "lora_B")]
        want = base[name].astype(np.float64) + scale * b.astype(np.float64) @ tensors[key]
        np.testing.assert_allclose(merged_files[name], want, rtol=1e-5, atol=1e-6)
        moved += int(np.any(b != 0))
    assert moved > 0  # the run trained the adapters (the entropy bonus moves them whatever
    # the rewards: this random tiny model earns none)
    untouched = set(base) - {k.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
                             + ".weight" for k in tensors if k.endswith("lora_A.weight")}
    for name in untouched & set(merged_files):
        assert np.array_equal(merged_files[name], base[name]), name

    merged = load_pretrained(tmp_path / "merged")[0]
    src = load_pretrained(MODEL)[0]
    prompt = [1, 2, 3, 4, 5]
    assert not np.allclose(_logits(merged, prompt), _logits(src, prompt))


def test_peft_export_of_a_full_run_is_refused(tmp_path: Path) -> None:
    tasks = tmp_path / "sums.jsonl"
    tasks.write_text("".join(json.dumps(p) + "\n" for p in PROBLEMS))
    train("grpo", f"jsonl:{tasks}", 1, model_dir=str(MODEL), checkpoint_dir=str(tmp_path / "r"),
          prompts_per_step=2, group_size=2, config={"max_new_tokens": 6}, progress=False,
          eval_prompts=0, seed=3)
    with pytest.raises(InputError, match=r"--peft: .* full fine-tuning run"):
        export_checkpoint(tmp_path / "r", tmp_path / "p", peft=True)
