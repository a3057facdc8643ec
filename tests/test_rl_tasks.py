"""RL pieces that need no compiled program: tasks, rewards, advantages, layouts, validation."""

from __future__ import annotations

import numpy as np
import pytest

from jaxrl_sym.errors import InputError, SymError
from jaxrl_sym.rl import OptimizerConfig, RewardError, RLConfig, compute_rewards, get_task
from jaxrl_sym.rl.algorithms.advantages import (
    gae,
    informative_samples,
    sample_advantages,
    token_weights,
    whiten,
)
from jaxrl_sym.rl.tasks.token_tasks import (
    BOS,
    EOS,
    PLUS,
    SEP,
    TASK_NAMES,
    VOCAB_SIZE,
    partial_credit,
)
from jaxrl_sym.systems.layout import packed_layout, padded_layout


@pytest.mark.parametrize("name", TASK_NAMES)
def test_tasks_vary_lengths_and_stay_in_vocab(name: str) -> None:
    task = get_task(name, max_digits=3)
    prompts = task.sample(np.random.default_rng(0), 200)
    lens = {len(p) for p in prompts}
    answers = {len(task.answer(p)) for p in prompts}
    assert len(lens) >= 3 and len(answers) >= 2, (lens, answers)
    for p in prompts:
        assert p[0] == BOS and p[-1] == SEP and p.min() >= 0 and p.max() < VOCAB_SIZE
        assert len(task.answer(p)) <= task.max_answer_len
        # the exact target scores 1 on both the reward and the metric
        assert task.reward(p, task.target(p)) == 1.0
        assert task.exact_match(p, task.target(p)) == 1.0


def test_task_answers() -> None:
    d = lambda *xs: np.array([BOS, *xs, SEP], np.int32)
    assert get_task("reverse").answer(d(1, 2, 3)) == [3, 2, 1]
    assert get_task("copy").answer(d(1, 2, 3)) == [1, 2, 3]
    assert get_task("sort").answer(d(3, 1, 2, 1)) == [1, 1, 2, 3]
    assert get_task("add").answer(d(9, 5, PLUS, 7)) == [1, 0, 2]


def test_partial_credit_is_positionwise() -> None:
    task = get_task("reverse")
    p = np.array([BOS, 1, 2, 3, SEP], np.int32)  # target 3 2 1 EOS
    assert task.reward(p, [3, 2, 1, EOS]) == 1.0
    assert task.reward(p, [3, 2, 9, EOS]) == 0.75
    assert task.reward(p, [3, 2, 1, 5, EOS]) == pytest.approx(3 / 5)  # rambling costs
    assert task.reward(p, [3]) == 0.25  # stopping short costs
    assert task.exact_match(p, [3, 2, 1, 5]) == 0.0
    assert partial_credit([], []) == 1.0


def test_unknown_task_is_a_clear_error() -> None:
    with pytest.raises(InputError, match=r"unknown task 'revers'.*reverse, copy, sort, add"):
        get_task("revers")


def test_advantages_grpo_rloo() -> None:
    r = np.array([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5])
    g = sample_advantages(r, 4, "grpo", 0.0)
    np.testing.assert_allclose(g[:4], [1, -1, -1, 1], atol=1e-6)
    np.testing.assert_allclose(g[4:], 0.0, atol=1e-6)  # equal rewards teach nothing, no NaN
    lo = sample_advantages(r, 4, "rloo", 0.0)
    np.testing.assert_allclose(lo[:4], [1 - 1 / 3, -2 / 3, -2 / 3, 1 - 1 / 3], atol=1e-6)
    with pytest.raises(InputError, match="groups of 3"):
        sample_advantages(r, 3, "grpo", 0.0)


def test_gae_matches_closed_form() -> None:
    # lambda = 1, gamma = 1: advantage = return-to-go - value
    advs, rets = gae([np.array([0.0, 0.0, 1.0])], [np.array([0.2, 0.5, 0.7])], 1.0, 1.0)
    np.testing.assert_allclose(advs[0], [0.8, 0.5, 0.3], atol=1e-6)
    np.testing.assert_allclose(rets[0], [1.0, 1.0, 1.0], atol=1e-6)
    # lambda = 0: one-step TD errors
    advs, _ = gae([np.array([0.0, 2.0])], [np.array([1.0, 3.0])], 0.5, 0.0)
    np.testing.assert_allclose(advs[0], [0.0 + 0.5 * 3.0 - 1.0, 2.0 - 3.0], atol=1e-6)
    w = whiten([np.array([1.0, 2.0]), np.array([3.0])])
    assert abs(np.concatenate(w).mean()) < 1e-6


