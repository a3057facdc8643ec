"""The RL trainer's evolving state as one immutable pytree: policy, optimiser, reference, step.

Why one value instead of loose attributes: a step must either happen completely or not at all (a
reward function that raises leaves the model as it was). With the state in one frozen pytree, every
stage reads the state it was given and the update *returns* a new one; the trainer swaps it in only
at commit, so "nothing changed" after a failure holds by construction rather than by care. It is
also the one object a checkpoint has to save.
"""

from __future__ import annotations

import hashlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct

from jaxrl_sym.rl.knobs import AlgorithmConfig, OptimizerConfig
from jaxrl_sym.runtime.metrics import tree_bytes
from jaxrl_sym.sharding import to_host


@struct.dataclass
class TrainState:
    """Everything a step changes (or, for ``ref``, reads without changing).

    params: ``{"lm": [model leaves], "value": {...}}`` (the value head only for PPO).
    opt_state: optax state of ``params``.
    ref: frozen reference leaves (a copy of the initial ``lm`` leaves in the compute dtype; with
      LoRA the frozen base itself), None when ``beta == 0``.
    step: steps committed so far.
    frozen: what the policy reads but never trains: LoRA's base leaves (None without LoRA).
      Never donated, never checkpointed (the source model gives it back).
    """

    params: Any
    opt_state: Any
    ref: list[jax.Array] | None
    step: int
    frozen: list[jax.Array] | None = None

    def copy(self) -> TrainState:
        """A snapshot in buffers of its own: the update programs take the trainer's parameters
        and optimiser state as donated buffers, so a state kept to be restored later (with
        :meth:`RLTrainer.commit`) must not share them."""
        dup = lambda t: jax.tree_util.tree_map(jnp.copy, t)
        return self.replace(params=dup(self.params), opt_state=dup(self.opt_state))

    def resident_bytes(self) -> int:
        """Bytes held besides the policy parameters (optimiser state, reference, frozen base:
        counted once when the reference is the base); every program's peak-memory estimate
        adds them, since they stay on the device throughout."""
        ref = tree_bytes(self.ref) if self.ref and self.ref is not self.frozen else 0
        return tree_bytes(self.opt_state) + ref + (tree_bytes(self.frozen) if self.frozen else 0)


def lr_schedule(cfg: OptimizerConfig, epochs: int) -> optax.Schedule:
    """Learning rate per optimiser update: linear warm-up over ``warmup_steps`` RL steps, then
    constant or decayed (cosine / linear) to ``min_lr_ratio * lr`` at ``total_steps``.

    Why a warm-up: Adam's first updates have ~lr-sized steps in *every* coordinate (its second
    moment is still near the first gradient squared), which on a freshly initialised policy
    sharpens the output distribution before the reward signal has a direction.
    The schedule counts optimiser updates; ``epochs`` updates (the algorithm's) make one RL step.
    """
    e, lr = epochs, cfg.lr
    warm = cfg.warmup_steps * e
    if cfg.lr_schedule == "constant":
        if warm == 0:
            return optax.constant_schedule(lr)
        return optax.join_schedules(
            [optax.linear_schedule(lr / warm, lr, warm), optax.constant_schedule(lr)], [warm])
    assert cfg.total_steps is not None  # OptimizerConfig checks it for decaying schedules
    end = lr * cfg.min_lr_ratio
    if cfg.lr_schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(lr / max(warm, 1) if warm else lr,
                                                  lr, warm, cfg.total_steps * e, end)
    decay = optax.linear_schedule(lr, end, cfg.total_steps * e - warm)
    if warm == 0:
        return decay
    return optax.join_schedules([optax.linear_schedule(lr / warm, lr, warm), decay], [warm])


def _sgd(learning_rate: Any, weight_decay: float) -> optax.GradientTransformation:
    """SGD whose decay is an L2 term (PyTorch's ``SGD(weight_decay=)``)."""
    return optax.chain(optax.add_decayed_weights(weight_decay), optax.sgd(learning_rate))


# OptimizerConfig.optimizer -> optax's own transformation of (learning_rate, weight_decay); adam
# (no decay) is injected as before, so its state's structure, and so older checkpoints, hold
_OPTIMIZERS: dict[str, Any] = {
    "adamw": lambda learning_rate, weight_decay: optax.adamw(learning_rate,
                                                             weight_decay=weight_decay),
    "sgd": _sgd,
    "lion": lambda learning_rate, weight_decay: optax.lion(learning_rate,
                                                           weight_decay=weight_decay),
    "adafactor": lambda learning_rate, weight_decay: optax.adafactor(
        learning_rate, weight_decay_rate=weight_decay),
}


def make_optimizer(cfg: OptimizerConfig, epochs: int) -> optax.GradientTransformation:
    """``cfg.optimizer`` (optax's) on :func:`lr_schedule` (``epochs`` updates per RL step),
    with ``cfg.weight_decay``. The
    global-norm clip (``cfg.max_grad_norm``) is not part of it: the update programs clip the
    gradients in place first (:func:`clip_by_global_norm`).

    ``inject_hyperparams`` keeps the current rate in the optimiser state, so the step's metrics
    report the rate the update actually used. Its hyperparameters are held in float32 whatever
    the parameters' dtype: by default it casts them to the parameters' dtype, and in bfloat16
    ``b2 = 0.999`` rounds to 1.0, so Adam's bias correction ``1 - b2**t`` is 0 and the first
    update of a bf16 model was NaN everywhere.
    """
    if cfg.optimizer == "adam":
        return optax.inject_hyperparams(optax.adam, hyperparam_dtype=jnp.float32)(
            learning_rate=lr_schedule(cfg, epochs))
    return optax.inject_hyperparams(_OPTIMIZERS[cfg.optimizer], hyperparam_dtype=jnp.float32)(
        learning_rate=lr_schedule(cfg, epochs), weight_decay=cfg.weight_decay)


