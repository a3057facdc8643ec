"""Speculative decoding with a draft *model* (``SpeculativeLM(draft=<nnx.Module>)``).

Oracles: plain greedy decoding of the target (greedy speculation must equal it token for
token, whatever the draft proposes), the target's full forward (the log-probs of sampled
tokens), and the target as its own draft (every greedy proposal is the target's own argmax, so
a draft whose stores lost a token would show as rejections). Targets and drafts are zoo models
unlike the project's ``DecoderLM`` and unlike each other: a Gemma-like target (window + full
GQA layers, soft-capping) drafted by a GPT-2-like model (learned positions, LayerNorm, full
attention: growing draft stores), and the reverse (a draft with ring stores).
"""

from __future__ import annotations

import sys
from dataclasses import replace
from functools import cache
from pathlib import Path

import numpy as np
import pytest
from flax import nnx

from jaxrl_sym.errors import InputError
from jaxrl_sym.generation import GenerationConfig
from jaxrl_sym.runtime.engine import SymbolicLM
from jaxrl_sym.runtime.options import EngineOptions, Speculation
from jaxrl_sym.runtime.speculative.lm import SpeculativeLM

sys.path.insert(0, str(Path(__file__).parent))
from test_speculative import assert_logprobs_are_the_targets
from zoo import GemmaishConfig, GemmaishLM, GPT2Like, GPTConfig

VOCAB = 67


@cache
def models() -> dict[str, nnx.Module]:
    return {
        "gemmaish": GemmaishLM(GemmaishConfig(num_embed=VOCAB), rngs=nnx.Rngs(3)),
        "gemmaish-small": GemmaishLM(replace(GemmaishConfig(num_embed=VOCAB),
                                             layer_kinds=("local", "global")), rngs=nnx.Rngs(5)),
        "gpt2": GPT2Like(GPTConfig(vocab=VOCAB), rngs=nnx.Rngs(4)),
    }


@cache
def engines(target: str, draft: str, k: int = 3) -> tuple[SymbolicLM, SpeculativeLM]:
    m = models()
    # compact_min_rows=1: compaction (of the draft's stores too) runs at these small batches
    return (SymbolicLM(m[target], EngineOptions(min_capacity=4, compact_min_rows=1)),
            SpeculativeLM(m[target], EngineOptions(min_capacity=4, compact_min_rows=1),
                          speculation=Speculation(k), draft=m[draft]))


def _prompts(n: tuple[int, ...], seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, VOCAB, size=x).astype(np.int32) for x in n]


@pytest.mark.parametrize("target,draft", [("gemmaish", "gpt2"), ("gpt2", "gemmaish-small")])
def test_greedy_with_a_draft_model_equals_plain_greedy(target: str, draft: str) -> None:
    """Ragged prompts and limits, then an EOS the rows hit apart: rows finish at different
    verifies, so the group compacts (the draft's stores with it)."""
    plain, spec = engines(target, draft)
    prompts = _prompts((3, 11, 1, 7), seed=0)
    limits = (14, 5, 20, 9)
    for eos in (None, "mid"):
        ref = plain.generate(prompts, GenerationConfig(max_new_tokens=limits))
        eos_id = None if eos is None else int(ref.tokens[2][6])
        if eos_id is not None:
            ref = plain.generate(prompts, GenerationConfig(max_new_tokens=limits, eos_id=eos_id))
        out = spec.generate(prompts, GenerationConfig(max_new_tokens=limits, eos_id=eos_id))
        for i, (a, b) in enumerate(zip(ref.tokens, out.tokens, strict=True)):
            assert np.array_equal(a, b), f"{target}/{draft} row {i}: plain {a} vs spec {b}"
            np.testing.assert_allclose(out.logprobs[i], ref.logprobs[i], atol=1e-5, rtol=0)
        assert out.stats["drafted_tokens"] > 0
    assert any(k[0] == "draft_compact" for k in spec.cache.compiled)


