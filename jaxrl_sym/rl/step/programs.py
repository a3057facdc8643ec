"""The step's compiled programs: a shape-keyed cache with peak-memory accounting, and the jitted
reference / value / loss-gradient / update functions built over one system's forward.

Why the functions are built from a ``logits_fn`` rather than per system: the loss, its gradient
and the optimiser update are the same code on every layout (see
:mod:`jaxrl_sym.rl.algorithms.losses`); only the forward differs, and that is what a
:class:`~jaxrl_sym.systems.trainable.TrainableSystem` provides.
"""

from __future__ import annotations

from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxrl_sym.rl.algorithms.losses import (
    loss_from_terms,
    rl_loss,
    token_logprobs,
    value_predictions,
)
from jaxrl_sym.rl.config import RLConfig
from jaxrl_sym.rl.knobs import AlgorithmConfig
from jaxrl_sym.rl.step.logprobs import chunked_terms
from jaxrl_sym.rl.step.remat import remat_between_attention
from jaxrl_sym.rl.step.state import clip_by_global_norm
from jaxrl_sym.runtime.metrics import tree_bytes
from jaxrl_sym.runtime.programs import ProgramCache
from jaxrl_sym.sharding import lowerable
from jaxrl_sym.systems.forward import LogitsFn, SplitForward, chunking_status

__all__ = ["LogitsFn", "Programs", "Weights", "build_fns"]


class Weights(Protocol):
    """What :func:`build_fns` needs of the precision/LoRA policy
    (:class:`~jaxrl_sym.weights.view.WeightView`): the leaves the policy's forward reads."""

    def forward(self, lm: Any, frozen: Any) -> list[jax.Array]: ...

    def reference_leaves(self, ref: Any) -> list[jax.Array]: ...

    def compute_copy(self, lm: Any, frozen: Any) -> list[jax.Array]: ...

    @property
    def copies(self) -> bool: ...


class Programs:
    """The runtime's :class:`ProgramCache` keyed by (name, argument shapes), plus the peak of
    bytes held while a program runs (inputs + resident state + XLA temporaries + outputs).

    Compiling ahead of time (``lower().compile()``) is what gives access to
    ``memory_analysis()``; the cache key mirrors jit's own (pytree structure + shapes/dtypes).
    """

    def __init__(self, budget: Any = None) -> None:
        self.cache = ProgramCache(budget=budget)  # budget: a sharding.MemoryBudget or None
        self.peak = 0

    @property
    def compiles(self) -> int:
        return self.cache.compiles

    @staticmethod
    def key(name: str, args: tuple[Any, ...]) -> tuple:
        """The cache key of ``name`` at ``args`` (pytree structure, shapes and dtypes)."""
        leaves, tdef = jax.tree_util.tree_flatten(args)
        return (name, tdef, tuple((np.shape(x), np.result_type(x).str) for x in leaves))

    def prefetch(self, name: str, fn: Any, *args: Any) -> None:
        """Start compiling ``fn`` at ``args``' shapes on the cache's background thread: a later
        :meth:`run` of ``name`` at those shapes waits only for what is left of the compile
        (:meth:`ProgramCache.prefetch`)."""
        self.cache.prefetch(self.key(name, args), lambda: fn.lower(*lowerable(args)).compile())

    def run(self, name: str, fn: Any, *args: Any, resident: int = 0) -> Any:
        key = self.key(name, args)
        out = self.cache.run(key, lambda: fn.lower(*lowerable(args)).compile(), *args)
        held = resident + sum(int(x.nbytes) for x in jax.tree_util.tree_leaves(args))
        self.peak = max(self.peak, held + self.cache.temp_bytes[key] + tree_bytes(out))
        return out


