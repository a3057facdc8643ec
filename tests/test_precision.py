"""Training in reduced precision: the optimiser step in bf16 against a numpy Adam.

Why: optax's ``inject_hyperparams`` casts its hyperparameters to the parameters' dtype, and in
bfloat16 ``b2 = 0.999`` rounds to 1.0, which made Adam's bias correction zero and every bf16
model's first update NaN. The oracle is Adam written out in numpy (float64), then rounded to
bf16 once, as the update does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jaxrl_sym.rl import RLConfig
from jaxrl_sym.rl.programs import _guarded_step
from jaxrl_sym.rl.state import make_optimizer


def _numpy_adam(p: np.ndarray, g: np.ndarray, lr: float, b1: float = 0.9, b2: float = 0.999,
                eps: float = 1e-8) -> np.ndarray:
    m, v = (1 - b1) * g, (1 - b2) * g * g
    m_hat, v_hat = m / (1 - b1), v / (1 - b2)
    return p - lr * m_hat / (np.sqrt(v_hat) + eps)


def test_a_bf16_adam_step_equals_numpy_adam_and_keeps_the_dtypes() -> None:
    cfg = RLConfig(algo="grpo", lr=1e-2, eos_id=0, max_grad_norm=None)
    tx = make_optimizer(cfg)
    rng = np.random.default_rng(0)
    p = rng.normal(size=(64,)).astype(ml_dtypes.bfloat16)
    g = (rng.normal(size=(64,)) * 1e-3).astype(ml_dtypes.bfloat16)
    params, grads = {"w": jnp.asarray(p)}, {"w": jnp.asarray(g)}
    state = tx.init(params)
    new_p, new_s = jax.jit(lambda a, b, c: _guarded_step(tx, a, b, c, jnp.bool_(True)))(
        params, state, grads)
    want = _numpy_adam(p.astype(np.float64), g.astype(np.float64), cfg.lr)
    got = np.asarray(new_p["w"]).astype(np.float64)
    assert np.all(np.isfinite(got))
    # one bf16 rounding of the result (8 significant bits: relative 2**-8)
    np.testing.assert_allclose(got, want, rtol=2**-8, atol=0)
    assert new_p["w"].dtype == jnp.bfloat16
    dtypes = lambda t: [x.dtype for x in jax.tree_util.tree_leaves(t)]
    assert dtypes(new_s) == dtypes(state)  # written over the donated buffers of the old state
