"""Refill: finished rows of a resident group take waiting samples (``EngineOptions(refill=True)``).

What must hold (issue 30): a sample's tokens and log-probs depend only on (seed, sample, position)
— not on which row or refill wave ran it — so generation with refill on equals generation with
it off, greedy and sampled, with EOS, for every store kind: growing stores (wrapping rings
under refill), window rings (zoo Gemma-like, ``PlainLM`` window layers), a recurrent state
(``PlainLM`` linear layers), block rings and user-sized (``max_len``) stores (DecoderLM).
Oracles: the same request with refill off (every row resident), and the plain model re-run on
the whole sequence (``plain_greedy`` / ``naive_generate``, no shared code with the runtime);
a GRPO step through refilled rows against one without. The policy's replay is checked for
conservation (every position is needed or wasted by a named cause) on hypothesis-drawn
requests.
"""

from __future__ import annotations

import dataclasses
from functools import cache

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from test_oracle_plain_model import models as plain_models
from test_oracle_plain_model import plain_greedy
from zoo import naive_generate, zoo

from jaxrl_sym import GenerationConfig
from jaxrl_sym.errors import InputError
from jaxrl_sym.runtime.engine import SymbolicLM
from jaxrl_sym.runtime.options import EngineOptions, Speculation
from jaxrl_sym.runtime.prompt_cache import CACHE_SHARE, plan_chunks
from jaxrl_sym.runtime.refill import Refill, padded_groups, refill_shape, replay

MODELS = ("gemmaish", "window-softcap", "linear")  # growing+ring, ring+growing, state+ring


@cache
def model(name: str):
    return zoo()["gemmaish"] if name == "gemmaish" else plain_models(name)[0]


@cache
def engine(name: str, rows: int | None, min_free: int = 1) -> SymbolicLM:
    """One engine per setting, reused across examples (its programs compile once)."""
    opts = EngineOptions(min_capacity=4, compact_min_rows=1, microbatch_rows=rows,
                         refill=rows is not None, refill_min_free=min_free)
    return SymbolicLM(model(name), opts)


