"""One RL fine-tuning step in one call: generate → reference → reward → advantages → update.

"One call", not one XLA program: the step is a host function that runs the runtime's generation
programs (prefill / decode / compaction per shape bucket), one reference forward, the user's Python
reward, and one jitted loss-gradient-optimiser program per epoch. Each compiled program is cached
by shape, so a steady-state step compiles nothing.

:class:`RLTrainer` holds a :class:`~jaxrl_sym.rl.state.TrainState` (policy parameters, optimiser
state, frozen reference when ``beta > 0``, step count) and runs the step on one of the systems in
:data:`jaxrl_sym.rl.systems.REGISTRY`, which share everything except generation, the layout and
the forward:

* ``sym``: :class:`~jaxrl_sym.runtime.engine.SymbolicLM` generates on exact-size stores; the
  reference, value and training forwards run on exact-length sequences bin-packed into rows
  (``SymbolicLM.forward_fn``, differentiated with ``jax.grad``); new weights go back with
  ``engine.set_params`` (no re-trace).
* ``padded``: :func:`~jaxrl_sym.baselines.padded.padded_generate` and ``padded_forward`` over rows
  padded to max prompt + max response, masked.

The stages themselves are functions in :mod:`jaxrl_sym.rl.stages` of a frozen
:class:`~jaxrl_sym.rl.context.StepContext` (what they read) and a state;
:func:`~jaxrl_sym.rl.stages.run_step` composes and times them around a rollout source (fresh
prompts, or partial rollouts), and :meth:`RLTrainer.commit` alone stores what a step returns.
Choices that matter:

* The "old" log-probs are the ones generation reported for the sampled tokens (at the sampling
  temperature). They are never recomputed: TRL and verl spend a whole forward pass on that.
* On ``sym`` the reference log-probs of a row are computed as soon as the row finishes: finished
  rows are packed into chunks whose reference forward is dispatched (asynchronously) while the
  remaining rows still decode (:mod:`jaxrl_sym.rl.overlap`). The padded baseline, like TRL,
  runs one reference pass over the padded batch after generation.
* Nothing is committed until the update succeeded: every stage reads the step's starting state
  and the update returns a new one, so a reward function that raises or returns a bad value
  leaves parameters, optimiser state, step counter and carried rows as they were.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from jaxrl_sym.errors import InputError
from jaxrl_sym.models.contract import check_model, model_fingerprint
from jaxrl_sym.rl import stages
from jaxrl_sym.rl.algorithms import RLConfig
from jaxrl_sym.rl.context import Forwards, RolloutSource, StepContext
from jaxrl_sym.rl.layout import Layout
from jaxrl_sym.rl.partial import Carried, PartialBuffer, PartialConfig
from jaxrl_sym.rl.programs import Programs
from jaxrl_sym.rl.rollout import RewardFn, Rollout, compute_rewards
from jaxrl_sym.rl.sampling import SamplingConfig
from jaxrl_sym.rl.state import (
    TrainState,
    init_state,
    make_optimizer,
    params_sha256,
    place_state,
    state_shardings,
)
from jaxrl_sym.rl.systems import BindArgs, Bound, System, get_system
from jaxrl_sym.runtime.engine import SymbolicLM
from jaxrl_sym.sharding import MemoryBudget, data_size, make_mesh
from jaxrl_sym.sizes import parse_bytes

__all__ = ["RLTrainer", "RewardFn", "Rollout", "TrainState", "compute_rewards", "params_sha256"]


class RLTrainer:
    """Policy, optimiser and reference for RL fine-tuning, on a registered system.

    Args:
      model: the policy (its current weights are the starting point and, with ``beta > 0``, the
        reference).
      reward_fn: ``(prompt, response) -> float`` per sample.
      cfg: algorithm and hyper-parameters (:class:`RLConfig`).
      system: a name in :data:`jaxrl_sym.rl.systems.REGISTRY` — ``sym`` (exact lengths) or
        ``padded`` (baseline), or one added with :func:`~jaxrl_sym.rl.systems.register_system`.
      metric_fn: optional second per-sample function reported as ``exact_match`` (not optimised).
      min_capacity: initial slots of the symbolic runtime's growing stores.
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
      partial: partial rollouts (:mod:`jaxrl_sym.rl.partial`): a step stops generating when
        ``partial.fraction`` of its rows finished, trains the complete groups and carries the
        unfinished rows into the next step (None, the default: every step generates to the end).

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
        system: str = "sym",
        metric_fn: RewardFn | None = None,
        min_capacity: int = 16,
        mesh: Any = None,
        device_memory: int | str | None = None,
        partial: PartialConfig | None = None,
    ) -> None:
        self.system_impl: System = get_system(system)
        if cfg.speculate and not self.system_impl.speculates:
            raise InputError(f"RLConfig.speculate={cfg.speculate} (--speculate) runs on the "
                             f"symbolic runtime; system {system!r} decodes without it. Use "
                             "system='sym' or speculate=0")
        if not callable(reward_fn):
            raise InputError(f"reward_fn must be callable (prompt, response) -> float, got "
                             f"{type(reward_fn).__name__}")
        self.cfg = cfg
        self.system = system
        self.reward_fn = reward_fn
        self.metric_fn = metric_fn
        info = check_model(model)  # any model that follows the contract; fails early otherwise
        self.vocab_size = info.vocab_size
        self.model_fingerprint = model_fingerprint(model)
        self.graphdef, state = nnx.split(model)
        leaves, self.treedef = jax.tree_util.tree_flatten(state)
        self.tx = make_optimizer(cfg)
        self.mesh = make_mesh(mesh)
        self.state: TrainState = init_state(leaves, cfg, self.tx, self.vocab_size)
        self.shardings: dict[str, Any] | None = None
        if self.mesh is not None:
            self.shardings = state_shardings(self.state, self.mesh)
            self.state = place_state(self.state, self.shardings)
        self.budget = None if device_memory is None else MemoryBudget(
            parse_bytes(device_memory, flag="device_memory"))
        if self.budget is not None:  # before any program compiles: fail in seconds, not minutes
            st = self.state
            self.budget.check_tree((st.params, st.opt_state, st.ref),
                                   f"{info.name}'s parameters + optimiser state + reference")
        self.programs = Programs(self.budget)
        self.partial = partial
        self.rollouts = PartialBuffer(partial) if partial is not None else None
        bind_args = BindArgs(model, mesh=self.mesh, budget=self.budget, min_capacity=min_capacity,
                             max_pad_fraction=cfg.gen_max_pad_fraction, speculate=cfg.speculate,
                             speculate_adaptive=cfg.speculate_adaptive,
                             logprob_chunk=cfg.logprob_chunk)

        def bind(name: str) -> Bound:
            bound = get_system(name).bind(bind_args)  # traces now: a bad model fails here
            bound.set_params(self.state.params["lm"])
            return bound

        self.forwards = Forwards(bind, self.tx, self.shardings)
        self.forwards.system(system)

    # ------------------------------------------------------------------ state
    def commit(self, state: TrainState, carried: PartialBuffer | None = None) -> None:
        """Make ``state`` the trainer's (and ``carried`` the rows partial rollouts carry, when
        given); every bound system gets the new weights in place (no re-trace). The only
        writer of the trainer's evolving state: steps, checkpoint restore and the field
        setters below all go through it."""
        self.state = state
        if carried is not None:
            self.rollouts = carried
        self.forwards.set_params(state.params["lm"])

    @property
    def params(self) -> Any:
        return self.state.params

    @params.setter
    def params(self, value: Any) -> None:
        self.commit(self.state.replace(params=value))

    @property
    def opt_state(self) -> Any:
        return self.state.opt_state

    @opt_state.setter
    def opt_state(self, value: Any) -> None:
        self.commit(self.state.replace(opt_state=value))

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

    def params_sha256(self) -> str:
        return params_sha256(self.params)

    # ------------------------------------------------------------------ pieces
    @property
    def context(self) -> StepContext:
        """What the stages read (:class:`StepContext`), from the trainer's current settings."""
        return StepContext(
            cfg=self.cfg, sampling=SamplingConfig.of(self.cfg),
            system=self.forwards.system(self.system), forwards=self.forwards,
            programs=self.programs, reward_fn=self.reward_fn, metric_fn=self.metric_fn,
            vocab_size=self.vocab_size, row_multiple=data_size(self.mesh),
            overlaps_reference=self.overlaps_reference)

    @property
    def engine(self) -> SymbolicLM:
        """The symbolic runtime generating for this trainer (the sym system's; shares the
        trainer's weights)."""
        return self.forwards.system("sym").engine  # type: ignore[attr-defined]

    def model(self) -> nnx.Module:
        """An NNX model holding the current policy weights."""
        return nnx.merge(self.graphdef, jax.tree_util.tree_unflatten(self.treedef,
                                                                     self.params["lm"]))

    def fns(self, system: str) -> dict[str, Any]:
        """Jitted reference / value / loss-grad / update functions for one system's layout."""
        return self.context.fns(system)

    @property
    def overlaps_reference(self) -> bool:
        """``cfg.overlap_reference``, or where it is None (auto) whether the device is an
        accelerator. Why not on a CPU: there the "device" is the host's own cores, so scoring
        chunks during generation does not fill idle device time, it competes with the decode
        loop for the same cores; on the CPU step benchmark it cost 0.33 s of generation +
        reference per step (1.27 s against 0.94 s) and 0.9 s of step time."""
        if self.cfg.overlap_reference is not None:
            return bool(self.cfg.overlap_reference)
        devices = self.mesh.devices.flat if self.mesh is not None else jax.devices()
        return next(iter(devices)).platform != "cpu"

    # ------------------------------------------------------------------ public stages
    def generate(self, prompts: Sequence[np.ndarray | Sequence[int]], seed: int,
                 limits: Sequence[int] | None = None) -> Rollout:
        """G samples per prompt at the configured temperature, with their sampling log-probs
        (:func:`jaxrl_sym.rl.stages.generate` at the current state; nothing is trained)."""
        return stages.generate(self.context, self.state, prompts, seed, limits)

    def greedy(self, prompts: Sequence[np.ndarray], max_new_tokens: int) -> list[np.ndarray]:
        """Greedy responses of the current policy (evaluation; nothing is trained)."""
        gcfg = SamplingConfig.of(self.cfg).greedy(max_new_tokens)
        return self.forwards.system(self.system).greedy(list(prompts), gcfg)

    def layout(self, rollout: Rollout, system: str | None = None) -> Layout:
        """The rollout in ``system``'s training layout (default: the trainer's system)."""
        return self.context.layout(rollout, system)

    def prepare(self, rollout: Rollout, rewards: np.ndarray, system: str | None = None
                ) -> tuple[Layout, dict[str, np.ndarray]]:
        """Layout + loss arrays for a rollout on ``system`` at the current state (reference and
        values via that system's forward)."""
        ctx, state = self.context, self.state
        layout = ctx.layout(rollout, system)
        ref = stages.reference_logprobs(ctx, state, layout)
        return layout, stages.advantages(ctx, state, layout, rollout, rewards, ref)[0]

    def loss_and_grads(self, rollout: Rollout, rewards: np.ndarray, system: str | None = None
                       ) -> tuple[float, dict[str, float], Any]:
        """(loss, aux, grads) at the current parameters, without updating (tests, debugging)."""
        layout, arrays = self.prepare(rollout, rewards, system)
        (loss, aux), grads = self.programs.run(f"grad-{layout.system}", self.fns(layout.system)[
            "grad"], self.params, layout.inputs, arrays)
        return float(loss), {k: float(v) for k, v in aux.items()}, grads

    # ------------------------------------------------------------------ bench compatibility
    # bench/experiments/{sharding,rlft_step}.py (the bench helper's files) still call these two;
    # drop them once they call stages.update_once(trainer.context, ...) and
    # trainer.state.resident_bytes().
    def _update(self, params: Any, opt_state: Any, layout: Layout,
                arrays: dict[str, np.ndarray]) -> tuple[Any, Any, dict[str, float]]:
        return stages.update_once(self.context, params, opt_state, self.ref_leaves, layout,
                                  arrays)

    def _resident(self) -> int:
        return self.state.resident_bytes()

    # ------------------------------------------------------------------ the step
    def step(self, prompts: Sequence[np.ndarray | Sequence[int]], *, seed: int,
             limits: Sequence[int] | None = None) -> dict[str, Any]:
        """Run one full RL step and commit it; returns the step's metrics
        (:func:`jaxrl_sym.rl.stages.run_step`).

        With partial rollouts (``partial``) the rollout source is
        :class:`~jaxrl_sym.rl.partial.Carried`: ``prompts`` may then be empty to finish the
        carried rows.
        """
        source: RolloutSource = (stages.Fresh(prompts, seed, limits) if self.rollouts is None
                                 else Carried(self.rollouts, prompts, seed, limits))
        outcome = stages.run_step(self.context, self.state, source)
        self.commit(outcome.state, outcome.carried)
        return outcome.metrics
