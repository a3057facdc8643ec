"""The training side's programs are compiled once per row-length class (issue 47 item 4).

sym packs a batch into rows of one length class; its reference / update programs used to run the
whole batch as ``[rows, row_len]``, and ``rows`` changed with every batch (15 update layouts in 30
steps of ``bench growing_rl``). Now every micro-batch has a row count fixed by the row length
(``update_tokens``, or ``DEFAULT_UPDATE_TOKENS`` unset), the last completed with empty rows.

Oracles: the step's own compile counter (the ``compiles`` metric, and the trainer's program cache)
for "the second batch compiles nothing"; the plain ``DecoderLM`` run on each sample alone, with
the GRPO objective written out here, for "the filler rows and the split change no loss or
gradient"; for the shape rule, its definition stated as inequalities (not the code's formula).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from test_long_packed_update import _plain_logprobs

from jaxrl_sym.models.lm import init_model, preset
from jaxrl_sym.rl import RLConfig, RLTrainer, Rollout
from jaxrl_sym.rl.knobs import DEFAULT_UPDATE_TOKENS, ExecutionConfig
from jaxrl_sym.rl.step import stages
from jaxrl_sym.rl.step.context import fit_to_micro_batches
from jaxrl_sym.rl.step.rollout import Drawn
from jaxrl_sym.systems.trainable import trainable

MODEL = preset("tiny")  # vocabulary 64
PROMPT = 6


def _rollout(rng: np.random.Generator, lengths: list[list[int]], old: float = -1.0) -> Rollout:
    """One group per entry of ``lengths`` (its samples' response lengths), a random prompt each."""
    prompts, responses = [], []
    for group in lengths:
        p = rng.integers(1, MODEL.vocab_size, PROMPT).astype(np.int32)
        for n in group:
            prompts.append(p)
            responses.append(rng.integers(1, MODEL.vocab_size, n).astype(np.int32))
    return Rollout(prompts, responses, [np.full(len(r), old, np.float32) for r in responses],
                   group_size=len(lengths[0]))


@dataclass(frozen=True)
class Given:
    """A rollout source that hands the step a rollout made here (no generation compiles)."""

    rollout: Rollout

    def draw(self, ctx, state) -> Drawn:
        return Drawn(self.rollout)


def _step(trainer: RLTrainer, rollout: Rollout) -> dict:
    outcome = stages.run_step(trainer.context, trainer.state, Given(rollout))
    trainer.commit(outcome.state)
    return outcome.metrics


def _programs(trainer: RLTrainer) -> set[tuple[str, tuple[int, ...]]]:
    """(name, shape of the first batch input) of every program the step's cache compiled."""
    out = set()
    for name, _, shapes in trainer.programs.cache.compiled:
        rows = [s for s, dtype in shapes if len(s) == 2 and dtype == "<i4"]
        out.add((name, rows[0] if rows else ()))
    return out


@pytest.mark.parametrize("update_tokens", [None, 128])
def test_a_second_batch_of_the_same_row_length_class_compiles_nothing(update_tokens) -> None:
    """Two batches of different sample counts and lengths, both in the 64-slot row class: the
    first compiles the reference and update programs, the second none (step metric ``compiles``
    counts every XLA compile of the step). 128 tokens: 2 rows per micro-batch, so both batches
    run several (3 and 4 groups need more than one); unset: a budget of 4096 slots (64 rows),
    which neither batch fills, so each runs one micro-batch at the power of two above its rows
    (the same for both: under half of it filler)."""
    cfg = RLConfig.of(algo="grpo", group_size=2, beta=0.1, epochs=1, eos_id=None,
                      max_new_tokens=64, overlap_reference=False, update_tokens=update_tokens)
    trainer = RLTrainer(init_model(MODEL, 0), lambda p, r: float(len(r) % 3), cfg)
    rng = np.random.default_rng(0)
    a = _rollout(rng, [[44, 3], [17, 28], [33, 30], [5, 50]])  # 5 rows
    b = _rollout(rng, [[44, 3], [17, 28], [33, 30], [5, 50], [40, 41]])  # 7 rows
    lay_a, lay_b = trainer.layout(a), trainer.layout(b)
    assert lay_a.shape[1] == lay_b.shape[1] == 64  # one row length class
    assert lay_a.filled_rows != lay_b.filled_rows  # the old layouts' row counts differ
    per = (update_tokens or DEFAULT_UPDATE_TOKENS) // 64
    if update_tokens is not None:
        assert lay_a.shape[0] % per == 0 and lay_b.shape[0] % per == 0
        assert lay_a.filled_rows > per and lay_b.filled_rows > per  # several micro-batches
    else:
        per = lay_a.shape[0]  # one micro-batch of a power of two rows, < 2x the filled rows
        assert per == lay_b.shape[0] and per & (per - 1) == 0
        assert max(lay_a.filled_rows, lay_b.filled_rows) <= per
        assert 2 * min(lay_a.filled_rows, lay_b.filled_rows) > per

    first = _step(trainer, a)
    seen = _programs(trainer)
    assert first["compiles"] > 0 and any(n.startswith("ref-") for n, _ in seen)
    second = _step(trainer, b)
    assert second["compiles"] == 0, second["compiles"]
    assert _programs(trainer) == seen  # the same compiled shapes, nothing added
    assert {shape for n, shape in seen if shape} == {(per, 64)}  # every one a micro-batch
    assert second["layout_shape"] == list(lay_b.shape)


def test_filler_rows_and_micro_batches_keep_the_plain_models_loss_and_gradients() -> None:
    """The batch cut into micro-batches of a fixed row count, the last completed with empty
    rows: the summed gradients and merged loss are the plain model's on each sample alone
    (token-mean GRPO at ratio 1: ``-sum_i A_i |y_i| / N``)."""
    cfg = RLConfig.of(algo="grpo", group_size=2, beta=0.0, entropy_coef=0.0, epochs=1,
                      loss_agg="token_mean", adv_norm="group_std", eos_id=None,
                      max_new_tokens=64, logprob_chunk=None, update_tokens=128)
    graphdef, params, rest = nnx.split(init_model(MODEL, 0), nnx.Param, ...)
    model = nnx.merge(graphdef, params, rest)
    rollout = _rollout(np.random.default_rng(1), [[20, 31], [9, 40], [25, 12]])
    rollout.old_logprobs = [np.asarray(_plain_logprobs(model, p, r))
                            for p, r in zip(rollout.prompts, rollout.responses, strict=True)]
    rewards = np.array([1.0, 0.0, 0.0, 1.0, 1.0, 0.5], np.float32)
    g = rewards.reshape(-1, 2)
    adv = ((g - g.mean(1, keepdims=True)) / (g.std(1, keepdims=True) + cfg.algorithm.adv_eps)
           ).ravel()

    def objective(p: nnx.State) -> jax.Array:
        m = nnx.merge(graphdef, p, rest)
        lps = [_plain_logprobs(m, pr, r) for pr, r in zip(rollout.prompts, rollout.responses,
                                                          strict=True)]
        return -sum(a * jnp.sum(lp) for a, lp in zip(adv, lps, strict=True)) / sum(
            len(r) for r in rollout.responses)

    want = jax.tree_util.tree_leaves(jax.jit(jax.grad(objective))(params))
    trainer = RLTrainer(init_model(MODEL, 0), lambda p, r: 0.0, cfg)
    layout, arrays = trainer.prepare(rollout, rewards)
    chunks = stages.micro_batches(cfg.execution, layout, arrays)
    assert len(chunks) >= 2 and {c[0][0].shape for c in chunks} == {(2, 64)}
    assert layout.shape[0] > layout.filled_rows  # the last micro-batch holds filler rows
    fns, state = trainer.context.fns(layout.system), trainer.state
    grads, parts = None, []
    for inputs, arr in chunks:
        (_, aux), gr = fns["grad"](state.params, state.frozen, inputs, arr)
        parts.append({k: float(v) for k, v in aux.items()})
        grads = gr if grads is None else jax.tree_util.tree_map(jnp.add, grads, gr)
    n = np.array([len(r) for r in rollout.responses])
    assert sum(p["loss"] for p in parts) == pytest.approx(-float(adv @ n) / n.sum(), rel=1e-5)
    assert sum(p["n_tok"] for p in parts) == n.sum()
    got = jax.tree_util.tree_leaves(grads["lm"])
    assert len(got) == len(want) and max(float(np.abs(w).max()) for w in want) > 1e-4
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-3, atol=2e-6)