def test_token_weights_sum_to_one() -> None:
    for agg in ("token_mean", "seq_mean"):
        w = token_weights([1, 3, 4], agg)
        assert sum(float(x.sum()) for x in w) == pytest.approx(1.0)
    assert token_weights([1, 3], "seq_mean")[0][0] == pytest.approx(0.5)


def test_layouts_place_response_slots_identically() -> None:
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 10, size=n).astype(np.int32) for n in (3, 1, 7, 2)]
    resps = [rng.integers(0, 10, size=n).astype(np.int32) for n in (2, 5, 1, 4)]
    per_tok = [np.arange(len(r), dtype=np.float32) + 10 * i for i, r in enumerate(resps)]
    for lay in (packed_layout(prompts, resps), padded_layout(prompts, resps)):
        # each response slot predicts exactly its response token
        for i, (r, s, n) in enumerate(lay.spans):
            np.testing.assert_array_equal(lay.targets[r, s:s + n], resps[i])
        back = lay.gather(lay.scatter(per_tok))
        for a, b in zip(back, per_tok, strict=True):
            np.testing.assert_array_equal(a, b)
        assert lay.mask().sum() == sum(len(r) for r in resps)
        assert lay.useful_tokens == sum(len(p) + len(r) for p, r in zip(prompts, resps,
                                                                         strict=True))
    pad = padded_layout(prompts, resps)
    assert pad.shape == (4, 7 + 5)  # max prompt + max response, like padded RL libraries
    with pytest.raises(InputError, match="sample 1 has an empty prompt"):
        packed_layout([prompts[0], np.zeros(0, np.int32)], resps[:2])


def test_reward_validation_names_the_sample() -> None:
    ps = [np.array([1, 2], np.int32)] * 3
    rs = [np.array([3], np.int32), np.array([4], np.int32), np.array([5], np.int32)]

    def boom(p, r):
        if r[0] == 4:
            raise ZeroDivisionError("bad sample")
        return 1.0

    with pytest.raises(RewardError, match=r"raised on sample 1 .*ZeroDivisionError") as e:
        compute_rewards(boom, ps, rs)
    assert e.value.sample == 1 and isinstance(e.value, SymError)
    with pytest.raises(RewardError, match=r"shape \(2,\).*sample 0"):
        compute_rewards(lambda p, r: np.zeros(2), ps, rs)
    with pytest.raises(RewardError, match=r"returned nan on sample 2"):
        compute_rewards(lambda p, r: float("nan") if r[0] == 5 else 0.0, ps, rs)
    with pytest.raises(RewardError, match="sample 0"):
        compute_rewards(lambda p, r: "1.0", ps, rs)
    with pytest.raises(RewardError, match="sample 0"):
        compute_rewards(lambda p, r: True, ps, rs)
    np.testing.assert_array_equal(compute_rewards(lambda p, r: np.float32(r[0]), ps, rs),
                                  [3, 4, 5])


class _Batch:
    """A batch reward recording its calls: ``values(responses)`` gives what it returns."""

    def __init__(self, values):
        self.values, self.calls = values, []

    def score_batch(self, prompts, responses):
        self.calls.append(len(responses))
        return self.values(responses)


def test_a_batch_reward_is_called_once_per_step_and_checked_per_sample() -> None:
    ps = [np.array([1, 2], np.int32)] * 3
    rs = [np.array([3], np.int32), np.array([4], np.int32), np.array([5], np.int32)]
    batch = _Batch(lambda rs: [float(r[0]) * 2 for r in rs])
    np.testing.assert_array_equal(compute_rewards(batch, ps, rs), [6, 8, 10])
    assert batch.calls == [3]
    with pytest.raises(RewardError, match=r"returned nan on sample 1"):
        compute_rewards(_Batch(lambda rs: [0.0, float("nan"), 0.0]), ps, rs)
    with pytest.raises(RewardError, match=r"returned 2 rewards for 3 samples"):
        compute_rewards(_Batch(lambda rs: [0.0, 1.0]), ps, rs)
    with pytest.raises(RewardError, match=r"raised on the step's 3 samples: KeyError"):
        compute_rewards(_Batch(lambda rs: {}["x"]), ps, rs)
    with pytest.raises(RewardError, match=r"shape \(2,\).*sample 2"):
        compute_rewards(_Batch(lambda rs: [0.0, 0.0, np.zeros(2)]), ps, rs)


