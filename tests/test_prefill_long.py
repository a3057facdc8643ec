"""A long prompt's prefill: temporaries linear in its length, tokens those of the plain model.

Issue 47 (item 3): sym's packed prefill ran the attention primitive over a whole packed row, and
one long prompt is a row of its own, so every attention call held ``[heads, T, T]`` fp32 scores
and mask: the prefill's XLA temporaries grew with the square of the prompt (a 2-layer toy model:
1.39 GB at 8,192 tokens, 4.55 GB at 16,384) while padded's, chunked, did not. The packed prefill
now attends in blocks of queries whose scores fit ``prefill.SCORES_BYTES``, each over all of its
row's keys. Checked here: XLA's own memory analysis of the compiled prefill programs at 1,024
and 4,096 prompt tokens (at most ~linear growth, and no more than padded's prefill+decode
program for the same prompt), the blocked attention against the one-call primitive, and the
generated tokens against re-running the plain model after a 2,040-token prompt, through the
packed prefill and through a refilling group's prompt cache, with the blocks forced small.
"""

from __future__ import annotations

from functools import cache

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from zoo import naive_generate, zoo

import jaxrl_sym.runtime.prefill as prefill
from jaxrl_sym.baselines.padded import left_pad_prompts, padded_program
from jaxrl_sym.generation import GenerationConfig
from jaxrl_sym.models.lm import DecoderLM, preset
from jaxrl_sym.ops.attention import (
    QUERY_BLOCK_MIN,
    Block,
    Causal,
    Linear,
    Window,
    attention_p,
    child_segment,
    query_block,
)
from jaxrl_sym.ops.attention_blocks import attend_in_query_blocks
from jaxrl_sym.runtime.engine import SymbolicLM
from jaxrl_sym.runtime.memory.ledger_generation import sym_ledger
from jaxrl_sym.runtime.metrics import executable_temp_bytes
from jaxrl_sym.runtime.options import EngineOptions


@cache
def tiny() -> DecoderLM:
    return DecoderLM(preset("tiny"), rngs=nnx.Rngs(0))  # 2 layers, 4 heads, vocab 64


def _prompt(n: int, vocab: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, vocab, n).astype(np.int32)


def _sym_prefill_temps(n: int) -> int:
    """XLA temporaries of the prefill programs a generation runs for an n-token prompt: the
    engine's own programs at the keys it would compile, compiled and not run (the generation
    ledger; at 4,096 tokens running them under the tests' -O0 XLA took 36 s of a loaded CI
    machine)."""
    lm = SymbolicLM(tiny())
    gl = sym_ledger(lm.plan, lm.leaves, [_prompt(n, 60)], GenerationConfig(max_new_tokens=2))
    temps = [r.size.temp for r in gl.runs if r.stage == "prefill"]
    assert temps, f"no prefill program among {[r.what for r in gl.runs]}"
    return sum(temps)


def _padded_temps(n: int) -> int:
    """XLA temporaries of padded's one program (prefill + decode) for an n-token prompt."""
    model, cfg = tiny(), GenerationConfig(max_new_tokens=2)
    batch = left_pad_prompts(model, [_prompt(n, 60)], cfg)
    state = nnx.state(model)
    args = (batch.tokens, batch.positions, batch.prompt_lens, batch.limits)
    return executable_temp_bytes(padded_program(model, batch, cfg).lower(state, *args).compile())


def test_long_prompt_prefill_temporaries_grow_linearly_and_stay_under_padded() -> None:
    short, long = _sym_prefill_temps(1024), _sym_prefill_temps(4096)
    # quadratic was 16x (33.8 -> 538 MB); a quarter of the queries per block at 4x the keys
    assert long <= 5 * short, (short, long)
    assert long <= _padded_temps(4096), long


@pytest.mark.parametrize("pattern", [Causal(), Window(5), Block(16), Linear()],
                         ids=lambda p: p.name)
