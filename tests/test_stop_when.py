"""``SymbolicLM.generate(..., stop_when=...)``: ending generation at a read-back (what partial
rollouts stop a step with). Oracle: the same run without the hook — sampling is keyed by (seed,
step, row), so a run cut short must be a prefix of it row by row, with the same log-probs, and
must stop at the first read-back where the rule holds. On zoo architectures unlike the project's
own (scan-stacked layers, one block shared by every layer), plain and speculative decoding.
"""

from __future__ import annotations

from functools import cache
from itertools import pairwise

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from zoo import zoo

from jaxrl_sym.generation import GenerationConfig
from jaxrl_sym.runtime.engine import SymbolicLM
from jaxrl_sym.runtime.options import Speculation
from jaxrl_sym.runtime.speculative.lm import SpeculativeLM

LIMITS = (3, 5, 9, 17, 30, 40)  # rows end tiles apart (decode tiles of 8 steps)


def _prompts(vocab: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab, size=int(n)).astype(np.int32) for n in (4, 9, 6, 12, 5, 7)]


@cache
def _engine(name: str) -> SymbolicLM:
    """Traced once per worker, and only by a worker that runs these tests."""
    model = zoo(0)[name.split("-")[0]]
    if name.endswith("speculative"):
        return SpeculativeLM(model, speculation=Speculation(2))
    return SymbolicLM(model)


ENGINES = ("scan", "shared", "shared-speculative")


def _check_cut(full, part, calls: list[np.ndarray], need: int, limits: tuple[int, ...]) -> None:
    assert part.stats["stopped_early"]
    assert calls[-1].sum() >= need and all(c.sum() < need for c in calls[:-1])
    for prev, nxt in pairwise(calls):
        assert (nxt >= prev).all()  # a row once finished stays finished
    assert part.stats["unfinished_rows"] == int((~calls[-1]).sum()) > 0
    for i, (a, b) in enumerate(zip(part.tokens, full.tokens, strict=True)):
        assert np.array_equal(a, b[:len(a)]), i
        np.testing.assert_allclose(part.logprobs[i], full.logprobs[i][:len(a)], atol=1e-5)
        assert (len(a) == limits[i]) == bool(calls[-1][i])  # flagged finished iff at its limit


@pytest.mark.parametrize("name", ENGINES)
def test_stop_when_ends_at_the_first_read_back_where_it_holds(name: str) -> None:
    lm = _engine(name)
    temp = 0.0 if "speculative" in name else 1.0  # greedy speculation equals plain decoding
    cfg = GenerationConfig(max_new_tokens=LIMITS, temperature=temp, seed=7, eos_id=None)
    prompts = _prompts(lm.vocab_size)
    full = lm.generate(prompts, cfg)
    assert not full.stats["stopped_early"] and full.stats["unfinished_rows"] == 0
    calls: list[np.ndarray] = []

    def half(fin: np.ndarray) -> bool:
        calls.append(fin)
        return int(fin.sum()) >= 3

    _check_cut(full, lm.generate(prompts, cfg, stop_when=half), calls, 3, LIMITS)
    never = lm.generate(prompts, cfg, stop_when=lambda fin: False)
    assert not never.stats["stopped_early"] and never.stats["unfinished_rows"] == 0
    assert all(np.array_equal(a, b) for a, b in zip(never.tokens, full.tokens, strict=True))


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(need=st.integers(1, 5), limits=st.permutations(LIMITS), seed=st.integers(0, 50))
def test_stop_when_cuts_any_run_to_a_prefix(need: int, limits: list[int], seed: int) -> None:
    """Any threshold, any assignment of limits to rows (so any microbatch split)."""
    lm = _engine("scan")
    cfg = GenerationConfig(max_new_tokens=tuple(limits), temperature=1.0, seed=seed, eos_id=None)
    prompts = _prompts(lm.vocab_size, seed)
    full = lm.generate(prompts, cfg)
    calls: list[np.ndarray] = []

    def rule(fin: np.ndarray) -> bool:
        calls.append(fin)
        return int(fin.sum()) >= need

    _check_cut(full, lm.generate(prompts, cfg, stop_when=rule), calls, need, tuple(limits))


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(need=st.integers(1, 5), limits=st.permutations(LIMITS), seed=st.integers(0, 50))
def test_a_live_row_bound_stops_on_device_at_the_exact_step(need: int, limits: list[int],
                                                            seed: int) -> None:
    """``stop_live`` (the rule cannot hold while more rows are live): the tile program ends at
    its first live-row test after the need-th row ends — it tests every ``check`` steps of the
    plan's tiling (``decode_tile`` on a GPU, where a test is a host round-trip; every step on
    the CPU) — so every unfinished row holds the tokens of that check, fewer than a whole
    tile's when the tile has grown — and the run is
    still a prefix of the uncut one. Split into several microbatches, the bound of the running group
    counts the rows of the groups after it, and the cut is still a prefix."""
    lm = _engine("scan")
    cfg = GenerationConfig(max_new_tokens=tuple(limits), temperature=1.0, seed=seed, eos_id=None)
    prompts = _prompts(lm.vocab_size, seed)
    full = lm.generate(prompts, cfg)
    rows = len(prompts)
    for pad in (1.0, None):  # one decode loop (what partial rollouts use), then the default
        calls: list[np.ndarray] = []

        def rule(fin: np.ndarray, calls: list[np.ndarray] = calls) -> bool:
            calls.append(fin)
            return int(fin.sum()) >= need

        part = lm.generate(prompts, cfg, stop_when=rule, stop_live=rows - need,
                           max_pad_fraction=pad)
        _check_cut(full, part, calls, need, tuple(limits))
        if pad == 1.0:
            at = sorted(limits)[need - 1]  # tokens the need-th row ends with
            check = lm.plan.tiling.check  # decode steps between the tile program's tests
            held = 1 + -(-(at - 1) // check) * check  # token 0 from the prefill, whole checks
            assert {len(t) for t, f in zip(part.tokens, calls[-1], strict=True) if not f} \
                <= {held}
            tiled = lm.generate(prompts, cfg, stop_when=lambda f: int(f.sum()) >= need,
                                max_pad_fraction=1.0)
            assert part.stats["dispatches"] <= tiled.stats["dispatches"]
            assert part.stats["generated_tokens"] <= tiled.stats["generated_tokens"]
