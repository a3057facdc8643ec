"""Training in reduced precision: the optimiser step in bf16 against a numpy Adam.

Why: optax's ``inject_hyperparams`` casts its hyperparameters to the parameters' dtype, and in
bfloat16 ``b2 = 0.999`` rounds to 1.0, which made Adam's bias correction zero and every bf16
model's first update NaN. The oracle is Adam written out in numpy (float64), then rounded to
bf16 once, as the update does.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from jax.extend import core as jcore

from jaxrl_sym.errors import InputError
from jaxrl_sym.models.lm import init_model, preset
from jaxrl_sym.rl import RLConfig, RLTrainer, get_task
from jaxrl_sym.rl.step.programs import _guarded_step
from jaxrl_sym.rl.step.state import make_optimizer
from jaxrl_sym.rl.tasks.token_tasks import EOS, VOCAB_SIZE
from jaxrl_sym.weights.precision import Precision
from jaxrl_sym.weights.view import WeightView, check_precision


def _numpy_adam(p: np.ndarray, g: np.ndarray, lr: float, b1: float = 0.9, b2: float = 0.999,
                eps: float = 1e-8) -> np.ndarray:
    m, v = (1 - b1) * g, (1 - b2) * g * g
    m_hat, v_hat = m / (1 - b1), v / (1 - b2)
    return p - lr * m_hat / (np.sqrt(v_hat) + eps)


def test_a_bf16_adam_step_equals_numpy_adam_and_keeps_the_dtypes() -> None:
    cfg = RLConfig.of(algo="grpo", lr=1e-2, eos_id=0, max_grad_norm=None)
    tx = make_optimizer(cfg.optim, cfg.algorithm.epochs)
    rng = np.random.default_rng(0)
    p = rng.normal(size=(64,)).astype(ml_dtypes.bfloat16)
    g = (rng.normal(size=(64,)) * 1e-3).astype(ml_dtypes.bfloat16)
    params, grads = {"w": jnp.asarray(p)}, {"w": jnp.asarray(g)}
    state = tx.init(params)
    new_p, new_s = jax.jit(lambda a, b, c: _guarded_step(tx, a, b, c, jnp.bool_(True)))(
        params, state, grads)
    want = _numpy_adam(p.astype(np.float64), g.astype(np.float64), cfg.optim.lr)
    got = np.asarray(new_p["w"]).astype(np.float64)
    assert np.all(np.isfinite(got))
    # one bf16 rounding of the result (8 significant bits: relative 2**-8)
    np.testing.assert_allclose(got, want, rtol=2**-8, atol=0)
    assert new_p["w"].dtype == jnp.bfloat16
    dtypes = lambda t: [x.dtype for x in jax.tree_util.tree_leaves(t)]
    assert dtypes(new_s) == dtypes(state)  # written over the donated buffers of the old state


# ------------------------------------------------------------------ the policy on a trainer
TASK = get_task("reverse", max_digits=3)
CFG = RLConfig.of(algo="grpo", group_size=4, beta=0.1, eos_id=EOS,
                  max_new_tokens=TASK.max_new_tokens, lr=1e-3)


def _dots(fn: Any, *args: Any) -> list[tuple[str, ...]]:
    """The operand dtypes of every dot_general in ``fn``'s jaxpr (nested jaxprs included)."""
    out: list[tuple[str, ...]] = []

    def walk(jaxpr: Any) -> None:
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                out.append(tuple(str(v.aval.dtype) for v in eqn.invars))
            for sub in jcore.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return out


def test_the_compute_model_computes_in_bf16_and_its_logits_stay_float32() -> None:
    model = init_model(preset("tiny", vocab_size=VOCAB_SIZE), 0)
    graphdef, state = nnx.split(model)
    leaves, treedef = jax.tree_util.tree_flatten(state)
    view = WeightView(Precision("bf16-mixed"), leaves)
    bf = view.compute_model(graphdef, treedef, leaves)
    tokens = jnp.asarray(np.arange(12, dtype=np.int32).reshape(2, 6) % VOCAB_SIZE)
    pos = jnp.tile(jnp.arange(6, dtype=jnp.int32), (2, 1))
    seg = jnp.ones((2, 6), jnp.int32)
    dots = _dots(lambda t, p, s: bf(t, p, s), tokens, pos, seg)
    projections = [d for d in dots if d != ("float32", "float32")]
    # every projection (q/k/v/o, gate/up/down per layer) reads bf16; only the head is fp32
    # (DecoderLM.head casts to float32 on purpose)
    assert projections and all(d == ("bfloat16", "bfloat16") for d in projections)
    assert len(dots) - len(projections) <= 1 + 2 * model.cfg.n_layers  # head (+ attention)
    logits = bf(tokens, pos, seg)
    want = model(tokens, pos, seg)
    assert logits.dtype == jnp.float32
    # the same model to bf16 rounding: close, not equal
    assert 0 < float(jnp.max(jnp.abs(logits - want))) < 0.1 * float(jnp.max(jnp.abs(want)))
    # the caller's model is untouched (fp32 modules and leaves)
    assert model.layers[0].attn.q_proj.dtype == jnp.float32
    assert {x.dtype for x in jax.tree_util.tree_leaves(nnx.state(model))} == {jnp.dtype("float32")}


