"""LoRA in the RL trainer: adapters trained over a frozen base that is also the reference.

Oracles that share no LoRA code: the plain model's own leaves (at initialisation the merged
policy *is* the base, bit for bit), and the full fine-tuning trainer's gradient w.r.t. each
weight ``W``: with ``B = 0`` at initialisation the chain rule through ``W + s·A@B`` gives
``dL/dB = s·Aᵀ·dL/dW`` and ``dL/dA = 0``, computed here in numpy from the full gradient.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import jax
import numpy as np
import pytest
from flax import nnx

from jaxrl_sym.errors import InputError
from jaxrl_sym.models.lm import init_model, preset
from jaxrl_sym.rl import RLConfig, RLTrainer, compute_rewards, get_task
from jaxrl_sym.rl.tasks.token_tasks import EOS, VOCAB_SIZE
from jaxrl_sym.weights.lora_config import LoraConfig

TASK = get_task("reverse", max_digits=3)
MODEL = preset("tiny", vocab_size=VOCAB_SIZE)
CFG = RLConfig.of(algo="grpo", group_size=4, beta=0.1, eos_id=EOS,
                  max_new_tokens=TASK.max_new_tokens, lr=1e-2, max_grad_norm=None)
LORA = LoraConfig(rank=4, alpha=8.0)


def _leaves(model: nnx.Module) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(nnx.state(model))]


@cache
def setup() -> tuple[RLTrainer, RLTrainer, Any, np.ndarray]:
    lora = RLTrainer(init_model(MODEL, 0), TASK.reward, CFG, system="padded", lora=LORA)
    full = RLTrainer(init_model(MODEL, 0), TASK.reward, CFG, system="padded")
    rollout = full.generate(TASK.sample(np.random.default_rng(0), 4), seed=1)
    rewards = compute_rewards(TASK.reward, rollout.prompts, rollout.responses)
    return lora, full, rollout, rewards


def test_at_initialisation_the_policy_and_the_reference_are_the_base_model() -> None:
    lora, _, _, _ = setup()
    base = _leaves(init_model(MODEL, 0))
    assert all(np.array_equal(a, b) for a, b in zip(_leaves(lora.model()), base, strict=True))
    # what generation reads: the adapters (B = 0), then the frozen base itself, unmerged: no
    # second copy of the model's weights
    got = lora.policy_leaves()
    n = 2 * len(lora.view.lora.indices)
    assert all(x is y for x, y in zip(got[n:], lora.state.frozen, strict=True))
    assert not any(np.any(np.asarray(b)) for b in got[1:n:2])
    assert all(np.array_equal(np.asarray(a), b) for a, b in zip(got[n:], base, strict=True))
    # adapters off: the reference is the frozen base itself, no second copy
    assert lora.state.ref is lora.state.frozen
    assert all(np.array_equal(np.asarray(a), b)
               for a, b in zip(lora.state.frozen, base, strict=True))


def test_adapter_gradients_follow_from_the_full_gradient() -> None:
    lora, full, rollout, rewards = setup()
    _, aux_l, g_lora = lora.loss_and_grads(rollout, rewards, "padded")
    _, aux_f, g_full = full.loss_and_grads(rollout, rewards, "padded")
    np.testing.assert_allclose(aux_l["loss"], aux_f["loss"], rtol=1e-6, atol=1e-7)
    plan = lora.view.lora
    assert plan is not None and len(plan.indices) > 0
    for j, i in enumerate(plan.indices):
        a = np.asarray(lora.params["lm"][j]["a"], np.float64)
        d_w = np.asarray(g_full["lm"][i], np.float64)
        want_b = plan.scale * a.T @ d_w
        np.testing.assert_allclose(np.asarray(g_lora["lm"][j]["b"]), want_b, rtol=1e-4,
                                   atol=1e-6 * max(1.0, np.abs(want_b).max()))
        assert not np.any(np.asarray(g_lora["lm"][j]["a"]))  # B = 0: no gradient reaches A


def test_a_step_trains_the_adapters_only_and_keeps_the_base() -> None:
    tr = RLTrainer(init_model(MODEL, 0), TASK.reward, CFG, system="sym", lora=LORA)
    base = [np.asarray(x) for x in tr.state.frozen]
    per = tr.state_bytes_per_param()
    # adapters (rank 4 on 64-wide layers): under a quarter of full fine-tuning's 4 + 8 B/param
    assert per["master"] < 1.0 and per["optimizer"] < 2.0
    tr.step(TASK.sample(np.random.default_rng(0), 4), seed=0)
    assert all(np.array_equal(np.asarray(a), b) for a, b in zip(tr.state.frozen, base,
                                                                strict=True))
    assert any(np.any(np.asarray(ad["b"])) for ad in tr.params["lm"])  # B moved off zero
    # generation reads the merged weights, refreshed after the update
    merged = [np.asarray(x) for x in tr.policy_leaves()]
    assert any(not np.array_equal(m, b) for m, b in zip(merged, base, strict=True))
    got = [np.asarray(x) for x in tr.engine.leaves]
    assert all(np.array_equal(g, m) for g, m in zip(got, merged, strict=True))


def test_resume_of_a_lora_run_is_bit_identical(tmp_path: Any) -> None:
    from jaxrl_sym.rl.run.train import train

    kw = dict(task="reverse", prompts_per_step=2, group_size=2, eval_prompts=0, progress=False,
              model={"n_layers": 1}, lora={"rank": 2}, beta=0.1)
    straight = train(steps=2, checkpoint_dir=str(tmp_path / "a"), **kw)
    train(steps=1, checkpoint_dir=str(tmp_path / "b"), **kw)
    resumed = train(steps=2, checkpoint_dir=str(tmp_path / "b"), resume=True, **kw)
    assert resumed["resumed_from"] == 1
    assert resumed["params_sha256"] == straight["params_sha256"]
    with pytest.raises(Exception, match="lora"):
        train(steps=3, checkpoint_dir=str(tmp_path / "b"), resume=True,
              **{**kw, "lora": {"rank": 3}})


def test_bad_lora_input_is_refused_by_name() -> None:
    from jaxrl_sym.rl.run.cli import lora_of

    class Args:
        lora_rank, lora_alpha, lora_targets = None, 4.0, None

    with pytest.raises(InputError, match="--lora-alpha set without --lora-rank"):
        lora_of(Args())
    Args.lora_rank, Args.lora_targets = 2, "nothing_matches"
    cfg = lora_of(Args())
    with pytest.raises(InputError, match="nothing_matches"):
        RLTrainer(init_model(MODEL, 0), TASK.reward, CFG, system="padded", lora=cfg)
    with pytest.raises(InputError, match="--mesh"):
        RLTrainer(init_model(MODEL, 0), TASK.reward, CFG, system="padded", lora=LORA,
                  mesh="data=1")


def test_the_ledger_holds_the_frozen_base_once_and_no_second_reference() -> None:
    from jaxrl_sym.rl.step.ledger import step_ledger

    lora, _, _, _ = setup()
    prompts = [p for p in TASK.sample(np.random.default_rng(0), 2)
               for _ in range(CFG.algorithm.group_size)]
    led = step_ledger(lora, prompts, [TASK.max_new_tokens] * len(prompts)).ledger.to_dict()
    names = [b["name"] for b in led["peak"]["buffers"]]
    assert "frozen base weights (LoRA)" in names and "reference weights" not in names
    base = sum(int(np.asarray(x).nbytes) for x in lora.state.frozen)
    got = next(b["bytes"] for b in led["peak"]["buffers"] if b["name"].startswith("frozen"))
    assert got == base


@pytest.mark.parametrize("system", ["padded", "sym"])
def test_generation_reads_the_base_unmerged_and_the_adapters_renew_at_the_commit(
        system: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bound systems read the frozen base itself (the state's arrays, never a merged copy)
    and the adapters; the adapters' forward copies are not alive while the update runs (its
    peak) and the systems hold only shapes; after the commit the bound model's logits equal the
    merged-weight oracle of the new adapters (``test_lora.oracle_forward``, no LoRA code), and
    a second step generates from it."""
    from test_lora import oracle_forward, run

    from jaxrl_sym.rl.step import stages

    trainer = RLTrainer(init_model(MODEL, 0), TASK.reward, CFG, system=system, lora=LORA)
    bound = trainer.forwards.bound(trainer.system)
    n = 2 * len(trainer.view.lora.indices)
    assert all(x is y for x, y in zip(bound.leaves[n:], trainer.state.frozen, strict=True))
    before = {id(x) for x in bound.leaves[:n]}
    seen: dict[str, Any] = {}
    real = stages.update

    def spy(ctx, state, layout, arrays):
        seen["alive"] = before & {id(x) for x in jax.live_arrays()}
        seen["abstract"] = all(isinstance(x, jax.ShapeDtypeStruct) for x in bound.leaves)
        seen["engine"] = getattr(getattr(bound, "lm", None), "leaves", None)
        return real(ctx, state, layout, arrays)

    monkeypatch.setattr(stages, "update", spy)
    trainer.step(TASK.sample(np.random.default_rng(3), 2), seed=3)
    assert seen["alive"] == set() and seen["abstract"] and seen["engine"] is None
    st = trainer.state
    assert all(x is y for x, y in zip(bound.leaves[n:], st.frozen, strict=True))
    plan = trainer.view.lora
    by_name = {name: (np.asarray(ad["a"]), np.asarray(ad["b"]))
               for name, ad in zip(plan.names, st.params["lm"], strict=True)}
    assert any(np.any(b) for _, b in by_name.values())  # the step moved the adapters
    want = oracle_forward(init_model(MODEL, 0), by_name, plan.scale)
    np.testing.assert_allclose(np.asarray(run(bound.model)), np.asarray(want), rtol=1e-5,
                               atol=1e-5)
    monkeypatch.setattr(stages, "update", real)
    trainer.step(TASK.sample(np.random.default_rng(4), 2), seed=4)  # generates from the new one