def test_query_blocks_equal_one_call_of_the_primitive(pattern) -> None:
    """Two packed rows of several prompts (one a child segment of another), GQA, an empty
    tail; blocks that do not divide the row (the last one padded)."""
    b, t, hq, hkv, d = 2, 150, 4, 2, 8
    ks = jax.random.split(jax.random.key(3), 3)
    q = jax.random.normal(ks[0], (b, t, hq, d))
    k = jax.random.normal(ks[1], (b, t, hkv, d))
    v = jax.random.normal(ks[2], (b, t, hkv, d))
    seg = np.zeros((b, t), np.int32)
    pos = np.zeros((b, t), np.int32)
    seg[0, :70], pos[0, :70] = 0, np.arange(70)
    seg[0, 70:], pos[0, 70:] = child_segment(0, 1), 70 + np.arange(80)
    seg[1, :40], pos[1, :40] = 2, np.arange(40)
    seg[1, 40:130], pos[1, 40:130] = 3, np.arange(90)
    pos[1, 130:] = -1  # packing tail
    pos, seg = jnp.asarray(pos), jnp.asarray(seg)
    kw = dict(pattern=pattern, scale=0.3, softcap=0.0 if isinstance(pattern, Linear) else 2.0)
    want = jax.jit(lambda *a: attention_p.bind(*a, **kw))(q, k, v, pos, pos, seg, seg)
    block = query_block(b, hq, t, t, 4 * b * hq * t * 40)  # 40 queries fit: 4 blocks of 40
    assert block == 40
    got = jax.jit(lambda *a: attend_in_query_blocks(*a, block=block, **kw))(
        q, k, v, pos, pos, seg, seg)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6, rtol=0)
    assert not np.asarray(got)[1, 130:].any()


def test_query_block_sizes() -> None:
    assert query_block(1, 4, 1024, 1024, 64 << 20) == 1024  # fits: one call
    assert query_block(1, 4, 4096, 4096, 64 << 20) == 1024
    assert query_block(1, 4, 1000, 1000, 4 * 4 * 1000 * 300) == 256  # 4 even blocks, 8-aligned
    assert query_block(8, 32, 1 << 20, 1 << 20, 1 << 20) == QUERY_BLOCK_MIN  # floor


@pytest.mark.parametrize("refill", [False, True], ids=["packed", "prompt_cache"])
def test_tokens_after_a_long_prompt_equal_the_plain_model(refill: bool, monkeypatch) -> None:
    """The zoo's shared-block model (one block under ``fori_loop``, causal): 2,040 prompt
    tokens (a packed row of 2,048), blocks of 160 queries (forced: 4 MiB of scores), 3 greedy
    tokens. With refill the long prompt goes through a group's prompt cache, one resident row,
    a short prompt refilled after it."""
    monkeypatch.setattr(prefill, "SCORES_BYTES", 1 << 22)
    blocks: list[tuple[int, int]] = []  # (queries per block, row length) per attention call
    real = prefill.attend_in_query_blocks

    def spy(*args, block: int, **kw):
        blocks.append((block, args[0].shape[1]))
        return real(*args, block=block, **kw)

    monkeypatch.setattr(prefill, "attend_in_query_blocks", spy)
    model = zoo()["shared"]  # vocab 47
    long = _prompt(2040, 47, seed=5)  # with its tokens, the re-run's width is 2,048
    prompts = [long, _prompt(7, 47, seed=6)] if refill else [long]
    opts = EngineOptions(microbatch_rows=1, refill=True) if refill else EngineOptions()
    n = 3
    res = SymbolicLM(model, opts).generate(
        prompts, GenerationConfig(max_new_tokens=n, return_logits=True))
    for p, toks, lps, logits in zip(prompts, res.tokens, res.logprobs, res.logits, strict=True):
        want, want_logits = naive_generate(model, p, n)
        np.testing.assert_array_equal(toks, want)
        np.testing.assert_allclose(np.asarray(logits), want_logits, atol=1e-4, rtol=0)
        want_lp = jax.nn.log_softmax(jnp.asarray(want_logits), axis=-1)[np.arange(n), want]
        np.testing.assert_allclose(lps, np.asarray(want_lp), atol=1e-4, rtol=0)
    assert blocks and all(b < t for b, t in blocks), blocks  # the long row: in blocks