def build_fns(cfg: RLConfig, tx: optax.GradientTransformation, logits_fn: LogitsFn,
              shardings: dict[str, Any] | None = None,
              weights: Weights | None = None) -> dict[str, Any]:
    """Jitted functions of one layout, by role (``frozen``: what the policy reads but never
    trains — LoRA's base leaves — or None):

    ``ref(leaves, inputs, targets)`` (reference log-probs), ``values(params, frozen, inputs)``
    (PPO value estimates), ``grad(params, frozen, inputs, arrays)`` (loss and its gradient
    w.r.t. ``params`` only), ``update(params, opt_state, frozen, inputs, arrays)`` (fused
    loss-grad-optimiser step for a batch in one micro-batch), ``apply(params, opt_state,
    grads)`` (optimiser step from accumulated gradients; it also returns the clipped gradients,
    written over the donated sum) and ``accumulate(params, acc, frozen, inputs, arrays)`` (a
    micro-batch's gradients added into the donated running sum);
    ``update``/``apply`` take the state as donated buffers and guard their step
    (:func:`_guarded_step`); plus ``logprob_chunking``, the step's stat (on, or off and why).

    logits_fn: the system's forward; a :class:`~jaxrl_sym.systems.forward.SplitForward` with
    ``cfg.execution.logprob_chunk`` set makes ``ref``/``values``/``grad``/``update`` apply the
    head a chunk of token slots at a time (:mod:`jaxrl_sym.rl.step.logprobs`), anything else
    runs unchunked. ``cfg.execution.remat`` rematerialises the loss's layers in its backward
    (:func:`~jaxrl_sym.rl.step.remat.remat_between_attention`).

    shardings (on a device mesh): ``{"params", "opt", "rows", "repl"}`` — trees of
    ``NamedSharding`` for the parameters and optimiser state, the batch rows' sharding and the
    replicated one. Every function is then jitted with explicit in/out shardings, so parameters
    and optimiser state come back where they went in (nothing drifts to one device) and the
    batch's rows are split over the data axes; the loss is the same sum, partitioned by XLA.

    weights: the precision/LoRA policy (:class:`~jaxrl_sym.weights.view.WeightView`): the
    policy's forward reads ``weights.forward(params["lm"], frozen)`` (a bf16 cast; LoRA's
    unmerged model) inside each program, so the gradient w.r.t. the trained leaves goes through
    it; the reference reads ``weights.reference_leaves(ref)``. None: the leaves as they are.
    """
    run, max_norm = cfg.execution, cfg.optim.max_grad_norm
    split = logits_fn if isinstance(logits_fn, SplitForward) and run.logprob_chunk else None
    ref_lp, values, loss = _through_weights(weights, *_heads(cfg.algorithm, run.logprob_chunk,
                                                             logits_fn, split))
    if run.remat:
        loss = remat_between_attention(loss)
    grad_fn = jax.value_and_grad(loss, has_aux=True)  # w.r.t. params, never the frozen part

    def update(params, opt_state, frozen, inputs, arrays):
        (_, aux), grads = grad_fn(params, frozen, inputs, arrays)
        gnorm, grads = clip_by_global_norm(grads, max_norm)
        aux = {**aux, "grad_norm": gnorm}
        return (*_guarded_step(tx, params, opt_state, grads, _all_finite(aux)), aux)

    def apply(params, opt_state, grads):  # clipped gradients: an output over the donated sum
        gnorm, grads = clip_by_global_norm(grads, max_norm)
        return (*_guarded_step(tx, params, opt_state, grads, jnp.isfinite(gnorm)), gnorm, grads)

    def accumulate(params, acc, frozen, inputs, arrays):
        # the accumulator is donated: the sum lands in its buffer, so the step holds one
        # gradient-sized buffer between micro-batches instead of the sum and the new gradients
        (loss, aux), grads = grad_fn(params, frozen, inputs, arrays)
        return (loss, aux), jax.tree_util.tree_map(jnp.add, acc, grads)

    status = {"logprob_chunking": chunking_status(logits_fn, run.logprob_chunk)}
    return {**status, **_jitted(dict(ref=ref_lp, values=values, grad=grad_fn, update=update,
                                     apply=apply, accumulate=accumulate), shardings)}


def _through_weights(weights: Weights | None, ref0: Any, values0: Any, loss0: Any
                     ) -> tuple[Any, Any, Any]:
    """``ref(leaves, inputs, targets)``, ``values(params, frozen, inputs)`` and ``loss(params,
    frozen, inputs, arrays)`` over the leaves the policy's forward reads
    (``weights.forward``: a cast to the compute dtype; with LoRA the unmerged model's leaves,
    :mod:`jaxrl_sym.weights.lora_model`): the loss's gradient w.r.t. the trained leaves goes
    through them. The reference reads ``weights.reference_leaves(ref)``."""
    fwd = (lambda lm, frozen: lm) if weights is None else weights.forward
    ref_leaves = (lambda leaves: leaves) if weights is None else weights.reference_leaves
    policy = lambda params, frozen: {**params, "lm": fwd(params["lm"], frozen)}

    def ref(leaves: Any, inputs: Any, targets: Any) -> Any:
        return ref0(ref_leaves(leaves), inputs, targets)

    def values(params: Any, frozen: Any, inputs: Any) -> Any:
        return values0(policy(params, frozen), inputs)

    def loss(params: Any, frozen: Any, inputs: Any, arrays: Any) -> Any:
        return loss0(policy(params, frozen), inputs, arrays)

    return ref, values, loss


