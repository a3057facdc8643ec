"""Regenerate tests/fixtures/hf/peft_<case>/: PEFT LoRA adapters and transformers+peft logits.

The oracle for :mod:`jaxrl_sym.weights.peft` (``tests/test_hf_lora.py``). For each case, the
transformers checkpoint fixture ``tests/fixtures/hf/<case>/`` is loaded with transformers, wrapped
in a peft LoRA (r=4, alpha=8, q/k/v/o/gate/up/down), given NON-zero random A and B (peft's
default init has B = 0, which would make the adapter a no-op and the test blind to it), and
saved with ``save_pretrained`` — so ``adapter_config.json`` and ``adapter_model.safetensors`` are
exactly what peft writes. ``expected.npz`` holds, for the base fixture's prompts:

* ``prompt{i}``: the token ids;
* ``logits{i}``: float32 ``[T, vocab]`` logits of the peft model (adapter active, unmerged:
  ``W x + scale * B (A x)``);
* ``merged{i}``: the logits of ``merge_and_unload()`` (the adapter folded into W);
* ``base{i}``: the base model's logits, so a test can see how far the adapter moves them.

``oracle.json`` records the versions and ``adapter_effect`` (max |logits - base|).

Run (torch + transformers + peft, no network needed once installed):

    make oracle-venv
    .venv-oracle/bin/python scripts/make_peft_fixture.py
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import peft
import torch
import transformers
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "hf"
MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# case → target_modules as written in the LoraConfig: a list of names (suffix match) and, for
# the second case, peft's regex-string form (fullmatch over module names).
CASES = {
    "qwen2_tied": MODULES,
    "llama_tied_sharded": r".*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)",
}
RANK, ALPHA = 4, 8


def randomize_adapters(model: torch.nn.Module, seed: int) -> None:
    """Non-zero A and B with a delta comparable to the base weights (so logits move clearly
    but stay in the range where float32 comparisons at 1e-5 make sense)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "lora_A" in name or "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def logits(model: torch.nn.Module, prompt: np.ndarray) -> np.ndarray:
    ids = torch.tensor(prompt[None].astype(np.int64))
    with torch.no_grad():
        return model(ids).logits[0].float().numpy().astype(np.float32)


def tidy(out: Path, case: str) -> None:
    """No machine-specific absolute path in the committed config, no model card, files 0644
    (safetensors writes 0600)."""
    cfg_file = out / "adapter_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["base_model_name_or_path"] = f"tests/fixtures/hf/{case}"
    cfg_file.write_text(json.dumps(cfg, indent=2, sort_keys=True))
    readme = out / "README.md"
    if readme.exists():  # save_pretrained writes a model card; the fixture does not need it
        readme.unlink()
    for f in out.iterdir():
        f.chmod(0o644)


def make_case(case: str, targets: list[str] | str, seed: int) -> None:
    src = FIXTURES / case
    out = FIXTURES / f"peft_{case}"
    with np.load(src / "expected.npz") as z:
        prompts = [z["prompt0"], z["prompt1"]]
    base = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    arrays: dict[str, np.ndarray] = {}
    for i, p in enumerate(prompts):
        arrays[f"prompt{i}"] = p
        arrays[f"base{i}"] = logits(base, p)
    cfg = LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=targets,
                     bias="none", task_type="CAUSAL_LM", init_lora_weights=False)
    model = get_peft_model(base, cfg).eval()
    randomize_adapters(model, seed)
    for i, p in enumerate(prompts):
        arrays[f"logits{i}"] = logits(model, p)
    if out.exists():
        shutil.rmtree(out)
    model.save_pretrained(out)
    merged = model.merge_and_unload().eval()
    for i, p in enumerate(prompts):
        arrays[f"merged{i}"] = logits(merged, p)
    np.savez(out / "expected.npz", **arrays)
    effect = max(float(np.abs(arrays[f"logits{i}"] - arrays[f"base{i}"]).max()) for i in (0, 1))
    (out / "oracle.json").write_text(json.dumps({
        "base": case, "peft": peft.__version__, "transformers": transformers.__version__,
        "torch": torch.__version__, "seed": seed, "adapter_effect": effect}, indent=1) + "\n")
    tidy(out, case)
    print(f"{case}: adapter moves logits by up to {effect:.3f}")


def main() -> None:
    only = set(sys.argv[1:])
    for seed, (case, targets) in enumerate(CASES.items()):
        if not only or case in only:
            make_case(case, targets, seed)


if __name__ == "__main__":
    main()
