"""An RL step on a model that is not ``DecoderLM`` (the GPT-2-like zoo model: learned positions,
LayerNorm with bias, untied head): sym and padded agree on loss, KL and gradients given the same
samples, for GRPO with a KL term and for PPO (value head on the logits)."""

from __future__ import annotations

from functools import cache

import jax
import numpy as np
import pytest
from zoo import GPT2Like, GPTConfig

from jaxrl_sym.rl import RLConfig, RLTrainer, compute_rewards, get_task
from jaxrl_sym.rl.tasks.token_tasks import EOS, VOCAB_SIZE

TASK = get_task("reverse", max_digits=2)
CFG = RLConfig.of(algo="grpo", group_size=2, beta=0.1, epochs=1, eos_id=EOS,
                  max_new_tokens=TASK.max_new_tokens, lr=1e-2)


def _model(seed: int = 0) -> GPT2Like:
    from flax import nnx

    return GPT2Like(GPTConfig(vocab=VOCAB_SIZE, n_layer=2), rngs=nnx.Rngs(seed))


@cache
def setup():
    trainer = RLTrainer(_model(), TASK.reward, CFG)
    prompts = TASK.sample(np.random.default_rng(0), 3)
    rollout = trainer.generate(prompts, seed=1)
    return trainer, rollout, compute_rewards(TASK.reward, rollout.prompts, rollout.responses)


def _compare(trainer, rollout, rewards) -> None:
    loss_s, aux_s, g_s = trainer.loss_and_grads(rollout, rewards, "sym")
    loss_p, aux_p, g_p = trainer.loss_and_grads(rollout, rewards, "padded")
    assert loss_s == pytest.approx(loss_p, abs=1e-5)
    assert aux_s["kl"] == pytest.approx(aux_p["kl"], abs=1e-5)
    ls, lp = jax.tree_util.tree_leaves(g_s), jax.tree_util.tree_leaves(g_p)
    assert len(ls) == len(lp)
    assert max(float(np.abs(np.asarray(a)).max()) for a in ls) > 1e-4  # not vacuous
    for a, b in zip(ls, lp, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)


def test_grpo_with_kl_on_a_gpt2_like_model() -> None:
    trainer, rollout, rewards = setup()
    saved = trainer.params
    trainer.params = jax.tree_util.tree_map(lambda x: x * 1.05, saved)  # KL > 0
    try:
        _compare(trainer, rollout, rewards)
    finally:
        trainer.params = saved


def test_ppo_on_a_gpt2_like_model() -> None:
    _, rollout, rewards = setup()
    ppo = RLTrainer(_model(), TASK.reward, CFG.replace(algo="ppo", beta=0.0), system="padded")
    ppo.params["value"]["w"] = ppo.params["value"]["w"] + 0.01 * np.arange(VOCAB_SIZE)
    _compare(ppo, rollout, rewards)


def test_a_training_step_runs_on_both_systems() -> None:
    """Each system takes a step; given the same prompts and seed they sample the same tokens
    (the step's ``responses_sha256``), and a different seed samples others."""
    digests = {}
    for system in ("sym", "padded"):
        trainer = RLTrainer(_model(1), TASK.reward, CFG, system=system)
        m = trainer.step(TASK.sample(np.random.default_rng(2), 2), seed=3)
        assert np.isfinite(m["loss"]) and trainer.steps_done == 1
        digests[system] = m["responses_sha256"]
    assert digests["sym"] == digests["padded"]
    other = trainer.step(TASK.sample(np.random.default_rng(2), 2), seed=4)
    assert other["responses_sha256"] != digests["padded"]


def test_the_responses_digest_is_of_the_tokens_and_their_split() -> None:
    """``Rollout.responses_sha256`` against hashlib over the tokens as the test lays them out:
    one changed token, or a token moved from one response to the next, changes it; the dtype
    the tokens came in does not."""
    import hashlib

    from jaxrl_sym.rl.step.rollout import Rollout

    def digest(responses: list[list[int]]) -> str:
        h = hashlib.sha256()
        for r in responses:
            h.update(len(r).to_bytes(8, "little", signed=True))
            h.update(b"".join(int(t).to_bytes(8, "little", signed=True) for t in r))
        return h.hexdigest()

    def rollout(responses: list[list[int]], dtype: type = np.int32) -> Rollout:
        return Rollout([np.zeros(1, np.int32)] * len(responses),
                       [np.asarray(r, dtype) for r in responses],
                       [np.zeros(len(r), np.float32) for r in responses], group_size=1)

    base = [[5, 6, 7], [8], []]
    assert rollout(base).responses_sha256 == digest(base)
    assert rollout(base, np.int64).responses_sha256 == digest(base)
    for other in ([[5, 6, 9], [8], []], [[5, 6], [7, 8], []], [[5, 6, 7], [], [8]]):
        assert rollout(other).responses_sha256 == digest(other) != digest(base)
