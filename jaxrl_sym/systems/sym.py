"""``sym``: the symbolic runtime (:class:`~jaxrl_sym.runtime.engine.SymbolicLM`, or
:class:`~jaxrl_sym.runtime.speculative.lm.SpeculativeLM` when ``BindOptions.speculate`` > 0) as a
system, both halves: :class:`SymBound` generates (the decode command, evaluation, an RL step's
rollouts) and gives the RL step its layout and forward; :class:`SymSystem` is the RL half's
value (packed layouts, the key of the step's programs). Variants ``sym-xla`` / ``sym-triton`` /
``sym-pallas`` / ``sym-auto`` fix the kernels' backend.

Its memory estimate is the runtime's own store plan (:func:`jaxrl_sym.runtime.memory.estimate.
estimate_sym`); its work is the host policy's replay (:func:`jaxrl_sym.runtime.policy.replay`)
booked by cause exactly as the decode groups book it while they run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from functools import cached_property
from typing import Any, ClassVar

import jax
import numpy as np
from flax import nnx

from jaxrl_sym.errors import InputError
from jaxrl_sym.generation import GenerationConfig, GenerationResult, row_limits
from jaxrl_sym.runtime.engine import SymbolicLM
from jaxrl_sym.runtime.evaluate import constant_values, evaluate
from jaxrl_sym.runtime.memory.estimate import Estimate
from jaxrl_sym.runtime.memory.ledger_generation import GenerationLedger
from jaxrl_sym.runtime.metrics import WorkLog
from jaxrl_sym.runtime.options import EngineOptions, Speculation
from jaxrl_sym.runtime.packing import PackedPrompts
from jaxrl_sym.runtime.policy import Dispatch, GroupShape, packed_row_len, replay
from jaxrl_sym.runtime.speculative.lm import DRAFTS, SpeculativeLM
from jaxrl_sym.systems.bound import token_report
from jaxrl_sym.systems.forward import FeaturesFn, LogitsFn
from jaxrl_sym.systems.layout import Layout, packed_layout, shared_prefix_layout
from jaxrl_sym.systems.overlap import OVERLAP_ROWS, ReferenceOverlap
from jaxrl_sym.systems.spec import BindOptions, SystemSpec
from jaxrl_sym.systems.trainable import ChunkRows, ScoreFn, TrainableSystem, TrainBound
from jaxrl_sym.tracer.trace import SeqInput, trace_function


def check_draft(draft: Any) -> None:
    """A draft name must be one of :data:`DRAFTS`; anything else is a draft model."""
    if isinstance(draft, str) and draft not in DRAFTS:
        raise InputError(f"--draft {draft}: choose one of {', '.join(DRAFTS)} or a model preset")


class SymSystem(TrainableSystem):
    """The symbolic runtime's RL half: bin-packed exact-length rows for every forward
    (``SymbolicLM.forward_fn``)."""

    input_fill: ClassVar[tuple[int, ...]] = (0, -1, -1)  # tokens, positions, segment ids
    fixed_micro_batches: ClassVar[bool] = True  # rows per micro-batch from the row length only

    def bind(self, model: nnx.Module, options: BindOptions) -> SymBound:
        bound = super().bind(model, options)
        assert isinstance(bound, SymBound)
        bound.lm  # noqa: B018 -- traced now: a model the runtime rejects fails at bind
        return bound

    def build_layout(self, prompts: Sequence[np.ndarray], responses: Sequence[np.ndarray], *,
                     row_len: int | None, share_prompts: bool = False) -> Layout:
        """Packed exact-length rows; with ``share_prompts`` a group's prompt is placed once per
        row and its responses attend to it (the masked primitive sees parent segments)."""
        build = shared_prefix_layout if share_prompts else packed_layout
        return build(prompts, responses, row_len=row_len)


class SymBound(TrainBound):
    """The symbolic runtime on one model, for the decode command and for one trainer's policy.
    The runtime is built (the model traced and planned) on first use, so binding only to
    estimate costs no second trace; ``set_params`` replaces its weights in place (no
    re-trace)."""

    @cached_property
    def lm(self) -> SymbolicLM:
        """The engine, with the options' engine knobs and backend, speculation, mesh and memory
        budget (generation programs are checked against it too)."""
        o = self.options
        engine = o.engine if o.engine is not None else EngineOptions()
        if o.backend is not None:
            engine = dataclasses.replace(engine, backend=o.backend)
        if o.speculate:
            lm: SymbolicLM = SpeculativeLM(
                self.model, engine, speculation=Speculation(o.speculate, o.speculate_adaptive),
                draft=o.draft, mesh=o.mesh)
        else:
            lm = SymbolicLM(self.model, engine, mesh=o.mesh)
        lm.cache.budget = o.budget
        return lm

    def set_params(self, leaves: list[jax.Array]) -> None:
        super().set_params(leaves)
        self.lm.set_params(leaves)

    def release_params(self) -> None:
        super().release_params()
        self.lm.release_params()

    def generate(self, prompts: Sequence[np.ndarray], cfg: GenerationConfig) -> GenerationResult:
        return self.lm.generate(prompts, cfg, on_progress=self.options.progress)

    def estimate(self, prompt_lens: Sequence[int], cfg: GenerationConfig) -> Estimate:
        """The engine prices its own options (refill, microbatch rows, capacities,
        speculation's larger stores), labelled with this system's name (``sym-xla``...)."""
        return dataclasses.replace(self.lm.estimate(prompt_lens, cfg), system=self.name)

    def ledger(self, prompts: Sequence[np.ndarray], cfg: GenerationConfig, *,
               compiler: Callable[[Any], Any] | None = None) -> GenerationLedger | None:
        """The runtime's own dispatches over its plan (:func:`~jaxrl_sym.runtime.
        ledger_generation.sym_ledger`); None with speculation (its verify programs are not
        walked: :meth:`estimate` covers them)."""
        if self.options.speculate:
            return None
        return self.lm.ledger(prompts, cfg, compiler=compiler)

    def generate_until(self, prompts: list[np.ndarray], gcfg: GenerationConfig,
                       stop_when: Callable[[np.ndarray], bool], stop_live: int | None = None
                       ) -> GenerationResult:
        """The host loop asks ``stop_when`` after every read-back (a tile of steps), in one
        decode loop for all rows: with the step's own microbatch policy, the rows carried from
        the last step (prompt + tokens so far: longer prompts, shorter limits) became a second
        loop that ran after the new rows had all finished, several times slower per carried
        step, and the stop rule could not end the first loop while carried rows it waits for
        had not started."""
        return self.lm.generate(prompts, gcfg, stop_when=stop_when, stop_live=stop_live,
                                max_pad_fraction=1.0)

    def generate_scoring(self, prompts: list[np.ndarray], gcfg: GenerationConfig,
                         score: ScoreFn, *, row_len: int | None, rows_per_chunk: ChunkRows,
                         ahead: Callable[[Layout], None] | None = None
                         ) -> tuple[GenerationResult, ReferenceOverlap | None]:
        """Finished rows are packed into chunks whose reference forward is dispatched while the
        remaining rows still decode (see :mod:`jaxrl_sym.systems.overlap`): a row's reference
        log-probs depend only on its own tokens, which exact-length stores make available the
        moment it ends.

        When the engine compiles ahead (``EngineOptions.compile_threads``), the chunks' program
        starts compiling before generation (``ahead``, at one chunk of the step's row length):
        else the first chunk compiles on the host thread between two decode tiles, with no tile
        in flight, and the device waits for it."""
        # One row length for the whole step (the longest possible prompt + response), so the
        # chunks reuse a handful of compiled programs.
        limits = gcfg.max_new_tokens
        longest = max(len(p) for p in prompts) + (max(limits) if isinstance(limits, tuple)
                                                  else int(limits))
        row_len = row_len or packed_row_len(longest)  # the update's rows (layout)
        # full chunks of one row (at most the forward's budget) as rows finish: min_rows unused
        rows = min(OVERLAP_ROWS, rows_per_chunk(row_len) or OVERLAP_ROWS)
        overlap = ReferenceOverlap(prompts, row_len, score, min_rows=1, max_rows=rows)
        if ahead is not None and self.lm.plan.compile_threads:
            ahead(overlap.chunk_layout(rows))
        return self.lm.generate(prompts, gcfg, on_finished=overlap.on_finished), overlap

    def logits_fn(self) -> LogitsFn:
        fwd = self.lm.forward_fn()
        return self.split_forward(lambda leaves, inputs: fwd(leaves, *inputs),
                                  lambda: traced_features(self))

    def work(self, prompt_lens: Sequence[int], response_lens: Sequence[int],
             cfg: GenerationConfig) -> dict[str, Any]:
        """The policy's dispatches for rows that end at ``response_lens`` (plain decoding; every
        prompt distinct), booked as :class:`~jaxrl_sym.runtime.group.loop.DecodeGroup` books
        them."""
        plan, lens = self.lm.plan, [int(p) for p in prompt_lens]
        limits = [int(n) for n in response_lens]
        row_limits(cfg, len(lens))  # the request is checked as generate checks it
        o = plan.options
        plans = replay(lens, limits, min_capacity=o.min_capacity, tiling=plan.group_tiling(cfg),
                       need=plan.growing_need, max_pad_fraction=o.max_pad_fraction,
                       microbatch_rows=o.microbatch_rows, compaction=plan.compaction)
        log = WorkLog()
        for group, (shape, dispatches) in zip(plan.microbatches(lens, limits), plans,
                                              strict=True):
            _book_prefill(log, [lens[i] for i in group], shape, packed=o.prefill == "packed")
            _book_decode(log, [limits[i] for i in group], shape, dispatches)
        return token_report(log)


def _book_prefill(log: WorkLog, lens: list[int], shape: GroupShape, *, packed: bool) -> None:
    """One group's prefill: the packed rows' positions, or the right-aligned prompt block."""
    b, pcap = shape.rows, shape.prompt_slots
    log.needed += sum(lens)
    if packed:
        pk = PackedPrompts.build([np.full(n, i, np.int32) for i, n in enumerate(lens)],
                                 pcap, vocab=1, logits_bytes=1 << 62)
        log.computed += pk.positions_computed
        log.add("packing", pk.positions_computed - pk.prompt_tokens)
        return
    log.computed += b * pcap
    log.add("prompt_alignment", sum(pcap - n for n in lens))
    log.add("row_bucket", (b - len(lens)) * pcap)


def _book_decode(log: WorkLog, limits: list[int], shape: GroupShape,
                 dispatches: Sequence[Dispatch]) -> None:
    """One group's decode dispatches: rows emit ``min(tile, left)`` tokens each; a compaction
    (a smaller row bucket) keeps the live rows only."""
    left = [n - 1 for n in limits]  # the prefill emitted each row's first token
    present, rows = len(limits), shape.rows
    for d in dispatches:
        live = [x for x in left if x > 0]
        if d.rows < rows:
            present = len(live)
        rows = d.rows
        used = sum(min(d.tile, x) for x in live)
        log.computed += d.rows * d.tile
        log.needed += used
        log.add("row_bucket", (d.rows - present) * d.tile)
        log.add("finished_rows", (present - len(live)) * d.tile)
        log.add("tile_overrun", len(live) * d.tile - used)
        left = [max(0, x - d.tile) for x in left]


def traced_features(bound: SymBound) -> FeaturesFn:
    """The sym system's ``features`` forward: ``model.features`` traced into its own PDG (as
    the runtime traces ``model``) and evaluated on packed rows by the runtime's one evaluator
    (:func:`jaxrl_sym.runtime.evaluate.evaluate`), as ``StepBuilder.forward`` is — the masked
    attention primitive, differentiable in the leaves.

    Traced once per trainer (when its programs are built); the weights are the same leaves, in
    the same order, as the whole-logits program's.
    """
    graphdef, state = nnx.split(bound.model)
    role = ("tokens", "positions", "segment_ids")
    prog = trace_function(
        lambda st, t, p, s: nnx.merge(graphdef, st).features(t, p, s), state,
        [SeqInput(r, "B, T") for r in role])
    pdg, consts = prog.pdg, constant_values(prog.consts)
    weight_ids = [nid for r, nid in pdg.inputs if r.startswith("weight:")]

    def features(leaves: list[jax.Array], inputs: tuple[jax.Array, ...]) -> jax.Array:
        weights = {nid: (x,) for nid, x in zip(weight_ids, leaves, strict=True)}
        out = evaluate(pdg, {**weights, **consts}, *inputs)
        return out[pdg.outputs[0]][0]

    return features


def bind(spec: SystemSpec, model: Any, options: BindOptions) -> SymBound:
    check_draft(options.draft)
    return SymBound(spec, model, options)