@st.composite
def requests(draw: st.DrawFn) -> tuple[list[np.ndarray], GenerationConfig, int, int]:
    n = draw(st.sampled_from([4, 6]))  # few row buckets: each new one compiles programs
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    lens = rng.integers(1, 14, n)
    prompts = [rng.integers(1, 40, int(k)).astype(np.int32) for k in lens]
    if draw(st.booleans()):  # a GRPO-like request: prompts repeated
        prompts = [prompts[i // 2] for i in range(n)]
    limits = tuple(int(x) for x in rng.integers(1, 12, n))
    temperature = draw(st.sampled_from([0.0, 0.7, 1.0]))
    cfg = GenerationConfig(max_new_tokens=limits, temperature=temperature,
                           eos_id=draw(st.sampled_from([None, 3, 5])), seed=draw(st.integers(0, 9)),
                           return_logits=temperature == 0.0)
    return prompts, cfg, draw(st.sampled_from([1, 3])), draw(st.sampled_from([1, 2]))


def assert_same(want, got) -> None:
    for i, (a, b) in enumerate(zip(want.tokens, got.tokens, strict=True)):
        assert np.array_equal(a, b), f"sample {i}: {a} without refill, {b} with"
    for a, b in zip(want.logprobs, got.logprobs, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
    if want.logits is not None:
        for a, b in zip(want.logits, got.logits, strict=True):
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", MODELS)
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(req=requests())
def test_refill_gives_the_tokens_of_every_row_resident(name: str, req) -> None:
    prompts, cfg, rows, min_free = req
    want = engine(name, None).generate(prompts, cfg)
    got = engine(name, rows, min_free).generate(prompts, cfg)
    assert got.stats["groups"] == 1
    assert_same(want, got)


@pytest.mark.parametrize("name", MODELS)
def test_refilled_rows_greedy_equal_rerunning_the_plain_model(name: str) -> None:
    """Seven ragged prompts through 2 resident rows (5 refills, the tail compacted), greedy,
    against the plain model re-run on the whole sequence at every step."""
    rng = np.random.default_rng(11)
    prompts = [rng.integers(1, 40, int(k)).astype(np.int32) for k in (5, 13, 1, 8, 3, 11, 6)]
    limits = (7, 2, 8, 5, 8, 1, 6)
    got = engine(name, 2).generate(prompts, GenerationConfig(max_new_tokens=limits,
                                                             return_logits=True))
    assert got.stats["dispatches"] > 0 and got.stats["groups"] == 1
    if name == "gemmaish":
        want = [naive_generate(model(name), p, n) for p, n in zip(prompts, limits, strict=True)]
        toks, rows = [w[0] for w in want], [w[1] for w in want]
    else:
        toks, rows = [], []
        for i in range(0, len(prompts), 4):  # the oracle's buffer holds 4 rows
            t, r = plain_greedy(name, prompts[i:i + 4], limits[i:i + 4], ())
            toks += t
            rows += r
    for i, (a, b) in enumerate(zip(toks, got.tokens, strict=True)):
        assert np.array_equal(a, b), f"{name} sample {i}: plain {a}, refilled {b}"
    for a, b in zip(rows, got.logits, strict=True):
        np.testing.assert_allclose(b, a, atol=1e-4, rtol=0)


def test_a_refill_that_ends_at_its_first_token_frees_its_row_again() -> None:
    """Limits of 1: every refilled sample ends at the token its refill samples, so rows are
    refilled again before any decode step; all samples still come out."""
    prompts = [np.array([1 + i, 2, 3], np.int32) for i in range(6)]
    cfg = GenerationConfig(max_new_tokens=(1, 1, 1, 1, 4, 1))
    want = engine("gemmaish", None).generate(prompts, cfg)
    got = engine("gemmaish", 2).generate(prompts, cfg)
    assert [len(t) for t in got.tokens] == [1, 1, 1, 1, 4, 1]
    assert_same(want, got)


@pytest.mark.parametrize("kind", ["block", "fixed"])
def test_block_and_user_sized_stores_refill_too(kind: str) -> None:
    """The store kinds the zoo models do not plan: block rings (``Block`` pattern) and stores
    the user sized (``max_len``: fixed, wrapping under refill), on the library's DecoderLM;
    sampled with EOS, refill on equals off. A row over ``max_len`` is still refused by row."""
    from flax import nnx

    from jaxrl_sym.models.lm import DecoderLM, preset
    from jaxrl_sym.ops.attention import Block

    patterns = (Block(4), Block(4)) if kind == "block" else preset("tiny").patterns
    model = DecoderLM(dataclasses.replace(preset("tiny"), patterns=patterns),
                      rngs=nnx.Rngs(2))
    max_len = None if kind == "block" else 40
    rng = np.random.default_rng(4)
    prompts = [rng.integers(1, 60, int(k)).astype(np.int32) for k in (3, 9, 1, 6, 12, 4, 7)]
    cfg = GenerationConfig(max_new_tokens=(9, 4, 12, 6, 3, 10, 5), temperature=1.0, seed=2,
                           eos_id=7)
    opts = EngineOptions(min_capacity=4, compact_min_rows=1, max_len=max_len)
    want = SymbolicLM(model, opts).generate(prompts, cfg)
    lm = SymbolicLM(model, opts.replace(microbatch_rows=2, refill=True))
    assert_same(want, lm.generate(prompts, cfg))
    if max_len is not None:
        with pytest.raises(InputError, match="max_len=40: row 4 needs"):
            lm.generate(prompts, dataclasses.replace(cfg, max_new_tokens=(9, 4, 12, 6, 30, 10, 5)))


def test_refill_settings_are_refused_by_name() -> None:
    with pytest.raises(InputError, match="refill=True needs prefill='packed'"):
        EngineOptions(refill=True, prefill="block")
    with pytest.raises(InputError, match="refill_min_free=0"):
        EngineOptions(refill=True, refill_min_free=0)
    with pytest.raises(InputError, match="drop speculation or refill"):
        from jaxrl_sym.runtime.speculative.lm import SpeculativeLM

        SpeculativeLM(model("gemmaish"), EngineOptions(refill=True, microbatch_rows=2),
                      speculation=Speculation(2))
    with pytest.raises(InputError, match=r"Refill\.min_free"):
        Refill(min_free=0)


# --------------------------------------------------------------------------- the policy


@settings(max_examples=60, deadline=None)
@given(lens=st.lists(st.tuples(st.integers(1, 300), st.integers(1, 400)), min_size=1,
                     max_size=40), rows=st.integers(1, 16), min_free=st.integers(1, 6),
       layout=st.sampled_from(["ring", "lifetime"]))
# every sample ends at its token 0: no decode step, but the group's stores were allocated
@example(lens=[(1, 1), (1, 1)], rows=1, min_free=1, layout="ring")
# ... and the refilled samples too: the group refills again at the same step (as the engine)
@example(lens=[(1, 1), (1, 1), (1, 1)], rows=1, min_free=1, layout="ring")
def test_replay_accounts_for_every_position(lens, rows, min_free, layout) -> None:
    """Every computed position is needed (each prompt token once, each response token after
    the first once) or wasted by a named cause, with or without refill; a ring never holds
    more than the request's longest span per row."""
    prompts, limits = [p for p, _ in lens], [n for _, n in lens]
    needed = sum(prompts) + sum(n - 1 for n in limits)
    for run in (replay(prompts, limits, rows=rows, refill=Refill(min_free, layout)),
                replay(prompts, limits, rows=rows, refill=None), padded_groups(prompts, limits,
                                                                               rows=rows)):
        assert run.needed == needed
        assert run.computed == needed + sum(run.waste.values())
        assert all(v >= 0 for v in run.waste.values())
    shape = refill_shape(prompts, limits, min(rows, len(limits)))
    assert shape.capacity >= max(p + n for p, n in lens) and shape.prompt_slots >= max(prompts)
    if len(limits) > rows:  # samples wait: the group refills, its rings fixed at the shape's
        ring = replay(prompts, limits, rows=rows, refill=Refill(min_free, "ring"))
        # beside them the prompt cache's largest chunk: one token each, like a slot
        budget = max(shape.prompt_slots, shape.rows * shape.capacity // CACHE_SHARE)
        chunks = plan_chunks(range(len(limits)), [np.full((n,), i) for i, n in
                                                  enumerate(prompts)], budget, vocab=1,
                             logits_bytes=1 << 40)
        assert sum(len(c.samples) for c in chunks) == len(limits)
        assert all(sum(c.lens) <= budget or len(c.lens) == 1 for c in chunks)
        cached = max(c.packed.tokens.size for c in chunks)
        assert ring.peak_slots == shape.rows * shape.capacity + cached


def test_a_grpo_step_with_refill_is_the_step_without() -> None:
    """An RL step (GRPO, 5 prompts x 4 samples, overlapped reference scoring fed by the
    finished-row callback) through 6 resident rows: the rollout's tokens, its log-probs and the
    step's loss equal those of a step without refill (the parameters after Adam are not compared
    bit for bit: log-probs computed at other rows differ in the last bits, and Adam scales a
    near-zero gradient's noise up to the learning rate)."""
    from jaxrl_sym.models.lm import init_model, preset
    from jaxrl_sym.rl import RLConfig, RLTrainer, get_task
    from jaxrl_sym.rl.tasks.token_tasks import EOS, VOCAB_SIZE

    task = get_task("reverse", max_digits=3)
    out = {}
    for refill in (False, True):
        engine = EngineOptions(microbatch_rows=6, refill=True) if refill else None
        cfg = RLConfig.of(algo="grpo", group_size=4, beta=0.1, eos_id=EOS, lr=1e-2,
                          max_new_tokens=task.max_new_tokens, overlap_reference=True)
        tr = RLTrainer(init_model(preset("tiny", vocab_size=VOCAB_SIZE), 0), task.reward, cfg,
                       engine=engine)
        prompts = task.sample(np.random.default_rng(0), 5)
        rollout = tr.generate(prompts, seed=3)
        metrics = tr.step(prompts, seed=3)
        out[refill] = (rollout, metrics)
    (r0, m0), (r1, m1) = out[False], out[True]
    assert r1.stats["groups"] == 1 and r0.stats["groups"] == 1
    for a, b, la, lb in zip(r0.responses, r1.responses, r0.old_logprobs, r1.old_logprobs,
                            strict=True):
        assert np.array_equal(a, b)
        np.testing.assert_allclose(la, lb, atol=1e-5, rtol=0)
    assert abs(m0["loss"] - m1["loss"]) <= 1e-6


def test_the_engine_estimate_prices_the_refilling_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """``SymbolicLM.estimate`` with refill: the stores of one group of R rows at the refill
    shape — equal to the bytes of the stores the run allocates (read off the group), and below
    the estimate of the same request without refill (every row resident)."""
    from jaxrl_sym.runtime.group import loop as group_mod

    held: list[int] = []
    real_init = group_mod.DecodeGroup.__init__

    def spy(self, *a, **kw):
        real_init(self, *a, **kw)
        held.append(sum(int(x.nbytes) for x in jax.tree_util.tree_leaves(self.stores)))

    monkeypatch.setattr(group_mod.DecodeGroup, "__init__", spy)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(1, 40, 9).astype(np.int32) for _ in range(7)]
    cfg = GenerationConfig(max_new_tokens=11)
    lm = engine("gemmaish", 3)
    est = lm.estimate([len(p) for p in prompts], cfg)
    lm.generate(prompts, cfg)
    assert held and est.caches == max(held), (est.breakdown(), held)
    every_row = SymbolicLM(model("gemmaish"), EngineOptions(min_capacity=4))
    assert every_row.estimate([len(p) for p in prompts], cfg).caches > est.caches


@settings(max_examples=60, deadline=None)
@given(lens=st.lists(st.integers(1, 20), min_size=1, max_size=14),
       repeat=st.integers(1, 3), budget=st.integers(1, 60))
def test_prompt_cache_chunks_hold_every_prompt_once_in_order(lens, repeat, budget) -> None:
    """The prompt cache's plan against the prompts themselves: chunks cover the samples once,
    in order; a chunk's distinct prompts fit the budget (or it is one prompt); each sample's
    cached tokens, read back at its start and length, are its prompt; samples of one prompt in
    one chunk share its entry, and no two distinct prompts share one."""
    rng = np.random.default_rng(len(lens) * 31 + budget)
    distinct = [rng.integers(1, 99, n).astype(np.int32) for n in lens]
    prompts = [distinct[i // repeat] for i in range(len(lens) * repeat)]
    order = list(rng.permutation(len(prompts)))
    chunks = plan_chunks(order, prompts, budget, vocab=100, logits_bytes=1 << 40)
    assert [s for c in chunks for s in c.samples] == order
    for c in chunks:
        assert sum(c.lens) <= budget or len(c.lens) == 1
        flat = c.packed.tokens.reshape(-1)
        for s in c.samples:
            e, start = c.entry[s], c.start(s)
            assert np.array_equal(flat[start:start + c.lens[e]], prompts[s])
            assert c.packed.positions.reshape(-1)[start] == 0
        entries = {}
        for s in c.samples:
            entries.setdefault(c.entry[s], prompts[s].tobytes())
            assert entries[c.entry[s]] == prompts[s].tobytes()
        assert len(set(entries.values())) == len(entries) == len(c.lens)


def test_every_refill_runs_one_program_and_each_prompt_once() -> None:
    """Thirteen samples of four prompts (GRPO-like, repeated 4, 3, 4 and 2 times) through 3
    resident rows of the zoo's Gemma-like model (window rings and growing stores): the prompt
    cache computes each distinct prompt once — the positions booked as prefill are the four
    prompts' tokens and the packing's tail, not thirteen prompts — every fill of a row, the
    first three included, runs the compiled refill program of its cache chunk's shape (not one
    per refill), and the greedy tokens and logits
    are the plain model's re-run on the whole sequence (``naive_generate``) and those of the
    same engine settings without refill."""
    rng = np.random.default_rng(2027)
    distinct = [rng.integers(1, 40, n).astype(np.int32) for n in (6, 11, 3, 8)]
    prompts = [p for p, k in zip(distinct, (4, 3, 4, 2), strict=True) for _ in range(k)]
    limits = tuple(int(x) for x in rng.integers(2, 9, len(prompts)))
    cfg = GenerationConfig(max_new_tokens=limits, return_logits=True)
    lm = SymbolicLM(model("gemmaish"), EngineOptions(min_capacity=4, microbatch_rows=3,
                                                     refill=True))
    res = lm.generate(prompts, cfg)
    names = [k[0] for k in lm.cache.compiled]
    # 13 samples through 3 rows take at least 5 fills; the programs are one per cache chunk
    # shape (these small rings cache 3/4 of their slots: the 28 prompt tokens need 2 chunks)
    assert names.count("refill") == names.count("prompt_cache") < 5
    assert "packed_prefill" not in names
    decoded = sum(n - 1 for n in limits)
    assert res.stats["needed_positions"] == sum(map(len, distinct)) + decoded
    for i, (p, n) in enumerate(zip(prompts, limits, strict=True)):
        toks, logits = naive_generate(model("gemmaish"), p, n)
        assert np.array_equal(res.tokens[i], toks), f"sample {i}: plain {toks}, {res.tokens[i]}"
        np.testing.assert_allclose(res.logits[i], logits, atol=1e-4, rtol=0)
    assert_same(engine("gemmaish", None).generate(prompts, cfg), res)


@pytest.mark.parametrize("early,check", [(False, 1), (True, 1), (True, 4)])
def test_the_replay_computes_what_the_refilling_engine_computes(early: bool, check: int) -> None:
    """Thirteen GRPO-like samples through 8 resident rows with refill, then the tail's
    compaction: the engine's token positions computed and needed equal the replay's (the
    policy's own functions over row counters), with compaction at tile ends, early compaction,
    and a GPU's policy (checks of 4 steps, early compaction, tiles that keep their length). The
    replay's tail once ran its tiles to their end where the engine's stopped at an early
    compaction (270 vs 291 positions here)."""
    rng = np.random.default_rng(3)
    distinct = [rng.integers(1, 40, n).astype(np.int32) for n in (6, 11, 3, 8)]
    counts = (4, 3, 4, 2)
    prompts = [p for p, k in zip(distinct, counts, strict=True) for _ in range(k)]
    ids = [i for i, k in enumerate(counts) for _ in range(k)]
    cfg = GenerationConfig(max_new_tokens=tuple(int(x) for x in rng.integers(2, 30, 13)))
    lm = SymbolicLM(model("gemmaish"), EngineOptions(
        min_capacity=4, microbatch_rows=8, refill=True, compact_early=early, decode_check=check,
        compact_min_rows=1))
    st_ = lm.generate(prompts, cfg).stats
    run = replay([len(p) for p in prompts], cfg.max_new_tokens, rows=8,
                 refill=lm.options.refill_policy(), tiling=lm.plan.group_tiling(cfg),
                 compaction=lm.plan.compaction, min_capacity=4, prompt_ids=ids)
    assert (st_["token_positions"], st_["needed_positions"]) == (run.computed, run.needed)