@settings(max_examples=60)
@given(groups=st.lists(st.lists(st.integers(1, 300), min_size=2, max_size=2), min_size=1,
                       max_size=6),
       prompt=st.integers(1, 40), budget=st.one_of(st.none(), st.integers(1, 3000)),
       multiple=st.sampled_from([1, 2, 4]), share=st.booleans())
def test_fitted_layouts_are_whole_micro_batches_of_a_row_count_fixed_by_the_row_length(
        groups, prompt, budget, multiple, share) -> None:
    """sym: R the largest multiple of ``multiple`` whose R rows fit the budget (at least
    ``multiple``); a batch filling R rows is k micro-batches of R rows, less than one of filler;
    a smaller one is one micro-batch of fewer than twice its rows (a multiple of ``multiple``,
    at most R). The samples' rows untouched, filler rows empty, every micro-batch holding a
    sample. padded: exactly what ``pad_rows`` gave before (its behaviour is unchanged)."""
    rng = np.random.default_rng(len(groups) * 1000 + prompt)
    rollout = _rollout(rng, groups)
    rollout.prompts = [np.resize(p, prompt) for p in rollout.prompts]
    cfg = ExecutionConfig(update_tokens=budget)
    sym = trainable("sym").layout(rollout.prompts, rollout.responses, row_len=None,
                                  share_prompts=share)
    fit = fit_to_micro_batches(cfg, sym, multiple)
    width, tokens = sym.shape[1], budget or DEFAULT_UPDATE_TOKENS
    per = stages.row_chunks(cfg, fit, multiple)[0].stop
    assert per % multiple == 0 and (per == multiple or per * width <= tokens)
    assert (per + multiple) * width > tokens
    rows, filled = fit.shape[0], sym.filled_rows
    assert fit.shape == (rows, width) and fit.filled_rows == filled
    if filled >= per:
        assert rows % per == 0 and 0 <= rows - filled < per
    else:
        assert filled <= rows <= per and (rows == per or rows % multiple == 0)
        assert rows < 2 * filled + multiple
    k = sym.filled_rows
    assert fit.spans == sym.spans and np.array_equal(fit.targets[:k], sym.targets[:k])
    for got, was, fill in zip(fit.inputs, sym.inputs, (0, -1, -1), strict=True):
        assert np.array_equal(got[:k], was[:k]) and np.all(got[k:] == fill)
    assert not fit.targets[k:].any() and not fit.mask()[k:].any()
    chunks = stages.row_chunks(cfg, fit, multiple)
    each = min(per, rows)
    assert all(len(range(*c.indices(rows))) == each for c in chunks)
    assert len(chunks) * each == rows

    padded = trainable("padded").layout(rollout.prompts, rollout.responses, row_len=None)
    want = trainable("padded").pad_rows(padded, multiple)
    got = fit_to_micro_batches(cfg, padded, multiple)
    assert got.shape == want.shape and all(np.array_equal(x, y) for x, y in
                                           zip(got.inputs, want.inputs, strict=True))
