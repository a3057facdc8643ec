"""Property tests of the RL layer's shape logic (no compiled programs): layouts, the reference
overlap's chunking, micro-batch aux merging. The padded layout is the oracle."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl_sym.rl.algorithms.losses import merge_aux
from jaxrl_sym.systems.layout import Layout, packed_layout, padded_layout
from jaxrl_sym.systems.overlap import ReferenceOverlap

seqs = st.lists(st.tuples(st.integers(1, 40), st.integers(1, 60)), min_size=1, max_size=24)


def _make(lens: list[tuple[int, int]], seed: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(1, 50, size=p, dtype=np.int32) for p, _ in lens]
    responses = [rng.integers(1, 50, size=r, dtype=np.int32) for _, r in lens]
    return prompts, responses


@settings(max_examples=60, deadline=None)
@given(seqs, st.integers(0, 2**16))
def test_packed_layout_predicts_exactly_the_response_tokens(lens, seed) -> None:
    prompts, responses = _make(lens, seed)
    for lay in (packed_layout(prompts, responses), padded_layout(prompts, responses)):
        tokens = lay.inputs[0]
        assert lay.useful_tokens == sum(p + r for p, r in lens)
        assert lay.mask().sum() == sum(r for _, r in lens)  # nothing else is trained on
        for (row, first, n), p, r in zip(lay.spans, prompts, responses, strict=True):
            # the slot before each response token holds the token it is predicted from
            np.testing.assert_array_equal(lay.targets[row, first:first + n], r)
            np.testing.assert_array_equal(tokens[row, first + 1:first + 1 + n], r)
            np.testing.assert_array_equal(tokens[row, first + 1 - len(p):first + 1], p)
        # scatter / gather round trip on per-token values
        vals = [np.arange(len(r), dtype=np.float32) + i for i, r in enumerate(responses)]
        for a, b in zip(lay.gather(lay.scatter(vals)), vals, strict=True):
            np.testing.assert_array_equal(a, b)
        assert 0.0 <= lay.padding_fraction < 1.0


@settings(max_examples=40, deadline=None)
@given(seqs, st.integers(0, 2**16))
def test_packed_sequences_never_share_a_segment(lens, seed) -> None:
    prompts, responses = _make(lens, seed)
    lay = packed_layout(prompts, responses)
    _, positions, segs = lay.inputs
    for row, first, n in lay.spans:
        plen = positions[row, first] + 1  # positions restart at 0 for each sequence
        start = first + 1 - plen
        seg = segs[row, start]
        assert (segs[row, start:first + 1 + n] == seg).all()
        np.testing.assert_array_equal(positions[row, start:first + 1 + n],
                                      np.arange(first + 1 + n - start))


def _fake_ref(lay: Layout) -> np.ndarray:
    """A 'reference model' whose log-prob at a slot is a function of the slot's token and target,
    so a misplaced chunk would give the wrong numbers."""
    return (lay.inputs[0] * 1000 + lay.targets).astype(np.float32)


@settings(max_examples=60, deadline=None)
@given(seqs, st.integers(0, 2**16), st.integers(1, 8), st.randoms(use_true_random=False),
       st.one_of(st.none(), st.integers(1, 3)))
def test_reference_overlap_scores_every_sample_once_in_any_finishing_order(
        lens, seed, min_rows, rnd, max_rows) -> None:
    prompts, responses = _make(lens, seed)
    longest = max(p + r for p, r in lens)
    dispatched: list[int] = []

    def dispatch(lay: Layout) -> np.ndarray:
        dispatched.append(len(lay.spans))
        if max_rows is not None:  # no chunk's program is wider than asked
            assert lay.shape[0] <= max_rows
        return _fake_ref(lay)

    ov = ReferenceOverlap(prompts, max(64, longest), dispatch, min_rows=min_rows,
                          max_rows=max_rows)
    order = list(range(len(lens)))
    rnd.shuffle(order)
    i = 0
    while i < len(order):  # rows finish in batches of random size, in random order
        k = rnd.randint(1, 4)
        batch = order[i:i + k]
        ov.on_finished(batch, [responses[j] for j in batch])
        i += k
    got = ov.collect(len(lens), responses)
    oracle = padded_layout(prompts, responses)
    want = oracle.gather(_fake_ref(oracle))
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)
    assert sum(dispatched) == len(lens)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 5), st.floats(0, 1), st.integers(1, 50)), min_size=1,
                max_size=6))
def test_merge_aux_is_the_token_weighted_whole(parts) -> None:
    auxes = [{"loss": a, "pg_loss": a / 2, "kl": b, "entropy": 2 * b, "clip_frac": b / 3,
              "ratio_max": a + b, "n_tok": float(n)} for a, b, n in parts]
    m = merge_aux(auxes)
    n = sum(x for _, _, x in parts)
    assert m["n_tok"] == n
    assert np.isclose(m["loss"], sum(a for a, _, _ in parts))
    assert np.isclose(m["kl"], sum(b * x for _, b, x in parts) / n)
    assert m["ratio_max"] == max(a + b for a, b, _ in parts)


class _Pending:
    """A dispatched chunk's fake device result: records when the host waited for it."""

    def __init__(self, k: int, waited: set[int]) -> None:
        self.k, self.waited = k, waited

    def block_until_ready(self) -> _Pending:
        self.waited.add(self.k)
        return self


@settings(max_examples=40, deadline=None)
@given(seqs, st.integers(1, 4), st.integers(0, 2**16))
def test_at_most_max_inflight_reference_chunks_are_in_flight(lens, inflight, seed) -> None:
    """When chunk k is dispatched, the host has waited for every chunk up to k - max_inflight:
    never more than ``max_inflight`` hold their temporaries at once (XLA:GPU holds an
    execution's temporaries from its enqueue to its end)."""
    prompts, responses = _make(lens, seed)
    waited: set[int] = set()
    seen: list[set[int]] = []

    def dispatch(lay: Layout) -> _Pending:
        seen.append(set(waited))
        return _Pending(len(seen) - 1, waited)

    ov = ReferenceOverlap(prompts, max(64, max(p + r for p, r in lens)), dispatch, min_rows=1,
                          max_rows=1, max_inflight=inflight)
    for i in range(len(lens)):
        ov.on_finished([i], [responses[i]])
    for k, before in enumerate(seen):
        assert set(range(k - inflight + 1)) <= before, (k, before)
        assert not before & set(range(max(0, k - inflight + 1), k)), (k, before)
