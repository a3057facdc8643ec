"""The memory ledger of one RL step, from shapes and compiled programs alone — nothing runs.

Why: an RL step's peak is decided by a few buffers — weights, Adam state, the reference copy,
the generation stores, and the largest program's XLA temporaries — and which one wins depends on
the system, the micro-batch and the device. This builds the step's
:class:`~jaxrl_sym.runtime.memory.ledger.Ledger` for a trainer and a batch by compiling (never
running) each program the step would run, at the batch's real shapes, and reading XLA's own
``memory_analysis``/``cost_analysis`` (:class:`~jaxrl_sym.runtime.memory.ledger.ProgramSize`):

* **generation**: the state + what the generating system adds at its peak — given by the caller:
  the system's own walk over the step's lengths (:meth:`BoundSystem.ledger`) or its worst-case
  estimate (:meth:`BoundSystem.estimate`) — plus, where the reference is scored while generation
  runs, the reference chunks in flight (:data:`~jaxrl_sym.systems.overlap.MAX_INFLIGHT`);
* **reference**: the state + each reference chunk's program (``update_tokens`` slots);
* **update**: the state + each micro-batch's gradient program, the gradient accumulator and the
  optimiser's ``apply`` (one fused ``update`` program when the batch is one micro-batch).

The programs are the trainer's own (``StepContext.fns``), compiled for the shapes the step's own
chunking (:func:`~jaxrl_sym.rl.step.stages.row_chunks`) produces, so the ledger follows the code
that runs rather than a model of it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxrl_sym.rl.step.stages import row_chunks
from jaxrl_sym.runtime.memory.ledger import Buffer, Ledger, Moment, ProgramSize, moment, tree_buffer
from jaxrl_sym.runtime.memory.ledger_generation import GenerationLedger
from jaxrl_sym.runtime.programs import Build
from jaxrl_sym.systems.overlap import MAX_INFLIGHT, OVERLAP_ROWS, chunk_waits_for
from jaxrl_sym.systems.trainable import TrainBound

__all__ = ["StepLedger", "step_ledger"]


@dataclass(frozen=True)
class StepLedger:
    """A step's ledger and every program it compiled (for the time projection)."""

    ledger: Ledger
    programs: tuple[tuple[str, int, ProgramSize], ...]  # (stage, times it runs, size)
    layout_shape: tuple[int, int]


