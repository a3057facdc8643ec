"""``RLConfig.optimizer`` / ``--optimizer`` and ``--weight-decay`` (issue 48 item 5).

Oracles: each rule's update written out in numpy from its paper's equations (Adam/AdamW:
Kingma & Ba, Loshchilov & Hutter; Lion: Chen et al. 2023; SGD with an L2 term), run for three
steps on random parameters and gradients and compared with what the trainer's optimiser
(:func:`jaxrl_sym.rl.step.state.make_optimizer`) does; Adafactor by its defining property (factored
second moments: state of O(rows + cols) per matrix) and a descent direction. Then the knob end
to end: ``train --optimizer`` reaches the trainer (the saved optimiser state has the rule's
shape), a resume with another optimiser names the flag, bad values are refused before JAX.
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl_sym.errors import InputError
from jaxrl_sym.rl import RLConfig
from jaxrl_sym.rl.step.state import make_optimizer

B1, B2, EPS = 0.9, 0.999, 1e-8  # optax's adam/adamw defaults
L1, L2 = 0.9, 0.99  # optax's lion defaults


def _adam(p: np.ndarray, gs: list[np.ndarray], lr: float, wd: float) -> np.ndarray:
    mu, nu = np.zeros_like(p), np.zeros_like(p)
    for t, g in enumerate(gs, 1):
        mu = B1 * mu + (1 - B1) * g
        nu = B2 * nu + (1 - B2) * g * g
        mhat, vhat = mu / (1 - B1 ** t), nu / (1 - B2 ** t)
        p = p - lr * (mhat / (np.sqrt(vhat) + EPS) + wd * p)
    return p


def _lion(p: np.ndarray, gs: list[np.ndarray], lr: float, wd: float) -> np.ndarray:
    mu = np.zeros_like(p)
    for g in gs:
        p = p - lr * (np.sign(L1 * mu + (1 - L1) * g) + wd * p)
        mu = L2 * mu + (1 - L2) * g
    return p


def _sgd(p: np.ndarray, gs: list[np.ndarray], lr: float, wd: float) -> np.ndarray:
    for g in gs:
        p = p - lr * (g + wd * p)
    return p


ORACLES = {"adam": _adam, "adamw": _adam, "lion": _lion, "sgd": _sgd}


def _run(cfg: RLConfig, p: np.ndarray, gs: list[np.ndarray]) -> tuple[np.ndarray, object]:
    tx = make_optimizer(cfg.optim, cfg.algorithm.epochs)
    params = {"w": jax.numpy.asarray(p)}
    state = tx.init(params)
    for g in gs:
        upd, state = tx.update({"w": jax.numpy.asarray(g)}, state, params)
        params = jax.tree_util.tree_map(lambda a, b: a + b, params, upd)
    return np.asarray(params["w"]), state


@settings(max_examples=12, deadline=None)
@given(name=st.sampled_from(sorted(ORACLES)), seed=st.integers(0, 2**16),
       lr=st.sampled_from([1e-3, 3e-2]), wd=st.sampled_from([0.0, 0.1]),
       rows=st.integers(1, 5), cols=st.integers(1, 6))
def test_each_rule_equals_its_numpy_oracle(name: str, seed: int, lr: float, wd: float, rows: int,
                                           cols: int) -> None:
    wd = 0.0 if name == "adam" else wd
    rng = np.random.default_rng(seed)
    p = rng.normal(size=(rows, cols)).astype(np.float32)
    gs = [rng.normal(size=(rows, cols)).astype(np.float32) for _ in range(3)]
    got, _ = _run(RLConfig.of(lr=lr, optimizer=name, weight_decay=wd), p, gs)
    want = ORACLES[name](p.astype(np.float64), [g.astype(np.float64) for g in gs], lr, wd)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6 * lr / 1e-3)


def test_adafactor_keeps_factored_moments_and_descends() -> None:
    rng = np.random.default_rng(0)
    p = rng.normal(size=(256, 192)).astype(np.float32)  # optax factors dims >= 128
    g = rng.normal(size=(256, 192)).astype(np.float32)
    got, state = _run(RLConfig.of(lr=1e-2, optimizer="adafactor"), p, [g])
    held = sum(int(np.size(x)) for x in jax.tree_util.tree_leaves(state))
    assert held < p.size // 64  # rows + cols (+ scalars), not rows x cols
    _, adam_state = _run(RLConfig.of(lr=1e-2), p, [g])
    assert sum(int(np.size(x)) for x in jax.tree_util.tree_leaves(adam_state)) >= 2 * p.size
    assert float(np.sum((got - p) * g)) < 0  # a step against the gradient


@pytest.mark.parametrize("kw, flag", [
    ({"optimizer": "rmsprop"}, "optimizer"),
    ({"optimizer": "adam", "weight_decay": 0.1}, "--optimizer adamw"),
    ({"optimizer": "adamw", "weight_decay": -0.1}, "weight_decay"),
    ({"optimizer": "adamw", "weight_decay": float("nan")}, "weight_decay"),
])
def test_bad_optimizer_settings_are_refused_by_name(kw: dict, flag: str) -> None:
    with pytest.raises(InputError, match=flag):
        RLConfig.of(**kw)


def test_cli_optimizer_reaches_the_trainer_and_resume_names_it(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]
                                                               ) -> None:
    from jaxrl_sym.cli import main
    from jaxrl_sym.rl.run.checkpoint import Checkpointer

    run = tmp_path / "run"
    base = ["train", "--task", "reverse", "--prompts", "2", "--group", "2",
            "--max-new-tokens", "4", "--eval-prompts", "0", "--checkpoint-dir", str(run)]
    assert main([*base, "--steps", "1", "--optimizer", "lion", "--weight-decay", "0.1"]) == 0
    assert "recipe: grpo, lion, weight decay 0.1," in capsys.readouterr().err
    ck = Checkpointer(run)
    hp = ck._read_meta(ck.latest_step())["hparams"]["optim"]
    assert (hp["optimizer"], hp["weight_decay"]) == ("lion", 0.1)
    assert main([*base, "--steps", "2", "--optimizer", "adamw", "--weight-decay", "0.1",
                 "--resume"]) == 2
    err = capsys.readouterr().err
    assert "--optimizer (optimizer): checkpoint 'lion', given 'adamw'" in err, err
    assert main([*base, "--steps", "2", "--optimizer", "adam", "--weight-decay", "0.1"]) == 2
    assert "use --optimizer adamw" in capsys.readouterr().err


@pytest.mark.parametrize("name, moments", [("adam", 2), ("adamw", 2), ("lion", 1), ("sgd", 0)])
def test_the_trainer_holds_its_rules_state(name: str, moments: int) -> None:
    """The trainer's optimiser state is the chosen rule's: Adam's two moments per weight,
    Lion's one, SGD's none (plus scalars: step count, injected rate and decay)."""
    from jaxrl_sym.models.lm import init_model, preset
    from jaxrl_sym.rl import RLTrainer
    from jaxrl_sym.rl.tasks.token_tasks import get_task

    tr = RLTrainer(init_model(preset("tiny"), 0), get_task("reverse").reward,
                   RLConfig.of(group_size=2, optimizer=name), system="padded")
    n = sum(int(np.size(x)) for x in jax.tree_util.tree_leaves(tr.params))
    held = sum(int(np.size(x)) for x in jax.tree_util.tree_leaves(tr.opt_state))
    assert moments * n <= held <= moments * n + 8, (held, n)


def test_the_step_reports_the_rate_its_update_used() -> None:
    """``current_lr`` (each step's ``lr`` metric) reads the rate injected into the optimiser
    state: during a 2-step warm-up to 2e-3, the first update's rate is 1e-3, the second's
    1.5e-3 (optax's linear schedule from lr / warm-up)."""
    import jax.numpy as jnp

    from jaxrl_sym.rl.step.state import current_lr

    tx = make_optimizer(RLConfig.of(lr=2e-3, warmup_steps=2).optim, 1)
    params = {"w": jnp.zeros(3)}
    state = tx.init(params)
    rates = []
    for _ in range(2):
        _, state = tx.update({"w": jnp.ones(3)}, state, params)
        rates.append(current_lr(state))
    assert rates == pytest.approx([1e-3, 1.5e-3], rel=1e-6)