@pytest.mark.parametrize("system", ["sym", "padded"])
def test_bf16_mixed_keeps_fp32_masters_and_generates_from_a_bf16_copy(system: str) -> None:
    model = init_model(preset("tiny", vocab_size=VOCAB_SIZE), 0)
    start = [np.asarray(x) for x in jax.tree_util.tree_leaves(nnx.state(model))]
    tr = RLTrainer(model, TASK.reward, CFG, system=system, precision="bf16-mixed")
    assert {x.dtype for x in tr.params["lm"]} == {jnp.dtype("float32")}
    assert {x.dtype for x in tr.state.ref} == {jnp.dtype("bfloat16")}
    if system == "sym":
        assert {str(s.dtype) for s in tr.engine.plan.specs.values()} == {"bfloat16"}
    tr.step(TASK.sample(np.random.default_rng(0), 4), seed=0)
    after = [np.asarray(x) for x in tr.params["lm"]]
    assert all(np.all(np.isfinite(a)) for a in after)
    # updates accumulate in fp32: some weights moved by less than half a bf16 step of their
    # value, which a bf16 master could not have stored
    tiny = 0
    for a, b in zip(after, start, strict=True):
        step = np.abs(b) * 2.0 ** -8
        moved = (a != b) & (np.abs(a - b) < step / 2)
        tiny += int(moved.sum())
    assert tiny > 0
    # the generation copy is the new master in bf16, refreshed after the update
    if system == "sym":
        want = [np.asarray(jnp.asarray(x).astype(jnp.bfloat16)) for x in tr.params["lm"]]
        got = [np.asarray(x) for x in tr.engine.leaves]
        assert all(np.array_equal(g, w) for g, w in zip(got, want, strict=True))
    assert {x.dtype for x in jax.tree_util.tree_leaves(nnx.state(tr.model()))} == {
        jnp.dtype("float32")}


def test_precision_names_and_defaults() -> None:
    assert Precision.of(None, pretrained=True, platform="gpu").name == "bf16-mixed"
    assert Precision.of(None, pretrained=True, platform="cpu").name == "fp32"
    assert Precision.of(None, pretrained=False, platform="gpu").name == "fp32"
    with pytest.raises(InputError, match="--precision"):
        Precision("fp16")


def test_a_gpu_without_bf16_units_is_refused_by_name() -> None:
    class Old:
        platform, compute_capability, device_kind = "gpu", "7.5", "Tesla T4"

    with pytest.raises(InputError, match=r"Tesla T4.*--precision fp32"):
        check_precision(Precision("bf16-mixed"), [Old()])
    check_precision(Precision("fp32"), [Old()])  # fp32 runs anywhere


def test_a_run_records_its_precision_and_a_resume_in_another_is_refused(tmp_path: Any) -> None:
    from jaxrl_sym.rl.run.train import ResumeMismatchError, train

    kw = dict(task="reverse", steps=1, prompts_per_step=2, group_size=2, eval_prompts=0,
              progress=False, checkpoint_dir=str(tmp_path / "run"), model={"n_layers": 1})
    out = train(precision="bf16-mixed", **kw)
    assert out["steps"] == 1
    with pytest.raises(ResumeMismatchError, match=r"--precision \(precision\)"):
        train(precision="fp32", resume=True, **{**kw, "steps": 2})
    with pytest.raises(InputError, match="--precision"):
        train(precision="fp16", **{**kw, "checkpoint_dir": str(tmp_path / "other")})


@pytest.mark.parametrize(("precision", "want"), [
    ("fp32", {"master": 4, "optimizer": 8, "reference": 4, "frozen": 0, "compute_copy": 0}),
    ("bf16-mixed", {"master": 4, "optimizer": 8, "reference": 2, "frozen": 0, "compute_copy": 2}),
    ("bf16", {"master": 2, "optimizer": 4, "reference": 2, "frozen": 0, "compute_copy": 0}),
])
def test_state_bytes_per_parameter_by_precision(precision: str, want: dict[str, int]) -> None:
    tr = RLTrainer(init_model(preset("tiny", vocab_size=VOCAB_SIZE), 0), TASK.reward, CFG,
                   system="padded", precision=precision)
    got = tr.state_bytes_per_param()
    assert set(got) == set(want)
    for k, v in want.items():  # the optimiser also holds a few scalars (count, lr, ...)
        assert v <= got[k] < v + 0.01, (k, got)


@pytest.mark.parametrize("name", ["gpt2", "gemmaish"])
def test_bf16_mixed_on_zoo_models_against_the_plain_model(name: str) -> None:
    """Not DecoderLM: the zoo's models (their own modules and casts). The compute model's
    logits on a ragged odd batch are the plain fp32 model re-run, to bf16 rounding; at fp32
    the view returns the very same model computation (exact)."""
    from zoo import zoo

    model = zoo(seed=7)[name]
    graphdef, state = nnx.split(model)
    leaves, treedef = jax.tree_util.tree_flatten(state)
    rng = np.random.default_rng(5)
    b, t = 3, 7  # odd batch; segment ids make the rows ragged (padding slots are segment 0)
    tokens = jnp.asarray(rng.integers(0, 16, (b, t)), jnp.int32)
    pos = jnp.tile(jnp.arange(t, dtype=jnp.int32), (b, 1))
    seg = jnp.asarray([[1] * 7, [1] * 4 + [0] * 3, [1] * 2 + [0] * 5], jnp.int32)
    want = np.asarray(model(tokens, pos, seg))
    same = WeightView(Precision("fp32"), leaves).compute_model(graphdef, treedef, leaves)
    np.testing.assert_array_equal(np.asarray(same(tokens, pos, seg)), want)
    bf = WeightView(Precision("bf16-mixed"), leaves).compute_model(graphdef, treedef, leaves)
    got = np.asarray(bf(tokens, pos, seg), np.float32)
    live = np.asarray(seg) > 0
    err = np.abs(got - want)[live].max()
    assert 0 < err < 0.05 * np.abs(want[live]).max() + 0.05, err
