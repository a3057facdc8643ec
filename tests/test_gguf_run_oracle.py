"""A LoRA run that starts from a GGUF file exports what transformers and peft run as we do.

The first hour's path (issue 48): ``train --model FILE.gguf --lora-rank R``, then ``export``
merged and ``export --peft``. The oracle is transformers + peft in their own interpreter
(``tests/hf_oracle.py``), sharing no code with ``jaxrl_sym``: the merged directory through
``AutoModelForCausalLM.from_pretrained``; the adapters through ``PeftModel.from_pretrained`` on
the base that transformers' own GGUF reader dequantizes (``gguf_file=``), not on our rebuilt
directory. Both must give the trained policy's logits and its greedy tokens (a greedy loop
written on each side, so no generation config of either library takes part).

Tolerance: float32 logits of this tiny random model reach ~10; the two sides dequantize Q4_1
and sum in different orders, ~1e-5 apart, so ``|ours - theirs| <= 1e-4 * max|logits|``. The
training step's learning rate is large so that the adapters move the logits by far more than
that (checked), and an export that dropped or mis-scaled them would fail.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from hf_oracle import oracle_python, run_oracle

from jaxrl_sym.models.hf import load_pretrained
from jaxrl_sym.rl.run.export import export_checkpoint, restore_policy
from jaxrl_sym.rl.run.train import train

GGUF = Path(__file__).parent / "fixtures" / "hf" / "gguf_llama" / "tied" / "model-Q4_1.gguf"
NEW = 8

ORACLE_SCRIPT = """
import json, sys
import numpy as np, torch
from peft import PeftModel
from transformers import AutoModelForCausalLM
gguf, merged, adapters, prompt, new = sys.argv[1:6]
ids = [int(t) for t in prompt.split(",")]

def run(model):
    logits = model(torch.tensor([ids])).logits[0].float().numpy()
    toks = list(ids)
    for _ in range(int(new)):
        toks.append(int(model(torch.tensor([toks])).logits[0, -1].argmax()))
    return {"logits": logits.tolist(), "greedy": toks[len(ids):]}

out = {}
with torch.no_grad():
    out["merged"] = run(AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval())
    path = gguf.rsplit("/", 1)
    base = AutoModelForCausalLM.from_pretrained(path[0], gguf_file=path[1], dtype=torch.float32)
    out["base"] = run(base.eval())
    out["peft"] = run(PeftModel.from_pretrained(base, adapters).eval())
print(json.dumps(out))
"""


def _logits(model, toks: list[int]) -> np.ndarray:
    t = jnp.asarray([toks], jnp.int32)
    pos = jnp.arange(len(toks), dtype=jnp.int32)[None]
    return np.asarray(model(t, pos, jnp.zeros_like(pos)))[0]


def _ours(model, prompt: list[int]) -> dict[str, object]:
    toks = list(prompt)
    for _ in range(NEW):
        toks.append(int(np.argmax(_logits(model, toks)[-1])))
    return {"logits": _logits(model, prompt), "greedy": toks[len(prompt):]}


def test_a_gguf_lora_run_exports_what_transformers_and_peft_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    python = oracle_python("peft", "gguf")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the rebuilt config's home
    task = tmp_path / "sums.jsonl"
    task.write_text('{"prompt": "What is 2 + 3?", "answer": 5}\n'
                    '{"prompt": "What is 4 + 4?", "answer": 8}\n')
    train("grpo", f"jsonl:{task}", steps=2, seed=0, prompts_per_step=1, group_size=2,
          model_dir=str(GGUF), eval_prompts=0, progress=False,
          checkpoint_dir=str(tmp_path / "run"), lora={"rank": 4, "alpha": 8.0},
          config={"max_new_tokens": 4, "entropy_coef": 0.05, "lr": 0.05})
    export_checkpoint(tmp_path / "run", tmp_path / "merged")
    files, _ = export_checkpoint(tmp_path / "run", tmp_path / "peft", peft=True)
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(files)

    policy, _ = restore_policy(tmp_path / "run")
    base, _, _ = load_pretrained(GGUF)
    prompt = [int(t) for t in np.arange(3, 3 + 12) * 7 % 200]
    ours, plain = _ours(policy, prompt), _ours(base, prompt)
    res = run_oracle(python, ORACLE_SCRIPT, [str(GGUF), str(tmp_path / "merged"),
                                             str(tmp_path / "peft"), ",".join(map(str, prompt)),
                                             str(NEW)], tmp_path)
    scale = float(np.abs(ours["logits"]).max())
    moved = float(np.abs(ours["logits"] - plain["logits"]).max())
    assert moved > 1e-2 * scale, (moved, scale)  # the adapters bite: an export must carry them
    close = np.abs(np.asarray(res["base"]["logits"]) - plain["logits"]).max()
    assert close <= 1e-4 * scale, ("base", close, scale)  # the oracle reads the GGUF as we do
    for kind in ("merged", "peft"):
        diff = float(np.abs(np.asarray(res[kind]["logits"]) - ours["logits"]).max())
        assert diff <= 1e-4 * scale, (kind, diff, scale)
        assert res[kind]["greedy"] == ours["greedy"], (kind, res[kind]["greedy"], ours["greedy"])
    adapter_cfg = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert (adapter_cfg["r"], adapter_cfg["lora_alpha"]) == (4, 8)