def clip_by_global_norm(grads: Any, max_norm: float | None) -> tuple[jax.Array, Any]:
    """(global norm, gradients scaled to at most ``max_norm``) — optax's
    ``clip_by_global_norm`` arithmetic, outside the optimiser chain.

    Why outside: as the chain's first link, its output fed both of Adam's moments, so XLA kept
    the clipped gradients as one more gradient-sized temporary (0.54 GB at SmolLM2-135M in
    fp32, the apply's whole temporaries). The apply returns them as an output over its donated
    gradient sum instead, so they are written where the sum was. The optimiser state's leaves
    are the same either way (the clip's state is empty), so checkpoints read as before.
    """
    gnorm = optax.tree.norm(grads)
    if not max_norm:
        return gnorm, grads
    below = gnorm < max_norm
    clip = lambda g: jnp.where(below, g, (g / gnorm.astype(g.dtype)) * max_norm)
    return gnorm, jax.tree_util.tree_map(clip, grads)


def current_lr(opt_state: Any) -> float | None:
    """The learning rate the last update used (None for an optimiser without injected ones).

    The state itself is looked at first: optax's injected state is a NamedTuple, so taking
    every tuple for a chain of states looked only at its fields, and every step reported
    ``lr`` None."""
    parts = opt_state if isinstance(opt_state, tuple) else ()
    for part in (opt_state, *parts):
        hp = getattr(part, "hyperparams", None)
        if hp is not None and "learning_rate" in hp:
            return float(hp["learning_rate"])
    return None


def with_config_hyperparams(restored: Any, fresh: Any) -> Any:
    """The restored optimiser state ``restored`` with the plain hyper-parameters of ``fresh``
    (a state this trainer's optimiser initialised: its config's).

    Why: :func:`make_optimizer` injects its hyper-parameters into the state. The learning rate is
    a schedule, recomputed from the restored step count at every update by the schedule the
    trainer built from its config, so a rate changed on resume takes effect by itself; a plain
    number (``weight_decay``, Adam's betas) is kept in the state as it was at ``init`` and read
    back from it at every update, so a restore would bring the checkpoint's back. The moments
    and counts stay the restored ones. A state without injected hyper-parameters is returned
    as it is."""
    hp = getattr(restored, "hyperparams", None)
    scheduled = getattr(restored, "hyperparams_states", None)
    if hp is None or scheduled is None:
        return restored
    own = {k: (v if k in scheduled else fresh.hyperparams[k]) for k, v in hp.items()}
    return restored._replace(hyperparams=own)


def init_state(lm: Any, cfg: AlgorithmConfig, tx: optax.GradientTransformation,
               vocab_size: int, reference: list[Any] | None = None,
               frozen: list[Any] | None = None) -> TrainState:
    """Step-0 state from what the optimiser trains (``lm``: the model's leaves in the master
    dtype, or LoRA adapters), the reference (None: ``lm``) and LoRA's frozen base.

    ``lm`` and a reference taken from it are *copied* (never the caller's buffers): the update
    programs take the policy's buffers as donated arguments, which must never be the caller's
    model's or the reference's. The frozen base is never donated.
    """
    params: dict[str, Any] = {"lm": jax.tree_util.tree_map(lambda x: jnp.array(x, copy=True), lm)}
    if cfg.algo == "ppo":
        # Zero-initialised read-out: the first value estimates are 0, GAE then starts from
        # Monte-Carlo returns instead of noise.
        params["value"] = {"w": jnp.zeros((vocab_size,), jnp.float32),
                           "b": jnp.zeros((), jnp.float32)}
    ref = None
    if cfg.beta > 0:
        # the given reference as is (LoRA's is the frozen base's very list: no second copy)
        ref = reference if reference is not None else [jnp.array(x, copy=True) for x in lm]
    return TrainState(params=params, opt_state=tx.init(params), ref=ref, step=0, frozen=frozen)


def state_shardings(state: TrainState, mesh: Any) -> dict[str, Any]:
    """Where each part of ``state`` lives on ``mesh`` (:mod:`jaxrl_sym.sharding`'s rule):
    ``params`` and ``opt`` as trees of ``NamedSharding`` (a moment shares its parameter's shape,
    hence its sharding; scalars are replicated), ``rows`` for batch arrays, ``repl`` for
    replicated outputs. The reference uses ``params["lm"]``'s (same shapes)."""
    from jaxrl_sym.sharding import replicated, rows_sharding, tree_shardings

    return {"params": tree_shardings(state.params, mesh),
            "opt": tree_shardings(state.opt_state, mesh),
            "rows": rows_sharding(mesh), "repl": replicated(mesh)}


def place_state(state: TrainState, shardings: dict[str, Any]) -> TrainState:
    """``state`` with its arrays moved onto the given shardings (see :func:`state_shardings`)."""
    ref = None if state.ref is None else jax.device_put(state.ref, shardings["params"]["lm"])
    return state.replace(params=jax.device_put(state.params, shardings["params"]),
                         opt_state=jax.device_put(state.opt_state, shardings["opt"]), ref=ref)


def params_sha256(params: Any) -> str:
    """Digest of every parameter array (shape, dtype and bytes, in pytree order).

    Used to check that an interrupted-and-resumed run ends exactly where an uninterrupted one does.
    """
    h = hashlib.sha256()
    for x in jax.tree_util.tree_leaves(params):
        a = np.ascontiguousarray(to_host(x))  # the global array, on every process
        h.update(f"{a.shape}{a.dtype}".encode())
        h.update(a.reshape(-1).view(np.uint8))  # a.tobytes()'s bytes without copying them
    return h.hexdigest()