def step_ledger(trainer: Any, prompts: Sequence[np.ndarray], limits: Sequence[int], *,
                overlap: bool = False, generation: Any = None,
                compiler: Compiler | None = None) -> StepLedger:
    """The ledger of one step of ``trainer`` (an :class:`~jaxrl_sym.rl.step.trainer.RLTrainer`) on
    ``prompts`` (already expanded G-fold) whose responses have ``limits`` tokens.

    ``overlap``: the trainer scores the reference during generation (on an accelerator), which
    applies to systems that can (their ``generate_scoring`` overlaps).
    ``generation``: what generation adds to the state — the generating system's walk over these
    lengths (a :class:`~jaxrl_sym.runtime.memory.ledger_generation.GenerationLedger`, from
    ``TrainBound.ledger``) or its worst-case
    :class:`~jaxrl_sym.runtime.memory.estimate.Estimate` (None: no generation moment).
    ``compiler``: ``compiler(build) -> Compiled`` for the step's programs
    (:class:`~jaxrl_sym.runtime.programs.Build`; None: compiled on this machine; the bench
    passes a compile for a GPU it does not have, ``bench/lib/projection/xla_gpu.py``)."""
    ctx, state = trainer.context, trainer.state
    responses = [np.ones(int(n), np.int32) for n in limits]
    lay = ctx.lay_out(list(prompts), responses)  # as the step runs it (whole micro-batches)
    fns = ctx.fns(lay.system)
    held = [tree_buffer("policy weights", "weights", state.params),
            tree_buffer("optimiser state", "optimizer", state.opt_state)]
    if state.ref and state.ref is not state.frozen:  # LoRA's reference is its frozen base
        held.append(tree_buffer("reference weights", "reference", state.ref))
    if state.frozen is not None:
        held.append(tree_buffer("frozen base weights (LoRA)", "weights", state.frozen))
    held_update = list(held)  # the update runs without the forward's copy (released)
    copy = trainer.view.forward_copy(state.params["lm"], state.frozen)
    if copy:
        # the forward's own arrays (a bf16 cast; LoRA's adapters), alive beside the masters
        # until the update (Forwards.release_params), then refreshed by the commit
        held.append(tree_buffer(f"forward's {trainer.precision.compute} copy of the weights"
                                if trainer.view.lora is None else
                                f"LoRA adapters in {trainer.precision.compute} (forward)",
                                "weights", copy))
    moments: list[Moment] = []
    programs: list[tuple[str, int, ProgramSize]] = []
    compiler = compiler or _here
    ref_sizes = _reference(ctx, fns, state, lay, compiler) if state.ref else []
    if generation is not None:
        chunks = (_in_flight(_overlap_chunk(ctx, fns, state, lay, compiler))
                  if overlap and ref_sizes and _scores_while_generating(ctx.system) else [])
        moments.append(_generation_moment(held, generation, chunks,
                                          chunk_waits_for(OVERLAP_ROWS)))
    for count, size in ref_sizes:
        programs.append(("reference", count, size))
        moments.append(moment("reference", size.name, held, _batch(size), size.buffers()))
    for what, count, size, extra in _update(ctx, fns, state, lay, compiler):
        programs.append(("update", count, size))
        moments.append(moment("update", what, held_update, extra, _batch(size),
                              size.buffers()))
    return StepLedger(Ledger(ctx.system.name, tuple(moments)), tuple(programs),
                      tuple(int(x) for x in lay.shape))


def _in_flight(size: ProgramSize) -> list[Buffer]:
    """Up to MAX_INFLIGHT reference chunks queued behind the decode work, each holding its
    temporaries and outputs from enqueue to end (:mod:`jaxrl_sym.systems.overlap`)."""
    return [dataclasses.replace(b, name=f"{b.name} (reference chunk {k + 1} of {MAX_INFLIGHT} "
                                        "in flight)")
            for k in range(MAX_INFLIGHT) for b in size.buffers()]


def _generation_moment(held: list[Buffer], generation: Any, chunks: list[Buffer],
                       min_rows: int) -> Moment:
    """Generation's largest moment: over a walk's moments, each with the reference chunks in
    flight once ``min_rows`` rows have finished (none can be queued before: the overlap waits
    for them); for an estimate (every row to its limit), its terms with the chunks."""
    if not isinstance(generation, GenerationLedger):
        return moment("generation", "decode", held, generation.buffers(), chunks)
    return max((moment("generation", f"{m.stage}: {m.what}", held, m.buffers,
                       chunks if fin >= min_rows else [])
                for m, fin in generation.beyond_weights()), key=lambda m: m.total)


def _scores_while_generating(bound: Any) -> bool:
    """Whether the bound system overrides the default (no-overlap) ``generate_scoring``."""
    return type(bound).generate_scoring is not TrainBound.generate_scoring


def _batch(size: ProgramSize) -> list[Buffer]:
    """A program's batch arguments: its arguments beyond the weights/state listed as held."""
    return [Buffer(f"{size.name}: batch inputs", "batch", size.batch)] if size.batch else []


def _slices(ctx: Any, lay: Any) -> list[tuple[slice, int]]:
    """The distinct row-slice shapes the step cuts ``lay`` into, with how many times each runs."""
    out: dict[int, tuple[slice, int]] = {}
    for sl in row_chunks(ctx.cfg.execution, lay, ctx.row_multiple):
        n = len(range(*sl.indices(lay.shape[0])))
        first, count = out.get(n, (sl, 0))
        out[n] = (first, count + 1)
    return list(out.values())