def test_the_target_as_its_own_draft_is_always_accepted() -> None:
    """Greedy, draft = target: each proposal is the target's argmax at that position, so every
    draft is accepted — unless the draft's stores missed a token (say, the last accepted draft
    never fed back) or kept a rejected one. Near-ties between the draft's one-token forwards and
    the verify's (k+1)-token forward may flip a rare argmax, hence not exactly 1."""
    m = models()["gpt2"]
    plain = SymbolicLM(m, EngineOptions(min_capacity=4))
    spec = SpeculativeLM(m, EngineOptions(min_capacity=4), speculation=Speculation(4), draft=m)
    prompts = _prompts((5, 9, 2), seed=1)
    cfg = GenerationConfig(max_new_tokens=(30, 22, 26))
    out, ref = spec.generate(prompts, cfg), plain.generate(prompts, cfg)
    for a, b in zip(ref.tokens, out.tokens, strict=True):
        assert np.array_equal(a, b)
    assert out.stats["acceptance_rate"] >= 0.95, out.stats["acceptance_per_row"]
    # and a draft that is not the target is accepted far less: the rate is informative
    other = engines("gpt2", "gemmaish-small")[1].generate(prompts, cfg)
    assert other.stats["acceptance_rate"] < 0.8


def test_sampled_logprobs_with_a_draft_model_are_the_targets() -> None:
    """Temperature 1: every emitted token's log-prob is the target's full-forward log-softmax at
    its position, accepted draft or not (the acceptance rule is exact for a deterministic draft
    — greedy proposals — and its distribution test is in ``test_speculative.py``)."""
    plain, spec = engines("gemmaish", "gpt2")
    prompts = _prompts((4, 9, 2), seed=2)
    out = spec.generate(prompts, GenerationConfig(max_new_tokens=10, temperature=1.0, seed=5))
    assert_logprobs_are_the_targets(plain, prompts, out)


def test_a_draft_that_cannot_draft_is_refused_by_name() -> None:
    from zoo import SharedBlockLM

    from jaxrl_sym.models.lm import DecoderLM, preset
    from jaxrl_sym.ops.attention import Linear, Window

    target = models()["gemmaish"]
    with pytest.raises(InputError, match="SharedBlockLM has a vocabulary of 47 tokens, the "
                                         "target 67"):
        SpeculativeLM(target, speculation=Speculation(2), draft=SharedBlockLM(rngs=nnx.Rngs(0)))
    tiny = preset("tiny")
    window = DecoderLM(replace(tiny, patterns=(Window(3),) * tiny.n_layers), rngs=nnx.Rngs(0))
    linear = DecoderLM(replace(tiny, patterns=(Linear(),) * tiny.n_layers), rngs=nnx.Rngs(1))
    with pytest.raises(InputError, match="DecoderLM has linear attention"):
        SpeculativeLM(window, speculation=Speculation(2), draft=linear)
    with pytest.raises(InputError, match="draft='medusa'"):
        SpeculativeLM(window, speculation=Speculation(2), draft="medusa")


def test_decode_cli_refuses_a_draft_without_speculation_or_sym(capsys) -> None:
    from jaxrl_sym.cli import main

    assert main(["decode", "--draft", "tiny"]) == 2
    assert "--draft tiny drafts for --speculate K" in capsys.readouterr().err
    assert main(["decode", "--speculate", "2", "--draft", "tiny", "--systems", "padded"]) == 2
    assert "a draft model runs on the sym systems" in capsys.readouterr().err


def test_decode_cli_drafts_with_a_preset_model(tmp_path: Path) -> None:
    """``jaxrl-sym decode --speculate 2 --draft tiny``: sym speculates with a tiny DecoderLM
    draft (the model's vocabulary, other weights) and its tokens equal padded's plain greedy
    decoding (the check); the report names each system's draft."""
    import json
    import subprocess

    out = tmp_path / "r.json"
    proc = subprocess.run(
        [sys.executable, "-m", "jaxrl_sym.cli", "decode", "--preset", "tiny", "--tokens", "12",
         "--batch", "2", "--prompt-len", "4:8", "--speculate", "2", "--draft", "tiny",
         "--systems", "sym,padded", "--no-warm", "--out", str(out)],
        capture_output=True, text=True, cwd=Path(__file__).parents[1], timeout=600)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    sym, pad = report["systems"]["sym"], report["systems"]["padded"]
    assert sym["draft"] == "DecoderLM" and 0.0 <= sym["acceptance_rate"] <= 1.0
    assert pad["draft"].startswith("none: the padded baseline has no draft model")
    assert report["check"]["tokens_equal"] and report["check"]["max_abs_logprob_diff"] < 1e-4
