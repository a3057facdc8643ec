"""One RL fine-tuning step in one call: generate → reference → reward → advantages → update.

"One call", not one XLA program: the step is a host function that runs the runtime's generation
programs (prefill / decode / compaction per shape bucket), one reference forward, the user's Python
reward, and one jitted loss-gradient-optimiser program per epoch. Each compiled program is cached
by shape, so a steady-state step compiles nothing.

:class:`RLTrainer` holds a :class:`~jaxrl_sym.rl.step.state.TrainState` (policy parameters,
optimiser state, frozen reference when ``beta > 0``, step count) and runs the step on one of the
systems of :mod:`jaxrl_sym.systems` that train (each one module with both halves,
:mod:`jaxrl_sym.systems.trainable`), which share everything except generation, the layout and
the forward:

* ``sym``: :class:`~jaxrl_sym.runtime.engine.SymbolicLM` generates on exact-size stores; the
  reference, value and training forwards run on exact-length sequences bin-packed into rows
  (``SymbolicLM.forward_fn``, differentiated with ``jax.grad``); new weights go back with
  ``engine.set_params`` (no re-trace).
* ``padded``: :func:`~jaxrl_sym.baselines.padded.padded_generate` and ``padded_forward`` over rows
  padded to max prompt + max response, masked.

The stages themselves are functions in :mod:`jaxrl_sym.rl.step.stages` of a frozen
:class:`~jaxrl_sym.rl.step.context.StepContext` (what they read) and a state;
:func:`~jaxrl_sym.rl.step.stages.run_step` composes and times them around a rollout source (fresh
prompts, or partial rollouts), and :meth:`RLTrainer.commit` alone stores what a step returns.
Choices that matter:

* The "old" log-probs are the ones generation reported for the sampled tokens (at the sampling
  temperature). They are never recomputed: TRL and verl spend a whole forward pass on that.
* On ``sym`` the reference log-probs of a row are computed as soon as the row finishes: finished
  rows are packed into chunks whose reference forward is dispatched (asynchronously) while the
  remaining rows still decode (:mod:`jaxrl_sym.systems.overlap`). The padded baseline, like TRL,
  runs one reference pass over the padded batch after generation.
* Nothing is committed until the update succeeded: every stage reads the step's starting state
  and the update returns a new one, so a reward function that raises or returns a bad value
  leaves parameters, optimiser state, step counter and carried rows as they were.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl_sym import systems
from jaxrl_sym.errors import InputError
from jaxrl_sym.models.contract import check_model, model_fingerprint
from jaxrl_sym.models.hf.modeling import CausalLM
from jaxrl_sym.rl.config import RLConfig
from jaxrl_sym.rl.step import stages
from jaxrl_sym.rl.step.context import Forwards, RolloutSource, StepContext
from jaxrl_sym.rl.step.partial import Carried, PartialBuffer, PartialConfig
from jaxrl_sym.rl.step.programs import Programs
from jaxrl_sym.rl.step.rollout import BatchReward, RewardFn, Rollout, compute_rewards
from jaxrl_sym.rl.step.sampling import SamplingConfig
from jaxrl_sym.rl.step.state import (
    TrainState,
    init_state,
    make_optimizer,
    params_sha256,
    place_state,
    state_shardings,
)
from jaxrl_sym.rl.step.stopwatch import OnStage
from jaxrl_sym.runtime.engine import SymbolicLM
from jaxrl_sym.runtime.memory.ledger import tree_nbytes
from jaxrl_sym.runtime.options import EngineOptions, Speculation
from jaxrl_sym.sharding import MemoryBudget, data_size, make_mesh
from jaxrl_sym.sizes import parse_bytes
from jaxrl_sym.systems import BindOptions
from jaxrl_sym.systems.layout import Layout
from jaxrl_sym.systems.trainable import TrainableSystem, TrainBound, trainable
from jaxrl_sym.weights.lora import plan_lora
from jaxrl_sym.weights.lora_config import LoraConfig
from jaxrl_sym.weights.precision import Precision
from jaxrl_sym.weights.view import WeightView, check_precision

__all__ = ["RLTrainer", "RewardFn", "Rollout", "TrainState", "compute_rewards", "params_sha256"]


class RLTrainer:
    """Policy, optimiser and reference for RL fine-tuning, on a registered system.

    Args:
      model: the policy (its current weights are the starting point and, with ``beta > 0``, the
        reference).
      reward_fn: ``(prompt, response) -> float`` per sample, or a
        :class:`~jaxrl_sym.rl.step.rollout.BatchReward` (one ``score_batch`` call a step).
      cfg: the step's knobs (:class:`RLConfig`: algorithm, optimiser, execution).
      system: the name of a registered system that trains (``jaxrl_sym.systems.names(
        trains=True)``) — ``sym`` (exact lengths) or ``padded`` (baseline), or one added with
        :func:`jaxrl_sym.systems.register` (``docs/extending.md``).
      metric_fn: optional second per-sample function reported as ``exact_match`` (not optimised).
      engine: how the symbolic runtime generates (:class:`~jaxrl_sym.runtime.options.
        EngineOptions`; None: its defaults, the same as ``SymbolicLM``'s). RL once used its
        own (stores from 16 slots, microbatches split above 0.3 padding); the engine's defaults
        sampled the same tokens in no more dispatches or compiles, at a generation time within
        the runs' own spread (``bench/results/cpu/design_notes.md``).
      speculation: speculative decoding of the rollouts (:class:`~jaxrl_sym.runtime.options.
        Speculation`: a prompt-lookup draft proposes up to ``k`` tokens per row, the policy
        verifies them; the sampled tokens stay distributed as the policy's and the "old"
        log-probs are its own). None: plain decoding. Systems that speculate only.
      mesh: a ``jax.sharding.Mesh``, a ``"data=4,model=2"`` string or a
        :class:`~jaxrl_sym.sharding.MeshConfig` (None: one device). Parameters, optimiser state
        and reference are placed by :mod:`jaxrl_sym.sharding`'s rule, every training batch's rows
        are split over the data axes (padded with empty, zero-weight rows to a multiple of
        them), and each program is jitted with explicit in/out shardings; generation runs on a
        sharded :class:`SymbolicLM`.
      device_memory: bytes one device may hold (``"12GB"``, ``"512MiB"`` or an int; None: no
        check). The sharded state and every compiled program's per-device footprint are checked
        against it before they run (:class:`~jaxrl_sym.sharding.MemoryBudget`), so a model that
        does not fit fails at construction with the mesh it needs, not mid-step.
      partial: partial rollouts (:mod:`jaxrl_sym.rl.step.partial`): a step stops generating when
        ``partial.fraction`` of its rows finished, trains the complete groups and carries the
        unfinished rows into the next step (None, the default: every step generates to the end).
      precision: ``"fp32"``, ``"bf16-mixed"`` or ``"bf16"`` (:mod:`jaxrl_sym.weights.precision`:
        fp32 master weights and optimiser state with a bf16 copy for every forward, or one
        dtype throughout). None: ``bf16-mixed`` for a Hugging Face checkpoint on an
        accelerator, else ``fp32``.
      lora: train LoRA adapters over the frozen model instead of every weight
        (:class:`~jaxrl_sym.weights.lora_config.LoraConfig`: rank, alpha, target paths); the
        reference policy is the frozen base itself (no second copy), the optimiser and the
        checkpoints hold the adapters only. None: full fine-tuning.

    ``state`` is the whole evolving state and ``rollouts`` the rows partial rollouts carry;
    :meth:`commit` is the only writer of both (``params``, ``opt_state``, ``ref_leaves`` and
    ``steps_done`` read the state's fields; assigning one commits a state with it replaced).
    """

    def __init__(
        self,
        model: nnx.Module,
        reward_fn: RewardFn,
        cfg: RLConfig,
        *,
        system: str = systems.REFERENCE,
        metric_fn: RewardFn | None = None,
        engine: EngineOptions | None = None,
        speculation: Speculation | None = None,
        mesh: Any = None,
        device_memory: int | str | None = None,
        partial: PartialConfig | None = None,
        precision: str | Precision | None = None,
        lora: LoraConfig | None = None,
    ) -> None:
        self.system: TrainableSystem = trainable(system)
        _check_options(self.system, engine, speculation)
        if not (callable(reward_fn) or isinstance(reward_fn, BatchReward)):
            raise InputError(f"reward_fn must be callable (prompt, response) -> float or have "
                             f"score_batch(prompts, responses), got {type(reward_fn).__name__}")
        self.cfg = cfg
        self.reward_fn = reward_fn
        self.metric_fn = metric_fn
        info = check_model(model)  # any model that follows the contract; fails early otherwise
        self.vocab_size = info.vocab_size
        self.model_fingerprint = model_fingerprint(model)
        self.tx = make_optimizer(cfg.optim, cfg.algorithm.epochs)
        self.mesh = make_mesh(mesh)
        self._take_weights(model, precision, lora)
        self.budget = None if device_memory is None else MemoryBudget(
            parse_bytes(device_memory, flag="device_memory"))
        if self.budget is not None:  # before any program compiles: fail in seconds, not minutes
            st = self.state
            self.budget.check_tree((st.params, st.opt_state, st.ref),
                                   f"{info.name}'s parameters + optimiser state + reference")
        self.programs = Programs(self.budget)
        self.partial = partial
        self.rollouts = PartialBuffer(partial) if partial is not None else None
        # systems bind to a model over the trainer's own (copied, placed) weights: the caller's
        # model is not kept alive by the trainer, and keeps its weights when the trainer's are
        # donated to an update
        own = self.view.compute_model(self.graphdef, self.treedef, self.state.params["lm"],
                                      self.state.frozen)
        options = BindOptions(
            mesh=self.mesh, engine=engine or EngineOptions(),
            speculate=speculation.k if speculation else 0,
            speculate_adaptive=bool(speculation and speculation.adaptive),
            budget=self.budget, logprob_chunk=cfg.execution.logprob_chunk)

        def bind(system: TrainableSystem) -> TrainBound:
            caps = system.spec.capabilities  # a mesh shards the step's programs for every system
            bound = system.bind(own, replace(options, mesh=options.mesh if caps.shards else None))
            bound.set_params(self.policy_leaves())
            return bound

        self.forwards = Forwards(bind, self.tx, self.shardings, self.view)
        self.forwards.bound(self.system)

    def _take_weights(self, model: nnx.Module, precision: str | Precision | None,
                      lora: LoraConfig | None) -> None:
        """The trainer's own copies of ``model``'s weights under the precision policy (fp32 or
        bf16 masters and optimiser state, the reference in the compute dtype), placed on the
        mesh. The caller's arrays are not kept: the trainer's are donated to its updates."""
        self.graphdef, state = nnx.split(model)
        leaves, self.treedef = jax.tree_util.tree_flatten(state)
        self.precision = Precision.of(precision, pretrained=isinstance(model, CausalLM),
                                      platform=jax.default_backend())
        check_precision(self.precision)
        if lora is not None and self.mesh is not None:
            raise InputError("lora with a mesh (--lora-rank with --mesh) is not supported yet: "
                             "train LoRA on one device, or fine-tune every weight on the mesh")
        plan = None if lora is None else plan_lora(state, lora)
        self.view = WeightView(self.precision, leaves, plan)
        frozen = self.view.frozen(leaves)
        self.state: TrainState = init_state(
            self.view.trainable(leaves), self.cfg.algorithm, self.tx, self.vocab_size,
            self.view.reference(leaves, frozen) if self.cfg.algorithm.beta > 0 else None, frozen)
        self.shardings: dict[str, Any] | None = None
        if self.mesh is not None:
            self.shardings = state_shardings(self.state, self.mesh)
            self.state = place_state(self.state, self.shardings)

    # ------------------------------------------------------------------ state
    def commit(self, state: TrainState, carried: PartialBuffer | None = None) -> None:
        """Make ``state`` the trainer's (and ``carried`` the rows partial rollouts carry, when
        given); every bound system gets the new weights in place (no re-trace). The only
        writer of the trainer's evolving state: steps, checkpoint restore and the field
        setters below all go through it."""
        self.state = state
        if carried is not None:
            self.rollouts = carried
        self.forwards.set_params(self.policy_leaves())

    @property
    def params(self) -> Any:
        return self.state.params

    @params.setter
    def params(self, value: Any) -> None:
        # copied: the trainer's own buffers are donated to its next update, the caller's are not
        self.commit(self.state.replace(params=jax.tree_util.tree_map(jnp.copy, value)))

    @property
    def opt_state(self) -> Any:
        return self.state.opt_state

    @opt_state.setter
    def opt_state(self, value: Any) -> None:
        # copied: the trainer's own buffers are donated to its next update, the caller's are not
        self.commit(self.state.replace(opt_state=jax.tree_util.tree_map(jnp.copy, value)))

    @property
    def ref_leaves(self) -> list[jax.Array] | None:
        return self.state.ref

    @ref_leaves.setter
    def ref_leaves(self, value: list[jax.Array] | None) -> None:
        self.commit(self.state.replace(ref=value))

    @property
    def steps_done(self) -> int:
        return self.state.step

    @steps_done.setter
    def steps_done(self, value: int) -> None:
        self.commit(self.state.replace(step=value))

    def policy_leaves(self) -> list[jax.Array]:
        """The leaves every forward of the current policy reads: the trained ones themselves, or
        a copy made on the device (bf16 cast; LoRA: the adapters beside the frozen base) — what
        the bound systems generate with, refreshed at each commit."""
        return self.view.compute_copy(self.state.params["lm"], self.state.frozen)

    def params_sha256(self) -> str:
        return params_sha256(self.params)

    def state_bytes_per_param(self) -> dict[str, float]:
        """Resident bytes per model parameter, by part (activations excluded): the trained
        weights (``master``), the optimiser state, the reference and the forward's copy of the
        weights (0 where the policy needs none). What a precision or LoRA saves shows here. The
        update holds all parts but ``compute_copy``, which is released before it (its
        "update-state" bytes are the sum of the others)."""
        st = self.state
        n = max(1, self.view.n_params)  # the model's parameters
        copy = tree_nbytes(self.view.forward_copy(st.params["lm"], st.frozen))
        ref = st.ref if st.ref is not None and st.ref is not st.frozen else None
        parts = {"master": tree_nbytes(self.params), "optimizer": tree_nbytes(self.opt_state),
                 "reference": tree_nbytes(ref) if ref else 0,
                 "frozen": tree_nbytes(st.frozen) if st.frozen else 0, "compute_copy": copy}
        return {k: v / n for k, v in parts.items()}

    # ------------------------------------------------------------------ pieces
    @property
    def context(self) -> StepContext:
        """What the stages read (:class:`StepContext`), from the trainer's current settings."""
        return StepContext(
            cfg=self.cfg, sampling=SamplingConfig.of(self.cfg.algorithm),
            system=self.forwards.bound(self.system), forwards=self.forwards,
            programs=self.programs, reward_fn=self.reward_fn, metric_fn=self.metric_fn,
            vocab_size=self.vocab_size, row_multiple=data_size(self.mesh),
            overlaps_reference=self.overlaps_reference)

    @property
    def engine(self) -> SymbolicLM:
        """The symbolic runtime generating for this trainer (shares the trainer's weights); an
        :class:`InputError` on a system that generates without it."""
        engine = getattr(self.forwards.bound(self.system), "lm", None)
        if engine is None:
            raise InputError(f"system {self.system.name!r} generates without the symbolic "
                             "runtime: it has no engine")
        return engine

    def model(self) -> nnx.Module:
        """An NNX model holding a copy of the current policy weights, in the dtypes the model
        came with (the trainer's own buffers are donated to the next update, so a model sharing
        them would not outlive it)."""
        leaves = self.view.original(self.params["lm"], self.state.frozen)
        return nnx.merge(self.graphdef, jax.tree_util.tree_unflatten(self.treedef, leaves))

    def fns(self, system: str) -> dict[str, Any]:
        """Jitted reference / value / loss-grad / update functions for the layout of the
        registered system ``system``."""
        return self.context.fns(trainable(system))

    @property
    def overlaps_reference(self) -> bool:
        """``cfg.execution.overlap_reference``, or where it is None (auto) whether the device is an
        accelerator. Why not on a CPU: there the "device" is the host's own cores, so scoring
        chunks during generation does not fill idle device time, it competes with the decode
        loop for the same cores, and the CPU step benchmark was slower with it
        (``bench/results/cpu/design_notes.md``)."""
        if self.cfg.execution.overlap_reference is not None:
            return bool(self.cfg.execution.overlap_reference)
        devices = self.mesh.devices.flat if self.mesh is not None else jax.devices()
        return next(iter(devices)).platform != "cpu"

    # ------------------------------------------------------------------ public stages
    def generate(self, prompts: Sequence[np.ndarray | Sequence[int]], seed: int,
                 limits: Sequence[int] | None = None) -> Rollout:
        """G samples per prompt at the configured temperature, with their sampling log-probs
        (:func:`jaxrl_sym.rl.step.stages.generate` at the current state; nothing is trained)."""
        return stages.generate(self.context, self.state, prompts, seed, limits)

    def greedy(self, prompts: Sequence[np.ndarray], max_new_tokens: int) -> list[np.ndarray]:
        """Greedy responses of the current policy (evaluation; nothing is trained)."""
        gcfg = SamplingConfig.of(self.cfg.algorithm).greedy(max_new_tokens)
        return self.forwards.bound(self.system).greedy(list(prompts), gcfg)

    def layout(self, rollout: Rollout, system: str | None = None) -> Layout:
        """The rollout in the training layout of the registered system ``system`` (default:
        the trainer's system)."""
        return self.context.layout(rollout, None if system is None else trainable(system))

    def prepare(self, rollout: Rollout, rewards: np.ndarray, system: str | None = None
                ) -> tuple[Layout, dict[str, np.ndarray]]:
        """Layout + loss arrays for a rollout on ``system`` at the current state (reference and
        values via that system's forward)."""
        ctx, state = self.context, self.state
        layout = ctx.layout(rollout, None if system is None else trainable(system))
        ref = stages.reference_logprobs(ctx, state, layout)
        return layout, stages.advantages(ctx, state, layout, rollout, rewards, ref)[0]

    def loss_and_grads(self, rollout: Rollout, rewards: np.ndarray, system: str | None = None
                       ) -> tuple[float, dict[str, float], Any]:
        """(loss, aux, grads) at the current parameters, without updating (tests, debugging)."""
        layout, arrays = self.prepare(rollout, rewards, system)
        (loss, aux), grads = self.programs.run(
            f"grad-{layout.system.name}", self.context.fns(layout.system)["grad"], self.params,
            self.state.frozen, layout.inputs, arrays)
        return float(loss), {k: float(v) for k, v in aux.items()}, grads

    # ------------------------------------------------------------------ the step
    def step(self, prompts: Sequence[np.ndarray | Sequence[int]], *, seed: int,
             limits: Sequence[int] | None = None,
             on_stage: OnStage | None = None) -> dict[str, Any]:
        """Run one full RL step and commit it; returns the step's metrics
        (:func:`jaxrl_sym.rl.step.stages.run_step`; ``on_stage`` hears each stage start and end).

        With partial rollouts (``partial``) the rollout source is
        :class:`~jaxrl_sym.rl.step.partial.Carried`: ``prompts`` may then be empty to finish the
        carried rows.
        """
        source: RolloutSource = (stages.Fresh(prompts, seed, limits) if self.rollouts is None
                                 else Carried(self.rollouts, prompts, seed, limits))
        try:
            outcome = stages.run_step(self.context, self.state, source, on_stage)
        except stages.DivergedError as e:
            if e.state is not None:  # the same values, in the buffers the update gave back
                self.commit(e.state)
            raise
        self.commit(outcome.state, outcome.carried)
        return outcome.metrics


def _check_options(system: TrainableSystem, engine: EngineOptions | None,
                   speculation: Speculation | None) -> None:
    """The trainer's generation options, checked against what ``system`` can do (its spec's
    capabilities) before any tracing."""
    if engine is not None and not isinstance(engine, EngineOptions):
        raise InputError(f"engine={engine!r}: give an EngineOptions (jaxrl_sym.runtime.options) "
                         "or None for the RL default")
    if speculation is None:
        return
    if not isinstance(speculation, Speculation):
        raise InputError(f"speculation={speculation!r} (--speculate): give a Speculation(k) "
                         "(jaxrl_sym.runtime.options) or None for plain decoding")
    if not system.spec.capabilities.speculates:
        raise InputError(f"speculation (--speculate {speculation.k}): system "
                         f"{system.name!r} decodes without it; choose one of "
                         f"{', '.join(systems.names(trains=True, speculates=True))} or drop it")