def test_config_validation() -> None:
    with pytest.raises(InputError, match="algo='dpo'"):
        RLConfig.of(algo="dpo")
    with pytest.raises(InputError, match="group_size=1"):
        RLConfig.of(algo="grpo", group_size=1)
    with pytest.raises(InputError, match="temperature"):
        RLConfig.of(temperature=0.0)
    RLConfig.of(algo="ppo", group_size=1)  # PPO has a critic, no group needed


def test_partial_weight_makes_the_exact_answer_dominant() -> None:
    p = np.array([BOS, 1, 2, 3, SEP], np.int32)  # target 3 2 1 EOS
    half = get_task("reverse", partial_weight=0.5)
    assert half.reward(p, [3, 2, 1, EOS]) == 1.0
    assert half.reward(p, [3, 2, 9, EOS]) == pytest.approx(0.375)  # 0.5 x 3/4
    assert get_task("reverse", partial_weight=0.0).reward(p, [3, 2, 9, EOS]) == 0.0
    with pytest.raises(InputError, match=r"partial_weight=1\.5 \(--partial-weight\)"):
        get_task("reverse", partial_weight=1.5)


def test_advantage_normalisations() -> None:
    r = np.array([1.0, 0.0, 0.0, 1.0, 0.6, 0.5, 0.5, 0.5, 0.2, 0.2, 0.2, 0.2])
    none = sample_advantages(r, 4, "grpo", 0.0, "none")
    np.testing.assert_allclose(none[:8], r[:8] - np.repeat([0.5, 0.525], 4), atol=1e-6)
    np.testing.assert_allclose(none[8:], 0.0)
    # batch_std: one scale for the batch, so the near-equal group stays small
    b = sample_advantages(r, 4, "grpo", 0.0, "batch_std")
    assert abs(b[4]) < abs(b[0]) and np.all(b[8:] == 0)
    g = sample_advantages(r, 4, "grpo", 0.0, "group_std")
    assert abs(g[4]) == pytest.approx(abs(g[0]) * np.sqrt(3), rel=1e-5)  # blown up to unit std
    np.testing.assert_array_equal(informative_samples(r, 4), [True] * 8 + [False] * 4)


def test_token_sum_and_dropped_groups_weights() -> None:
    w = token_weights([1, 3, 4], "token_sum", max_new_tokens=5)
    assert all(np.allclose(x, 1 / 15) for x in w)  # 3 sequences x 5 slots
    keep = [True, False, True]
    for agg in ("token_mean", "seq_mean"):
        w = token_weights([1, 3, 4], agg, keep=keep)
        assert float(w[1].sum()) == 0.0
        assert sum(float(x.sum()) for x in w) == pytest.approx(1.0)
    assert all(float(x.sum()) == 0 for x in token_weights([2, 2], "seq_mean", keep=[0, 0]))


def test_stabiliser_config_validation() -> None:
    with pytest.raises(InputError, match=r"loss_agg='sum'.*token_mean, seq_mean, token_sum"):
        RLConfig.of(loss_agg="sum")
    with pytest.raises(InputError, match="adv_norm='std'"):
        RLConfig.of(adv_norm="std")
    with pytest.raises(InputError, match=r"lr_schedule='cosine' \(--lr-schedule\).*total_steps"):
        RLConfig.of(lr_schedule="cosine", warmup_steps=10)
    with pytest.raises(InputError, match=r"warmup_steps=-1 \(--warmup-steps\)"):
        RLConfig.of(warmup_steps=-1)
    with pytest.raises(InputError, match=r"clip_eps=1\.0 \(--clip-low\)"):
        RLConfig.of(clip_eps=1.0)
    with pytest.raises(InputError, match="clip_eps_high=nan"):
        RLConfig.of(clip_eps_high=float("nan"))
    RLConfig.of(lr_schedule="linear", warmup_steps=10, total_steps=11)


def test_lr_schedule_warms_up_and_decays() -> None:
    from jaxrl_sym.rl.step.state import lr_schedule

    cfg = RLConfig.of(lr=1e-3, warmup_steps=10, lr_schedule="cosine", total_steps=100,
                      min_lr_ratio=0.1, epochs=2)
    f = lr_schedule(cfg.optim, cfg.algorithm.epochs)
    # counted in optimiser updates: 2 per RL step
    assert float(f(0)) < float(f(10)) < float(f(19)) <= 1e-3
    assert float(f(20)) == pytest.approx(1e-3)
    assert float(f(200)) == pytest.approx(1e-4)
    const = lr_schedule(OptimizerConfig(lr=1e-3, warmup_steps=4), 1)
    assert float(const(0)) == pytest.approx(2.5e-4) and float(const(1000)) == pytest.approx(1e-3)