def _arrays(lay: Any, sl: slice) -> dict[str, np.ndarray]:
    """Loss arrays of the layout's rows ``sl`` (values do not matter to a compile)."""
    z = np.zeros(lay.targets[sl].shape, np.float32)
    return {"targets": lay.targets[sl], "mask": z, "weight": z, "old_lp": z, "ref_lp": z,
            "adv": z}


Compiler = Callable[[Build], Any]
"""``compiler(build) -> jax.stages.Compiled``: how the ledger compiles a program."""


def _here(build: Build) -> Any:
    return build()


def _compile(compiler: Compiler, name: str, fn: Any, held_bytes: int, *args: Any
             ) -> ProgramSize:
    size = ProgramSize.of(name, compiler(Build(fn, args)), loops=True)
    return size.with_batch(max(0, size.args - held_bytes))


def _overlap_chunk(ctx: Any, fns: Any, state: Any, lay: Any, compiler: Compiler
                   ) -> ProgramSize:
    """The reference program of one chunk scored during generation (OVERLAP_ROWS rows of the
    step's row length)."""
    sl = slice(0, min(OVERLAP_ROWS, lay.shape[0]))
    ref_bytes = tree_buffer("", "reference", state.ref).nbytes
    return _compile(compiler, f"ref[{sl.stop}x{lay.shape[1]}]", fns["ref"], ref_bytes,
                    state.ref, tuple(x[sl] for x in lay.inputs), lay.targets[sl])


def _reference(ctx: Any, fns: Any, state: Any, lay: Any, compiler: Compiler
               ) -> list[tuple[int, ProgramSize]]:
    out = []
    ref_bytes = tree_buffer("", "reference", state.ref).nbytes
    for sl, count in _slices(ctx, lay):
        inputs = tuple(x[sl] for x in lay.inputs)
        name = f"ref[{lay.targets[sl].shape[0]}x{lay.shape[1]}]"
        out.append((count, _compile(compiler, name, fns["ref"], ref_bytes, state.ref, inputs,
                                    lay.targets[sl])))
    return out


def _update(ctx: Any, fns: Any, state: Any, lay: Any, compiler: Compiler
            ) -> list[tuple[str, int, ProgramSize, list[Buffer]]]:
    """(what, times run, program, buffers held besides the state) of the update stage."""
    params, opt, frozen = state.params, state.opt_state, state.frozen
    p_bytes = tree_buffer("", "weights", params).nbytes
    f_bytes = tree_buffer("", "weights", frozen).nbytes if frozen else 0  # held, not batch
    o_bytes = tree_buffer("", "optimizer", opt).nbytes
    slices = _slices(ctx, lay)
    if len(slices) == 1 and slices[0][1] == 1:
        sl = slices[0][0]
        size = _compile(compiler, f"update[{lay.shape[0]}x{lay.shape[1]}]", fns["update"],
                        p_bytes + o_bytes + f_bytes, params, opt, frozen,
                        tuple(x[sl] for x in lay.inputs), _arrays(lay, sl))
        return [("update", 1, size, [])]
    # the first micro-batch's gradients start the running sum; each later one is added into it
    # (donated: its output aliases it); apply takes the state and the sum, all held
    grads = Buffer("accumulated gradients", "gradients", p_bytes)
    out = []
    for i, (sl, count) in enumerate(slices):
        rows, args = lay.targets[sl].shape[0], (tuple(x[sl] for x in lay.inputs), _arrays(lay, sl))
        if i == 0:
            first = _compile(compiler, f"grad[{rows}x{lay.shape[1]}]", fns["grad"],
                             p_bytes + f_bytes, params, frozen, *args)
            out.append((first.name, 1, first, []))
            count -= 1
        if count:
            acc = _compile(compiler, f"accumulate[{rows}x{lay.shape[1]}]", fns["accumulate"],
                           2 * p_bytes + f_bytes, params, params, frozen, *args)
            out.append((acc.name, count, acc, [grads]))
    apply = _compile(compiler, "apply", fns["apply"], 2 * p_bytes + o_bytes, params, opt,
                     params)
    out.append(("apply", 1, apply, [grads]))
    return out
