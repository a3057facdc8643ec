"""Padded (one compile, MAX_LEN masked cache) vs per-shape (exact caches, one compile per length).

The two baselines share nothing but the model, :func:`select_tokens` and the prompt layout, so
their agreement on tokens, log-probs and logits (and with an independent full-forward scorer) is
the evidence that both implement the generation semantics: EOS inclusive, per-row limits,
(seed, row, step)-keyed sampling.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxrl_sym.baselines import padded_generate, padded_sequence_logprobs, pershape_generate
from jaxrl_sym.errors import InputError
from jaxrl_sym.generation import GenerationConfig, GenerationResult
from jaxrl_sym.models import LMConfig, init_model, preset

TOL = 1e-4


@pytest.fixture(scope="module")
def model():
    return init_model(preset("tiny", patterns=LMConfig.mixed(3).layer_patterns()), seed=0)


def _prompts(lens: tuple[int, ...], seed: int, vocab: int = 64) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).astype(np.int32) for n in lens]


def _choose_eos(rows: list[np.ndarray], limits: tuple[int, ...]) -> int:
    """A token that greedy decoding emits at different first positions in different rows.

    Prefers one that some row emits before its limit, so EOS actually shortens a row.
    """
    best, best_key = None, None
    for tok in np.unique(np.concatenate(rows)):
        firsts = [int(np.nonzero(r == tok)[0][0]) for r in rows if (r == tok).any()]
        early = sum(
            1 for r, lim in zip(rows, limits, strict=True)
            if (r == tok).any() and np.nonzero(r == tok)[0][0] + 1 < lim
        )
        key = (len(set(firsts)) >= 2, early > 0, len(set(firsts)), -min(firsts))
        if best_key is None or key > best_key:
            best, best_key = int(tok), key
    assert best is not None and best_key[0] and best_key[1], (
        f"no token of {rows} fits as EOS; pick another prompt seed"
    )
    return best


def _assert_same(a: GenerationResult, b: GenerationResult, *, logits: bool) -> None:
    assert len(a.tokens) == len(b.tokens)
    for i, (ta, tb) in enumerate(zip(a.tokens, b.tokens, strict=True)):
        np.testing.assert_array_equal(ta, tb, err_msg=f"row {i} tokens")
        np.testing.assert_allclose(a.logprobs[i], b.logprobs[i], atol=TOL, rtol=TOL)
        if logits:
            assert a.logits[i].shape == (ta.size, 64)
            np.testing.assert_allclose(a.logits[i], b.logits[i], atol=TOL, rtol=TOL)


MIXES = [
    # (prompt lengths, per-row limits, prompt seed)
    ((3, 7, 5, 1), (5, 3, 4, 5), 0),
    ((6, 2, 2), (4, 4, 2), 2),
    ((1, 4), 5, 1),  # EOS ends both rows before the limit: per-shape stops after 4 of 5 steps
]


@pytest.mark.parametrize(("lens", "limits", "seed"), MIXES)
def test_padded_and_pershape_agree_greedy_with_eos(model, lens, limits, seed) -> None:
    prompts = _prompts(lens, seed)
    n = len(lens)
    lim = (limits,) * n if isinstance(limits, int) else limits

    # Without EOS every row runs to its limit.
    free = padded_generate(model, prompts, GenerationConfig(max_new_tokens=limits))
    assert [t.size for t in free.tokens] == list(lim)

    eos = _choose_eos(free.tokens, lim)
    cfg = GenerationConfig(max_new_tokens=limits, eos_id=eos, return_logits=True)
    pad = padded_generate(model, prompts, cfg)
    per = pershape_generate(model, prompts, cfg)
    _assert_same(pad, per, logits=True)

    shortened = 0
    for i, (row_free, row) in enumerate(zip(free.tokens, pad.tokens, strict=True)):
        hits = np.nonzero(row_free == eos)[0]
        expect = hits[0] + 1 if hits.size else lim[i]
        # EOS is inclusive and decoding is unchanged by it: the row is a prefix of the free run.
        assert row.size == expect, f"row {i}"
        np.testing.assert_array_equal(row, row_free[:expect])
        shortened += expect < lim[i]
    assert shortened >= 1
    if shortened == n:
        assert per.stats["decode_steps"] < max(lim)

    if seed == 0:  # one mix is enough for the (compile-costly) independent scorer
        # One right-padded full forward reproduces the reported log-probs.
        scored = padded_sequence_logprobs(model, prompts, pad.tokens)
        for lp, ref in zip(pad.logprobs, scored, strict=True):
            np.testing.assert_allclose(lp, ref, atol=TOL, rtol=TOL)

    # Per-shape recompiles per length and stops as soon as every row is done.
    assert per.stats["decode_steps"] == max(t.size for t in per.tokens)
    assert per.stats["dispatches"] == per.stats["decode_steps"]
    assert pad.stats["xla_compiles"] <= 2 and pad.stats["dispatches"] == 1
    assert per.stats["xla_compiles"] >= per.stats["decode_steps"]
    if per.stats["decode_steps"] > 2:
        assert per.stats["xla_compiles"] > pad.stats["xla_compiles"]
    for res in (pad, per):
        assert res.stats["peak_bytes"] > 0 and res.stats["run_seconds"] > 0
        assert res.stats["compile_seconds"] > 0


def test_sampling_agrees_and_max_len_padding_is_invisible(model) -> None:
    prompts = _prompts((2, 5, 3), 3)
    # max_len pads the padded cache well past what it needs (5 + 5); per-shape never pads, so
    # their agreement also shows the extra masked slots are invisible.
    cfg = GenerationConfig(
        max_new_tokens=(4, 2, 5), temperature=0.9, seed=7, return_logits=True, max_len=24
    )
    pad = padded_generate(model, prompts, cfg)
    per = pershape_generate(model, prompts, cfg)
    assert pad.stats["max_len"] == 24
    _assert_same(pad, per, logits=True)
    assert [t.size for t in pad.tokens] == [4, 2, 5]
    assert per.stats["xla_compiles"] > pad.stats["xla_compiles"]

    # Sampled log-probs are under softmax(logits / T): the scorer agrees at the same temperature.
    scored = padded_sequence_logprobs(model, prompts, pad.tokens, temperature=cfg.temperature)
    for lp, ref in zip(pad.logprobs, scored, strict=True):
        np.testing.assert_allclose(lp, ref, atol=TOL, rtol=TOL)

    # Sampling is not greedy decoding in disguise: some token is not its logits' argmax.
    assert any(
        (t != lg.argmax(-1)).any() for t, lg in zip(pad.tokens, pad.logits, strict=True)
    )


@pytest.mark.parametrize("generate", [padded_generate, pershape_generate])
def test_input_errors_name_the_prompt(model, generate) -> None:
    good = np.array([1, 2, 3], np.int32)
    with pytest.raises(InputError, match="prompt 1 is empty"):
        generate(model, [good, np.array([], np.int32)], GenerationConfig(max_new_tokens=2))
    with pytest.raises(InputError, match=r"prompt 1 has 6 tokens.*max_len=7"):
        generate(
            model, [good, np.arange(6, dtype=np.int32)],
            GenerationConfig(max_new_tokens=2, max_len=7),
        )
    with pytest.raises(InputError, match="prompt 0 has dtype float32"):
        generate(model, [good.astype(np.float32)], GenerationConfig(max_new_tokens=2))
    with pytest.raises(InputError, match="prompt 0 has token ids outside"):
        generate(model, [np.array([64], np.int32)], GenerationConfig(max_new_tokens=2))
    with pytest.raises(InputError, match="max_new_tokens has 3 entries"):
        generate(model, [good], GenerationConfig(max_new_tokens=(1, 2, 3)))


def test_sequence_logprobs_errors(model) -> None:
    with pytest.raises(InputError, match="pair them"):
        padded_sequence_logprobs(model, [np.array([1])], [])
    with pytest.raises(InputError, match="response 0"):
        padded_sequence_logprobs(model, [np.array([1])], [np.array([99])])
    out = padded_sequence_logprobs(model, [np.array([1, 2])], [np.array([], np.int32)])
    assert out[0].shape == (0,)


def test_several_eos_ids_end_a_row_at_the_first_of_any_in_every_system(model) -> None:
    """Instruct checkpoints end turns at two or three ids (Llama 3: <|eot_id|>, <|end_of_text|>).
    Oracle: the no-EOS greedy rows cut by hand at the first position holding either id."""
    from jaxrl_sym.runtime.engine import SymbolicLM
    from jaxrl_sym.runtime.options import EngineOptions

    prompts = _prompts((3, 7, 5, 1), 4)
    free = padded_generate(model, prompts, GenerationConfig(max_new_tokens=12)).tokens
    counts = np.bincount(np.concatenate(free), minlength=64)
    a, b = (int(x) for x in np.argsort(-counts)[:2])  # the two commonest tokens
    cfg = GenerationConfig(max_new_tokens=12, eos_id=[a, b])
    assert cfg.eos_ids == (a, b)
    want = []
    for r in free:
        hits = np.nonzero(np.isin(r, (a, b)))[0]
        want.append(r[: hits[0] + 1] if hits.size else r)
    assert any(len(w) < 12 for w in want) and len({len(w) for w in want}) > 1
    runs = {"padded": padded_generate(model, prompts, cfg),
            "pershape": pershape_generate(model, prompts, cfg),
            "sym": SymbolicLM(model, EngineOptions(min_capacity=4)).generate(prompts, cfg)}
    for name, res in runs.items():
        for i, w in enumerate(want):
            np.testing.assert_array_equal(res.tokens[i], w, err_msg=f"{name} row {i}")


@pytest.mark.parametrize(("eos", "msg"), [((), "at least one"), ((3, 3), "repeated"),
                                          ((1, -2), ">= 0")])
def test_bad_eos_id_lists_are_refused(eos, msg) -> None:
    with pytest.raises(InputError, match=msg):
        GenerationConfig(max_new_tokens=4, eos_id=eos)
