"""``jaxrl_sym.workloads.reasoning_rollout``: a GRPO step's request on the reasoning profile
(``bench reasoning``, ``project/dispatch --cap``). Checked against the profile it draws from
(:func:`jaxrl_sym.workloads.reasoning`, itself tested against scipy/erf oracles in
``tests/test_workloads.py``) and the GRPO shape: a group's samples share one prompt."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl_sym.workloads import reasoning, reasoning_rollout


@settings(max_examples=25, deadline=None)
@given(prompts=st.integers(1, 12), group=st.integers(2, 8),
       cap=st.sampled_from([64, 512, 4096, 16384]), vocab=st.integers(2, 50_000),
       seed=st.integers(0, 2**20))
def test_rollout_is_the_profiles_draw_in_grpo_shape(prompts: int, group: int, cap: int,
                                                     vocab: int, seed: int) -> None:
    toks, limits = reasoning_rollout(prompts=prompts, group=group, cap=cap, vocab=vocab,
                                     seed=seed)
    step = reasoning(prompts * group, cap=cap, seed=seed)
    assert len(toks) == prompts and len(limits) == prompts * group
    assert tuple(limits) == step.response_lens  # the profile's responses, prompt-major
    assert all(1 <= n <= cap for n in limits)
    for g, t in enumerate(toks):  # a group's prompt: its first row's length, ids < vocab
        assert t.dtype == np.int32 and len(t) == step.prompt_lens[g * group]
        assert t.min() >= 0 and t.max() < vocab
    again, limits2 = reasoning_rollout(prompts=prompts, group=group, cap=cap, vocab=vocab,
                                       seed=seed)
    assert limits2 == limits and all(np.array_equal(a, b) for a, b in zip(toks, again,
                                                                           strict=True))


def test_the_median_is_far_below_the_cap_and_some_rows_hit_it() -> None:
    """The regime the experiment is about: median ~cap/16, a share truncated at the cap."""
    _, limits = reasoning_rollout(prompts=256, group=8, cap=16384, vocab=1000, seed=0)
    arr = np.asarray(limits)
    assert 700 < np.median(arr) < 1400
    assert 0.001 < np.mean(arr == 16384) < 0.05
