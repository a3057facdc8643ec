"""``sym``: the symbolic runtime (:class:`~jaxrl_sym.runtime.engine.SymbolicLM`, or
:class:`~jaxrl_sym.runtime.speculative.SpeculativeLM` when ``BindOptions.speculate`` > 0) as a
bound system. Variants ``sym-xla`` / ``sym-triton`` / ``sym-auto`` fix the kernels' backend.

Its memory estimate is the runtime's own store plan (:func:`jaxrl_sym.runtime.estimate.
estimate_sym`); its work is the host policy's replay (:func:`jaxrl_sym.runtime.policy.replay`)
booked by cause exactly as the decode groups book it while they run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from functools import cached_property
from typing import Any

import numpy as np

from jaxrl_sym.errors import InputError
from jaxrl_sym.generation import GenerationConfig, GenerationResult, row_limits
from jaxrl_sym.runtime.engine import SymbolicLM
from jaxrl_sym.runtime.estimate import Estimate, estimate_sym
from jaxrl_sym.runtime.ledger_generation import GenerationLedger
from jaxrl_sym.runtime.metrics import WorkLog
from jaxrl_sym.runtime.options import EngineOptions, Speculation
from jaxrl_sym.runtime.packing import PackedPrompts
from jaxrl_sym.runtime.policy import Dispatch, GroupShape, replay
from jaxrl_sym.runtime.speculative import DRAFTS, SpeculativeLM
from jaxrl_sym.systems.bound import BoundSystem, max_limit, token_report
from jaxrl_sym.systems.spec import BindOptions, SystemSpec


def check_draft(draft: Any) -> None:
    """A draft name must be one of :data:`DRAFTS`; anything else is a draft model."""
    if isinstance(draft, str) and draft not in DRAFTS:
        raise InputError(f"--draft {draft}: choose one of {', '.join(DRAFTS)} or a model preset")


class SymBound(BoundSystem):
    """The symbolic runtime on one model. The runtime is built (the model traced and planned)
    on first use, so binding only to estimate costs no second trace."""

    @cached_property
    def lm(self) -> SymbolicLM:
        o = self.options
        engine = (EngineOptions(backend=o.backend) if o.engine is None
                  else dataclasses.replace(o.engine, backend=o.backend))
        if o.speculate:
            return SpeculativeLM(self.model, engine, speculation=Speculation(o.speculate),
                                 draft=o.draft)
        return SymbolicLM(self.model, engine, mesh=o.mesh)

    def generate(self, prompts: Sequence[np.ndarray], cfg: GenerationConfig) -> GenerationResult:
        return self.lm.generate(prompts, cfg, on_progress=self.options.progress)

    def estimate(self, prompt_lens: Sequence[int], cfg: GenerationConfig) -> Estimate:
        return estimate_sym(self.model, len(prompt_lens), int(max(prompt_lens)),
                            max_limit(cfg, len(prompt_lens)), cfg, name=self.name)

    def ledger(self, prompts: Sequence[np.ndarray], cfg: GenerationConfig, *,
               compiler: Callable[[Any], Any] | None = None) -> GenerationLedger | None:
        """The runtime's own dispatches over its plan (:func:`~jaxrl_sym.runtime.
        ledger_generation.sym_ledger`); None with speculation (its verify programs are not
        walked: :meth:`estimate` covers them)."""
        if self.options.speculate:
            return None
        return self.lm.ledger(prompts, cfg, compiler=compiler)

    def work(self, prompt_lens: Sequence[int], response_lens: Sequence[int],
             cfg: GenerationConfig) -> dict[str, Any]:
        """The policy's dispatches for rows that end at ``response_lens`` (plain decoding; every
        prompt distinct), booked as :class:`~jaxrl_sym.runtime.group.DecodeGroup` books them."""
        plan, lens = self.lm.plan, [int(p) for p in prompt_lens]
        limits = [int(n) for n in response_lens]
        row_limits(cfg, len(lens))  # the request is checked as generate checks it
        o = plan.options
        plans = replay(lens, limits, min_capacity=o.min_capacity, tiling=plan.tiling,
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


def bind(spec: SystemSpec, model: Any, options: BindOptions) -> SymBound:
    check_draft(options.draft)
    return SymBound(spec, model, options)