def _jitted(fns: dict[str, Any], shardings: dict[str, Any] | None) -> dict[str, Any]:
    """Each function jitted: ``update``/``apply`` donate the parameters and optimiser state,
    ``apply`` and ``accumulate`` the running gradient sum; on a mesh with explicit in/out
    shardings."""
    donate = {"update": (0, 1), "apply": (0, 1, 2), "accumulate": (1,)}
    if shardings is None:
        return {k: jax.jit(f, donate_argnums=donate.get(k, ())) for k, f in fns.items()}
    p, o, rows, rep = (shardings[k] for k in ("params", "opt", "rows", "repl"))
    f = shardings.get("frozen")  # None: no frozen part (LoRA on a mesh is refused)
    where = {"ref": ((p["lm"], rows, rows), rows), "values": ((p, f, rows), rows),
             "grad": ((p, f, rows, rows), ((rep, rep), p)),
             "update": ((p, o, f, rows, rows), (p, o, rep)),
             "apply": ((p, o, p), (p, o, rep, p)),
             "accumulate": ((p, p, f, rows, rows), ((rep, rep), p))}
    return {k: jax.jit(fn, in_shardings=where[k][0], out_shardings=where[k][1],
                       donate_argnums=donate.get(k, ())) for k, fn in fns.items()}


def _all_finite(tree: Any) -> jax.Array:
    """True when every element of every leaf of ``tree`` is finite (a traced scalar)."""
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree_util.tree_leaves(tree)]))


def _guarded_step(tx: optax.GradientTransformation, params: Any, opt_state: Any, grads: Any,
                  ok: jax.Array) -> tuple[Any, Any]:
    """The optimiser step where ``ok``, else ``params``/``opt_state`` as given.

    Why: ``update`` and ``apply`` take the state as donated buffers, so the new state is written
    where the old one was and the step never holds two copies of it (at SmolLM2-135M's shape in
    fp32, 1.6 GB). The old state is then gone once the program runs, so a non-finite loss or
    gradient norm must not reach it: the guard returns the given values unchanged and the
    trainer keeps them (:class:`~jaxrl_sym.rl.step.stages.DivergedError` carries them)."""
    def step(params: Any, opt_state: Any, grads: Any) -> tuple[Any, Any]:
        updates, new_state = tx.update(grads, opt_state, params)
        # each buffer keeps its dtype (the hyperparameters are float32, so a bf16 moment would
        # come back float32): the new state must fit the donated buffers it is written over
        keep = lambda new, old: jnp.asarray(new).astype(jnp.result_type(old))
        return (jax.tree_util.tree_map(keep, optax.apply_updates(params, updates), params),
                jax.tree_util.tree_map(keep, new_state, opt_state))

    # a conditional, not a select: XLA then updates the donated state in place (a select over
    # both trees keeps the new moments and parameters as temporaries:
    # bench/results/cpu/design_notes.md)
    return jax.lax.cond(ok, step, lambda p, o, _: (p, o), params, opt_state, grads)


def _heads(cfg: AlgorithmConfig, logprob_chunk: int | None, logits_fn: LogitsFn,
           split: SplitForward | None) -> tuple[Any, ...]:
    """(reference log-probs, value estimates, loss) over the forward: chunked through the
    features/head split when ``split`` is given, else from the whole logits."""
    chunk, temp = logprob_chunk or 0, cfg.temperature
    whole = _whole_heads(cfg, logits_fn)
    if split is None:
        return whole
    # A batch of at most one chunk runs the whole-logits program: one chunk holds the same
    # [slots x vocab] logits, and its rematerialised backward keeps more such buffers alive
    # (bench/results/cpu/design_notes.md).
    small = lambda inputs: inputs[0].size <= chunk  # static: shapes are known when tracing

    def ref_lp(leaves, inputs, targets):
        if small(inputs):
            return whole[0](leaves, inputs, targets)
        return chunked_terms(split, leaves, inputs, targets, temp, chunk, entropy=False)["lp"]

    def values(params, inputs):
        if small(inputs):
            return whole[1](params, inputs)
        return chunked_terms(split, params["lm"], inputs, None, temp, chunk,
                             value_head=params["value"], logprobs=False)["v"]

    def loss(params, inputs, arrays):
        if small(inputs):
            return whole[2](params, inputs, arrays)
        terms = chunked_terms(split, params["lm"], inputs, arrays["targets"], temp, chunk,
                              value_head=params.get("value"))
        return loss_from_terms(terms, arrays, cfg)

    return ref_lp, values, loss


def _whole_heads(cfg: AlgorithmConfig, logits_fn: LogitsFn) -> tuple[Any, ...]:
    """(reference log-probs, value estimates, loss) from the whole batch's logits at once."""
    temp = cfg.temperature

    def ref_lp(leaves, inputs, targets):
        return token_logprobs(logits_fn(leaves, inputs), targets, temp)

    def values(params, inputs):
        return value_predictions(logits_fn(params["lm"], inputs), params["value"])

    # Rematerialise the loss head: only the logits are kept for the backward pass, not the
    # log-softmax, softmax and entropy terms — each another [slots × vocab] fp32 buffer.
    head = jax.checkpoint(lambda logits, arrays, value: rl_loss(logits, arrays, value, cfg))

    def loss(params, inputs, arrays):
        return head(logits_fn(params["lm"], inputs), arrays, params.get("value"))

    return ref_lp, values, loss
