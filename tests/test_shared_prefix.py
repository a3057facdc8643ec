"""Shared-prompt training rows (``RLConfig.share_prompts``) against unshared packing.

Two oracles, written independently of the layout code:

* shapes (numpy only, hypothesis): for every response-predicting slot, the keys a query may see
  under the segment rule — re-implemented here from its definition, not imported — must be
  exactly the sample's own prompt + response prefix at positions 0, 1, …; and the slot must
  predict the right token;
* numbers (compiled): reference log-probs, the loss and every gradient of the step's own
  programs on the shared layout equal those on the plain packed layout (1e-5), on models unlike
  ``DecoderLM`` — Gemma-2-like (window + soft-cap + GQA), GPT-2-like (learned positions, no
  features/head split) — and on ``DecoderLM`` with block and linear attention.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from zoo import GemmaishConfig, GemmaishLM, GPT2Like, GPTConfig

from jaxrl_sym import Block, Causal, Linear
from jaxrl_sym.errors import InputError
from jaxrl_sym.models.lm import init_model, preset
from jaxrl_sym.rl import RLConfig, RLTrainer
from jaxrl_sym.systems.layout import packed_layout, shared_prefix_layout

groups = st.lists(st.tuples(st.integers(1, 12), st.lists(st.integers(1, 14), min_size=1,
                                                        max_size=6)), min_size=1, max_size=6)


def _samples(spec: list[tuple[int, list[int]]], seed: int
             ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Prompt-major samples: each (prompt length, response lengths) is one group."""
    rng = np.random.default_rng(seed)
    prompts, responses = [], []
    for plen, rlens in spec:
        p = rng.integers(1, 50, size=plen, dtype=np.int32)
        for n in rlens:
            prompts.append(p)
            responses.append(rng.integers(1, 50, size=n, dtype=np.int32))
    return prompts, responses


def _visible(segs: np.ndarray, pos: np.ndarray, q: int) -> np.ndarray:
    """Key slots of one row a query slot may read: valid, not after it by position, and in its
    segment or (child ids are (parent + 1) * 65536 + own) in its parent's."""
    sq, sk = int(segs[q]), segs
    parent = sq // 65536 - 1 if sq >= 65536 else None
    seen = (sk == sq) | ((sk == parent) if parent is not None else False)
    return np.flatnonzero(seen & (pos >= 0) & (pos <= pos[q]) & (pos[q] >= 0))


@settings(max_examples=40, deadline=None)
@given(groups, st.integers(0, 2**16), st.sampled_from([None, 0, 8]))
def test_every_slot_sees_exactly_its_own_prompt_and_response_prefix(spec, seed, spare) -> None:
    prompts, responses = _samples(spec, seed)
    longest = max(len(p) + len(r) for p, r in zip(prompts, responses, strict=True))
    row_len = None if spare is None else longest + spare  # tight rows split groups
    lay = shared_prefix_layout(prompts, responses, row_len=row_len)
    tokens, pos, segs = lay.inputs
    assert lay.mask().sum() == sum(len(r) for r in responses)
    for (row, first, n), p, r in zip(lay.spans, prompts, responses, strict=True):
        np.testing.assert_array_equal(lay.targets[row, first:first + n], r)
        for j in range(n):  # slot first + j predicts r[j] from prompt + r[:j]
            keys = _visible(segs[row], pos[row], first + j)
            keys = keys[np.argsort(pos[row, keys])]
            np.testing.assert_array_equal(pos[row, keys], np.arange(len(p) + j))
            np.testing.assert_array_equal(tokens[row, keys], np.concatenate([p, r[:j]]))
    plain = packed_layout(prompts, responses, row_len=lay.shape[1])
    assert lay.useful_tokens <= plain.useful_tokens  # never more slots than unshared


def test_groups_share_their_prompt_once_per_row() -> None:
    prompts, responses = _samples([(20, [3, 4, 5, 6]), (1, [2, 2])], 0)
    lay = shared_prefix_layout(prompts, responses, row_len=64)
    # 19 parent slots + 4 members of 1 + n; the 1-token prompt cannot share (no parent)
    assert lay.useful_tokens == 19 + (4 + 18) + (3 + 3)
    tight = shared_prefix_layout(prompts, responses, row_len=29)  # the group must split
    assert tight.useful_tokens > lay.useful_tokens


