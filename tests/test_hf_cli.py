"""``jaxrl-sym generate`` / ``export`` against transformers' outputs on the committed fixtures.

Greedy tokens must equal transformers' ``generate(do_sample=False)`` (stopping at either of the
checkpoint's two EOS ids where it did), log-probs must be within 1e-4 of the log-softmax of
transformers' logits, prompts must tokenize as transformers' tokenizer did. Bad flags are
refused before JAX is imported.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxrl_sym.cli import main
from jaxrl_sym.models.hf.text import HFText

ROOT = Path(__file__).parent / "fixtures"
TEXT = ROOT / "text" / "chatml_qwen2"
HF = ROOT / "hf" / "qwen2_sliding_sharded"


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    rc = main([*argv, "--json"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    return json.loads(out.out.strip().splitlines()[-1])


@pytest.mark.parametrize("system", [pytest.param("sym", marks=pytest.mark.slow), "padded"])
def test_text_prompts_match_transformers(system: str, capsys: pytest.CaptureFixture[str]) -> None:
    exp = json.loads((TEXT / "expected.json").read_text())
    args = ["generate", "--model", str(TEXT), "--system", system,
            "--max-new-tokens", str(exp["max_new_tokens"])]
    for row in exp["greedy"]:
        args += ["--prompt", row["prompt"]]
    rep = run_json(capsys, *args)
    assert rep["eos_ids"] == exp["eos_ids"]
    text = HFText(TEXT)
    for got, want in zip(rep["rows"], exp["greedy"], strict=True):
        assert got["prompt_ids"] == want["prompt_ids"]
        assert got["tokens"] == want["tokens"]
        np.testing.assert_allclose(got["logprobs"], want["logprobs"], atol=1e-4)
        assert got["text"] == text.decode(want["tokens"])
    assert rep["rows"][0]["stop"] == "eos" and rep["rows"][0]["tokens"][-1] == exp["eos_ids"][1]
    assert rep["rows"][1]["stop"] == "length"


@pytest.mark.parametrize("system", ["sym", "padded"])
def test_prompt_ids_match_transformers_greedy(system: str,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """The sliding-window fixture (no EOS in its files: --ignore-eos runs rows to N)."""
    with np.load(HF / "expected.npz") as z:
        exp = dict(z)
    n = len(exp["greedy0"])
    rep = run_json(capsys, "generate", "--model", str(HF), "--system", system, "--ignore-eos",
                   "--max-new-tokens", str(n),
                   "--prompt-ids", ",".join(map(str, exp["prompt0"])),
                   "--prompt-ids", ",".join(map(str, exp["prompt1"])))
    for i, row in enumerate(rep["rows"]):
        assert row["tokens"] == exp[f"greedy{i}"].tolist()
        logits = exp[f"logits{i}"][-1].astype(np.float64)
        first = logits[row["tokens"][0]] - np.log(np.sum(np.exp(logits - logits.max()))) \
            - logits.max()
        assert abs(row["logprobs"][0] - first) < 1e-4  # the step transformers' logits cover
        assert row["stop"] == "length" and len(row["tokens"]) == n


@pytest.mark.slow
def test_sampling_and_eos_override(capsys: pytest.CaptureFixture[str]) -> None:
    """Sampling: sym and padded draw the same tokens for a seed; --eos-id cuts rows there."""
    base = ["generate", "--model", str(TEXT), "--prompt", "Weng earns $12", "--prompt",
            "The answer is", "--max-new-tokens", "6", "--temperature", "0.8", "--seed", "11"]
    sym = run_json(capsys, *base)
    pad = run_json(capsys, *base, "--system", "padded")
    assert [r["tokens"] for r in sym["rows"]] == [r["tokens"] for r in pad["rows"]]
    assert sym["temperature"] == 0.8 and sym["seed"] == 11
    rep = run_json(capsys, "generate", "--model", str(TEXT), "--prompt", "Weng earns $12",
                   "--max-new-tokens", "8", "--eos-id", "315")
    assert rep["rows"][0]["tokens"] == [92, 315] and rep["eos_ids"] == [315]


def test_bad_flags_refused_before_jax(tmp_path: Path) -> None:
    code = (
        "import sys; from jaxrl_sym.cli import main; rc = main(sys.argv[1:]); "
        "print('JAX' if 'jax' in sys.modules else 'NOJAX', rc)")
    cases = [
        (["--model", str(tmp_path / "nope"), "--prompt", "x"], "no such directory"),
        (["--model", str(HF), "--prompt-ids", "1,2,300"], r"id 300 is outside the vocabulary"),
        (["--model", str(HF), "--prompt", "w1", "--max-new-tokens", "0",
          "--temperature", "nan"], "--max-new-tokens must be >= 1"),
        (["--model", str(HF)], "at least one --prompt"),
        (["--model", str(HF), "--prompt", "w1", "--chat"], "--chat: .* has no chat template"),
        (["--model", str(ROOT / "text" / "llama3_bos"), "--prompt-ids", "1", "--ignore-eos",
          "--eos-id", "3"], "contradict"),
    ]
    for argv, pattern in cases:
        proc = subprocess.run([sys.executable, "-c", code, "generate", *argv],
                              capture_output=True, text=True, timeout=60)
        assert proc.stdout.split() == ["NOJAX", "2"], (argv, proc.stdout, proc.stderr)
        assert re.search(pattern, proc.stderr), (pattern, proc.stderr)
    proc = subprocess.run([sys.executable, "-c", code, "generate", "--model", str(HF),
                           "--prompt-ids", "1,x"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--prompt-ids: must be comma-separated" in proc.stderr


def test_missing_eos_named(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["generate", "--model", str(HF), "--prompt", "w1 w2", "--max-new-tokens", "2"])
    err = capsys.readouterr().err
    assert rc == 2 and "no EOS token id found" in err and "generation_config.json" in err


def test_export_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from jaxrl_sym.models.hf import load_pretrained

    out = tmp_path / "bf16"
    rep = run_json(capsys, "export", "--model", str(TEXT), "--out", str(out), "--dtype",
                   "bfloat16")
    assert "model.safetensors" in rep["files"] and "chat_template.jinja" in rep["files"]
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    model, _, _ = load_pretrained(out)
    assert str(model.model.embed_tokens.embedding[...].dtype) == "bfloat16"
    rc = main(["export", "--model", str(TEXT), "--out", str(out)])
    assert rc == 2 and "not empty" in capsys.readouterr().err
    rep = run_json(capsys, "export", "--model", str(TEXT), "--out", str(out), "--overwrite",
                   "--max-shard-size", "40KB")
    assert "model.safetensors.index.json" in rep["files"]
    rc = main(["export", "--model", str(TEXT), "--out", str(tmp_path / "x"),
               "--max-shard-size", "lots"])
    assert rc == 2 and "--max-shard-size must be a byte count" in capsys.readouterr().err
