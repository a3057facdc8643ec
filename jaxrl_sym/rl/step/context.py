"""What every stage of an RL step reads and never changes: the :class:`StepContext`.

Why an object of its own: the stages used to take the trainer and read some eighteen of its
attributes (config, system, engine, compiled programs, reward function, resident bytes...), so a
stage's inputs were "the whole trainer" and partial rollouts reached back into it to swap the
rollout buffer. A frozen context names exactly what a step needs; the evolving parts — the
:class:`~jaxrl_sym.rl.step.state.TrainState` and the rows partial rollouts carry — are passed in and
returned, and only the trainer's commit stores them.

This module imports nothing that imports it back: the trainer (:mod:`jaxrl_sym.rl.step.trainer`)
builds contexts, the stages (:mod:`jaxrl_sym.rl.step.stages`) and rollout sources
(:mod:`jaxrl_sym.rl.step.partial`) only read them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import jax
import numpy as np
import optax

from jaxrl_sym.rl.config import RLConfig
from jaxrl_sym.rl.knobs import DEFAULT_UPDATE_TOKENS, ExecutionConfig
from jaxrl_sym.rl.step.programs import Programs, Weights, build_fns
from jaxrl_sym.rl.step.rollout import Drawn, RewardFn, Rollout
from jaxrl_sym.rl.step.sampling import SamplingConfig
from jaxrl_sym.rl.step.state import TrainState
from jaxrl_sym.systems.layout import Layout
from jaxrl_sym.systems.trainable import TrainableSystem, TrainBound

__all__ = ["Forwards", "RolloutSource", "StepContext", "fit_to_micro_batches", "micro_batch_rows",
           "rows_per_chunk"]


def rows_per_chunk(cfg: ExecutionConfig, width: int, multiple: int = 1, *,
                   fixed: bool = False) -> int | None:
    """Rows of ``width`` slots per forward so one program holds at most ``update_tokens`` slots
    (None: no limit). Every whole-batch forward — reference, values, update — is cut to this:
    the ``[slots × vocab]`` logits are what exhausts memory at real vocabularies (151,936 words:
    0.6 MB per slot in fp32). On a mesh the count is a multiple of ``multiple`` (the data axes'
    devices, at least one row each), so every chunk splits evenly. ``fixed``: the layout's
    system has fixed micro-batches (``TrainableSystem.fixed_micro_batches``), which take
    :data:`~jaxrl_sym.rl.knobs.DEFAULT_UPDATE_TOKENS` where ``update_tokens`` is unset."""
    tokens = cfg.update_tokens
    if tokens is None and fixed:
        tokens = DEFAULT_UPDATE_TOKENS
    if tokens is None:
        return None
    per = max(1, tokens // width)
    return max(multiple, per // multiple * multiple)


def micro_batch_rows(filled: int, per: int, multiple: int = 1) -> int:
    """Rows of a fixed-micro-batch system's batch of ``filled`` rows, micro-batches of at most
    ``per`` rows (:func:`rows_per_chunk`): whole micro-batches of ``per`` when the batch fills
    one, else one micro-batch at the next power of two (a multiple of ``multiple``, at most
    ``per``). Why the power of two below: a batch smaller than one micro-batch (a CPU run of a
    few short samples) filled to ``per`` rows computed up to 95% empty slots
    (``bench/results/cpu/growing_rl.md``); a power of two keeps the filler under half and the
    programs per row length to ``log2(per) + 1`` shapes — one or two in a run whose batch size
    does not change by orders of magnitude."""
    if filled >= per:
        return -(-filled // per) * per
    rows = 1 << max(0, filled - 1).bit_length()
    return min(per, -(-rows // multiple) * multiple)


def fit_to_micro_batches(cfg: ExecutionConfig, layout: Layout, multiple: int = 1) -> Layout:
    """``layout`` as the step runs it: for a system with fixed micro-batches, its filled rows
    completed with empty rows to :func:`micro_batch_rows` — a count fixed by the row length
    and the batch's power-of-two size class, so the reference / value / update programs it
    runs have one shape per (row length, size class) — else padded to a multiple of
    ``multiple`` (a mesh's data axes) as before. Empty rows hold no span: mask off, weight 0,
    nothing added to the loss, its gradient or any reported mean."""
    system = layout.system
    if not system.fixed_micro_batches:
        return system.pad_rows(layout, multiple)
    per = rows_per_chunk(cfg, layout.shape[1], multiple, fixed=True)
    assert per is not None
    return system.fit_rows(layout, micro_batch_rows(layout.filled_rows, per, multiple))


class Forwards:
    """Each layout system's bound forward and jitted step functions, built on first use.

    A trainer trains on its own system, but a rollout may be laid out and scored on another
    (``loss_and_grads(..., "padded")`` compares the two): every system gets its own bound
    system and programs, keyed by the :class:`~jaxrl_sym.systems.trainable.TrainableSystem` a
    :class:`~jaxrl_sym.systems.layout.Layout` carries.
    """

    def __init__(self, bind: Callable[[TrainableSystem], TrainBound],
                 tx: optax.GradientTransformation, shardings: dict[str, Any] | None,
                 weights: Weights | None = None) -> None:
        self._bind, self._tx, self._shardings = bind, tx, shardings
        self._weights = weights  # the precision/LoRA policy: trained leaves -> the forward's
        self._bound: dict[TrainableSystem, TrainBound] = {}
        self._fns: dict[TrainableSystem, dict[str, Any]] = {}

    def bound(self, system: TrainableSystem) -> TrainBound:
        """``system`` bound to this trainer's policy."""
        if system not in self._bound:
            self._bound[system] = self._bind(system)
        return self._bound[system]

    def fns(self, system: TrainableSystem, cfg: RLConfig) -> dict[str, Any]:
        """Jitted reference / value / loss-grad / update functions of ``system``'s layout
        (:func:`~jaxrl_sym.rl.step.programs.build_fns`), built with ``cfg`` on first use."""
        if system not in self._fns:
            self._fns[system] = build_fns(cfg, self._tx, self.bound(system).logits_fn(),
                                          self._shardings, self._weights)
        return self._fns[system]

    def set_params(self, leaves: Any) -> None:
        """Every bound system gets the policy's new weights (the commit)."""
        for bound in self._bound.values():
            bound.set_params(leaves)

    def forward_leaves(self, state: Any) -> list[jax.Array]:
        """The forward's weights of ``state`` (a :class:`TrainState`): what ``set_params``
        takes."""
        assert self._weights is not None
        return self._weights.compute_copy(state.params["lm"], state.frozen)

    def release_params(self, cfg: RLConfig) -> bool:
        """Before an update: where the forward's weights are a copy of the trained ones (bf16
        cast, LoRA adapters; ``Weights.copies``), every bound system drops it — the update
        differentiates through its own cast/merge, and the commit brings a fresh copy — so it is
        freed for the update's peak. Programs are built first (they read the model's weights
        when built). Returns whether anything was released; the caller restores the copy
        (``set_params``) if the update does not commit."""
        if self._weights is None or not self._weights.copies:
            return False
        for system, bound in self._bound.items():
            self.fns(system, cfg)
            bound.release_params()
        return True


@dataclass(frozen=True)
class StepContext:
    """The fixed machinery of a step (see the module docstring).

    cfg / sampling: the step's knobs, and how samples are drawn (from ``cfg.algorithm``).
    system: the trainer's system, bound to its policy (generates; the default layout).
    forwards: bound systems and their jitted functions, by the system a layout carries.
    programs: the compiled-program cache (peak-memory accounting; :class:`Programs`).
    reward_fn / metric_fn: the optimised per-sample reward, and a reported-only one (or None).
    vocab_size: the policy's vocabulary (prompts are checked against it).
    row_multiple: rows of every training batch are a multiple of this (the mesh's data axes).
    overlaps_reference: score the reference while generation runs (where the system can).
    """

    cfg: RLConfig
    sampling: SamplingConfig
    system: TrainBound
    forwards: Forwards
    programs: Programs
    reward_fn: RewardFn
    metric_fn: RewardFn | None
    vocab_size: int
    row_multiple: int
    overlaps_reference: bool

    def fns(self, system: TrainableSystem) -> dict[str, Any]:
        """The jitted functions of ``system``'s layout (:class:`Forwards`)."""
        return self.forwards.fns(system, self.cfg)

    def rows_per_chunk(self, width: int) -> int | None:
        """Rows of ``width`` slots per forward (:func:`rows_per_chunk`)."""
        return rows_per_chunk(self.cfg.execution, width, self.row_multiple)

    def layout(self, rollout: Rollout, system: TrainableSystem | None = None) -> Layout:
        """The rollout in ``system``'s training layout (default: the trainer's system), as the
        step runs it (:meth:`lay_out`)."""
        return self.lay_out(rollout.prompts, rollout.responses, system)

    def lay_out(self, prompts: Sequence[np.ndarray], responses: Sequence[np.ndarray],
                system: TrainableSystem | None = None) -> Layout:
        """Prompts and responses in ``system``'s training layout, as the step runs it: in whole
        micro-batches where the system has fixed ones, else with its rows padded to a multiple
        of the mesh's data axes (:func:`fit_to_micro_batches`)."""
        bound = self.system if system is None else self.forwards.bound(system)
        run = self.cfg.execution
        lay = bound.layout(prompts, responses, row_len=run.pack_row_len,
                           share_prompts=run.share_prompts)
        return fit_to_micro_batches(run, lay, self.row_multiple)


class RolloutSource(Protocol):
    """Where a step's samples come from: fresh prompts (:class:`~jaxrl_sym.rl.step.stages.Fresh`) or
    partial rollouts (:class:`~jaxrl_sym.rl.step.partial.Carried`). ``draw`` must not change
    anything it was given: what it carries into the next step it returns in :class:`Drawn`, and the
    trainer stores it only when the step commits."""

    def draw(self, ctx: StepContext, state: TrainState) -> Drawn: ...
