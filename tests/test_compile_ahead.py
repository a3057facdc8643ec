"""Compiling a call's decode programs ahead (``EngineOptions.compile_threads``) changes when
programs compile, never what runs.

Oracles outside the library: the plain model re-run per token (``naive_generate``) for the
tokens, with and without an EOS that ends rows early (then the replay's buckets are not all
used); the engine's own cache for which programs ran, checked against which were compiled ahead
(every one of them, and none left over, when rows run to their limits: the replay the engine
reads names exactly the buckets it decodes at).
"""

from __future__ import annotations

import numpy as np
import pytest
from zoo import naive_generate, zoo

from jaxrl_sym.errors import InputError
from jaxrl_sym.generation import GenerationConfig
from jaxrl_sym.runtime.engine import SymbolicLM
from jaxrl_sym.runtime.options import EngineOptions

PROMPTS = [np.array(p, np.int32) for p in ([3, 9, 4, 1, 7], [2, 8], [5, 5, 6, 1, 2, 9, 3, 4],
                                            [7], [1, 2, 3], [6, 4, 2, 8, 1, 3])]
LIMITS = (40, 9, 23, 31, 4, 17)  # rows end at different tiles: compactions and growth


@pytest.fixture(scope="module")
def model():
    return zoo()["gemmaish"]  # window and full layers: a ring store beside a growing one


def _decode_keys(lm: SymbolicLM) -> set[tuple]:
    return {k for k in lm.cache.compiled if k[0] in ("decode", "decode_tile")}


def test_every_decode_program_compiled_ahead_without_eos(model):
    lm = SymbolicLM(model, EngineOptions(compile_threads=2, compact_min_rows=1))
    res = lm.generate(PROMPTS, GenerationConfig(max_new_tokens=LIMITS))
    for p, toks, n in zip(PROMPTS, res.tokens, LIMITS, strict=True):
        np.testing.assert_array_equal(toks, naive_generate(model, p, n)[0])
    ran = _decode_keys(lm)
    assert len(ran) >= 3  # the request visits several buckets, or the test shows nothing
    assert res.stats["programs_compiled_ahead"] == len(ran)
    assert not lm.cache.pending  # nothing compiled that the call did not run


def test_eos_ends_rows_before_the_replay_says_tokens_unchanged(model):
    greedy = [naive_generate(model, p, n)[0] for p, n in zip(PROMPTS, LIMITS, strict=True)]
    eos = int(greedy[0][len(greedy[0]) // 3])  # a token the longest row emits a third in
    cfg = GenerationConfig(max_new_tokens=LIMITS, eos_id=eos)
    lm = SymbolicLM(model, EngineOptions(compile_threads=2, compact_min_rows=1))
    res = lm.generate(PROMPTS, cfg)
    for toks, want in zip(res.tokens, greedy, strict=True):
        hit = np.nonzero(want == eos)[0]
        np.testing.assert_array_equal(toks, want[:hit[0] + 1] if len(hit) else want)
    assert len(res.tokens[0]) < LIMITS[0]
    assert res.stats["programs_compiled_ahead"] <= len(_decode_keys(lm))


def test_compile_threads_checked_and_defaulted_by_platform():
    with pytest.raises(InputError, match="compile_threads"):
        EngineOptions(compile_threads=-1)
    with pytest.raises(InputError, match="compile_threads"):
        EngineOptions(compile_threads=1.5)
    assert EngineOptions().compile_ahead("cpu") == 0
    assert 1 <= EngineOptions().compile_ahead("gpu") <= 4
    assert EngineOptions(compile_threads=3).compile_ahead("cpu") == 3
    assert EngineOptions(compile_threads=0).compile_ahead("gpu") == 0


def test_rl_step_compiles_the_overlapped_reference_program_ahead():
    """With the engine compiling ahead, the reference chunks' program compiles before any row
    ends; the rollout (tokens, sampling and reference log-probs) is the one without it."""
    from jaxrl_sym.models.lm import init_model, preset
    from jaxrl_sym.rl import RLConfig, RLTrainer, get_task
    from jaxrl_sym.rl.tasks.token_tasks import EOS, VOCAB_SIZE

    task = get_task("reverse", max_digits=3)
    cfg = RLConfig.of(algo="grpo", group_size=4, beta=0.1, eos_id=EOS,
                      max_new_tokens=task.max_new_tokens, overlap_reference=True)
    prompts = task.sample(np.random.default_rng(0), 3)
    runs = {}
    for threads in (0, 1):
        trainer = RLTrainer(init_model(preset("tiny", vocab_size=VOCAB_SIZE), 0), task.reward,
                            cfg, engine=EngineOptions(compile_threads=threads))
        runs[threads] = trainer.generate(prompts, seed=3), trainer.programs.cache
    (plain, plain_cache), (ahead, ahead_cache) = runs[0], runs[1]
    assert plain_cache.ahead == 0 and ahead_cache.ahead == 1  # the one chunk program
    assert ahead.stats["ref_chunks"] >= 1
    for name in ("responses", "old_logprobs", "ref_logprobs"):
        for a, b in zip(getattr(plain, name), getattr(ahead, name), strict=True):
            np.testing.assert_array_equal(a, b)


def test_cancel_drops_only_programs_whose_compile_has_not_started():
    """One background thread: the first prefetched build blocks (started), the second waits
    in the queue. Cancelling both drops the queued one alone; asked for later, it is built on
    demand; the started one is the compile ``get`` then returns."""
    import threading

    from jaxrl_sym.runtime.programs import ProgramCache

    started, release, built = threading.Event(), threading.Event(), []

    def slow():
        started.set()
        release.wait(timeout=30)
        built.append("a")
        return "exe-a"

    def queued():
        built.append("b")
        return "exe-b"

    cache = ProgramCache(threads=1)
    cache.prefetch(("a",), slow)
    cache.prefetch(("b",), queued)
    assert started.wait(timeout=30)
    cache.cancel([("a",), ("b",)])
    assert set(cache.pending) == {("a",)}
    release.set()
    assert cache.get(("a",), lambda: "never") == "exe-a"
    assert cache.get(("b",), queued) == "exe-b"
    assert built == ["a", "b"] and cache.ahead == 1 and cache.compiles == 2