def test_rows_with_more_segments_than_ids_encode_are_refused() -> None:
    # 10,923 groups of 3 one-token responses behind 2-token prompts (equal prompts merge
    # groups): more than 32,767 segments, all in one row
    groups = 10_923
    prompts, responses = _samples([(2, [1, 1, 1])] * groups, 0)
    with pytest.raises(InputError,
                       match=r"row would hold \d{5} sequences.*at most 32767.*share_prompts"):
        shared_prefix_layout(prompts, responses, row_len=7 * groups)


def test_a_reasoning_length_row_past_32k_slots_shares_its_prompt() -> None:
    """A 34,816-slot row (cap 32k: the row that broke the cap-32k projection) holds a few
    segments; every response slot still sees exactly its own prompt and response prefix."""
    rng = np.random.default_rng(3)
    p = rng.integers(1, 50, size=40, dtype=np.int32)
    responses = [rng.integers(1, 50, size=n, dtype=np.int32) for n in (33_000, 900, 17)]
    lay = shared_prefix_layout([p] * 3, responses)
    tokens, pos, segs = lay.inputs
    assert lay.shape[1] > (1 << 15) and lay.shape[0] == 1
    assert lay.useful_tokens == 39 + sum(1 + len(r) for r in responses)  # one prompt copy
    for (row, first, n), r in zip(lay.spans, responses, strict=True):
        np.testing.assert_array_equal(lay.targets[row, first:first + n], r)
        for j in (0, n // 2, n - 1):  # slot first + j predicts r[j] from prompt + r[:j]
            keys = _visible(segs[row], pos[row], first + j)
            keys = keys[np.argsort(pos[row, keys])]
            np.testing.assert_array_equal(tokens[row, keys], np.concatenate([p, r[:j]]))


MODELS = {
    "gemmaish": lambda: GemmaishLM(GemmaishConfig(), rngs=nnx.Rngs(3)),
    "gpt2": lambda: GPT2Like(GPTConfig(), rngs=nnx.Rngs(0)),
    "decoder-block-linear": lambda: init_model(
        preset("tiny", n_layers=3, patterns=(Block(4), Linear(), Causal())), 0),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_step_programs_equal_unshared(name: str) -> None:
    cfg = RLConfig.of(algo="grpo", group_size=3, beta=0.1, entropy_coef=0.01, temperature=0.8)
    tr = RLTrainer(MODELS[name](), lambda p, r: 0.0, cfg, system="sym")
    fns = tr.fns("sym")
    rng = np.random.default_rng(0)
    base = [rng.integers(1, tr.vocab_size, n).astype(np.int32) for n in (5, 1, 9)]
    prompts = [p for p in base for _ in range(3)]
    responses = [rng.integers(1, tr.vocab_size, int(n)).astype(np.int32)
                 for n in rng.integers(1, 12, len(prompts))]
    per = [rng.uniform(-1, 1, len(r)).astype(np.float32) for r in responses]
    total = sum(len(r) for r in responses)
    got = []
    for build in (packed_layout, shared_prefix_layout):
        lay = build(prompts, responses, row_len=32)
        inputs = tuple(jnp.asarray(x) for x in lay.inputs)
        arrays = {k: jnp.asarray(v) for k, v in {
            "targets": lay.targets, "mask": lay.mask(),
            "weight": lay.scatter([np.full(len(r), 1 / total, np.float32) for r in responses]),
            "old_lp": lay.scatter([x - 2 for x in per]),
            "ref_lp": lay.scatter([x - 2.5 for x in per]), "adv": lay.scatter(per)}.items()}
        ref = lay.gather(np.asarray(fns["ref"](tr.params["lm"], inputs, arrays["targets"])))
        (loss, _), grads = fns["grad"](tr.params, None, inputs, arrays)
        got.append((ref, float(loss), grads, lay.useful_tokens))
    (ref_a, loss_a, g_a, n_a), (ref_b, loss_b, g_b, n_b) = got
    assert n_b < n_a
    for a, b in zip(ref_a, ref_b, strict=True):
        np.testing.assert_allclose(b, a, atol=1e-5)
    assert loss_b == pytest.approx(loss_a, abs=1e-5)
    for a, b in zip(jax.tree_util.tree_leaves(g_a), jax.tree_util.tree_leaves(g_b), strict=True):
        scale = max(1.0, float(np.max(np.abs(np.asarray(a)))))
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5 * scale)
