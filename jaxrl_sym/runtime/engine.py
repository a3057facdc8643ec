"""SymbolicLM: a Flax LM traced once into a PDG, planned, and run on exact-size buffers.

Data flow: tracer (PDG) → passes (generation loop, storage plan) → programs (jitted per shape
bucket) → this host loop. The host loop is plain integer code: it decides when a growing store
grows, when finished rows are compacted away, which slot the next step writes; sympy is never
touched here (the live-slot counts come from functions compiled once by the planner).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from flax import nnx

from jaxrl_sym.errors import InputError
from jaxrl_sym.generation import (
    GenerationConfig,
    GenerationResult,
    row_limits,
    validate_prompts,
)
from jaxrl_sym.models.contract import check_model
from jaxrl_sym.passes.stores import StoreSpec
from jaxrl_sym.runtime.group.loop import DecodeGroup
from jaxrl_sym.runtime.group.outputs import Outputs
from jaxrl_sym.runtime.memory.estimate import Estimate, plan_estimate
from jaxrl_sym.runtime.memory.ledger_generation import GenerationLedger, sym_ledger
from jaxrl_sym.runtime.metrics import (
    CompileCounter,
    MemoryMeter,
    WorkLog,
    device_peak_bytes,
    tree_bytes,
)
from jaxrl_sym.runtime.options import EngineOptions
from jaxrl_sym.runtime.plan import GenerationPlan, compile_generation, resolve_backend
from jaxrl_sym.runtime.policy import length_bucket, microbatches, next_pow2
from jaxrl_sym.runtime.programs import ProgramCache, StepBuilder
from jaxrl_sym.sharding import to_host
from jaxrl_sym.tracer.trace import trace_model

__all__ = ["PackedBatch", "SymbolicLM", "length_bucket", "microbatches", "resolve_backend"]


def engine_options(options: EngineOptions | None) -> EngineOptions:
    """``options``, or the defaults; anything else is refused by name (the knobs come in one
    :class:`EngineOptions`, never one by one)."""
    if options is None:
        return EngineOptions()
    if not isinstance(options, EngineOptions):
        raise InputError(f"options={options!r}: give the engine's knobs as an EngineOptions, "
                         "e.g. SymbolicLM(model, EngineOptions(min_capacity=16)), or None for "
                         "the defaults")
    return options


class SymbolicLM:
    """Generation and packed scoring for a Flax NNX LM without padding to a maximum length.

    Args:
      model: an NNX module called as ``model(tokens, positions, segment_ids) -> logits``.
      options: the runtime's knobs, all in one :class:`~jaxrl_sym.runtime.options.EngineOptions`
        (store capacity, microbatching, backend, decode tiles, prefill, compaction, deferred
        compiles), e.g. ``SymbolicLM(model, EngineOptions(min_capacity=16))``; None: the
        defaults.
      mesh: a ``jax.sharding.Mesh`` (or ``"data=4"`` / a :class:`~jaxrl_sym.sharding.MeshConfig`):
        weights are placed by :mod:`jaxrl_sym.sharding`'s rule and every program keeps its
        stores' rows split over the data axes, so XLA partitions each step; the host loop is
        unchanged (it reads lengths and tokens back as before). Row buckets are rounded up to a
        multiple of the data axes (:attr:`row_multiple`, filler rows), so stores split evenly.

    The model is traced once and its generation planned once (:attr:`plan`, a
    :class:`~jaxrl_sym.runtime.plan.GenerationPlan`); the engine itself holds only what changes
    between calls: the weights (:meth:`set_params`), their hoisted values and the compiled
    programs (:attr:`cache`).
    """

    def __init__(self, model: nnx.Module, options: EngineOptions | None = None, *,
                 mesh: Any = None) -> None:
        self.options = engine_options(options)
        resolve_backend(self.options.backend)  # refused before any tracing
        # the contract, stated, before any symbolic-shape tracing
        self.model_name = check_model(model).name
        self.program, self.graphdef, state = trace_model(model)
        self.plan: GenerationPlan = self._compile(mesh)
        self.cache = ProgramCache(threads=max(1, self.plan.compile_threads))
        self.leaves = self.plan.place(jax.tree_util.tree_leaves(state))
        self._hoisted: tuple[jax.Array, ...] | None = None
        self._hoisted_bytes = 0

    def _compile(self, mesh: Any) -> GenerationPlan:
        """The generation plan (a subclass adds planning inputs: speculation)."""
        return compile_generation(self.program, self.options, mesh=mesh)

    # ------------------------------------------------------------------ the plan, read-only
    @property
    def pdg(self) -> Any:
        return self.plan.pdg

    @property
    def specs(self) -> Mapping[int, StoreSpec]:
        return self.plan.specs

    @property
    def builder(self) -> StepBuilder:
        return self.plan.builder

    @property
    def vocab_size(self) -> int:
        return self.plan.vocab_size

    @property
    def mesh(self) -> Any:
        return self.plan.mesh

    @property
    def row_multiple(self) -> int:
        """Row buckets this many rows apart split evenly over the mesh's data axes (1 without
        a mesh); a bucket that is not a multiple runs with replicated stores."""
        return self.plan.row_multiple

    @property
    def backend(self) -> str:
        return self.plan.backend

    @property
    def bindings(self) -> dict[str, int]:
        return self.program.binding_dict

    # ------------------------------------------------------------------ parameters
    def set_params(self, state: Any) -> None:
        """Swap in new parameters (same structure); hoisted values are recomputed lazily."""
        self.leaves = self.plan.place(jax.tree_util.tree_leaves(state))
        self._hoisted = None

    def estimate(self, prompt_lens: Sequence[int], cfg: GenerationConfig) -> Estimate:
        """The bytes this engine, with its own options (refill, microbatches, capacities), will
        hold for these prompts (:func:`~jaxrl_sym.runtime.memory.estimate.plan_estimate`, sized at
        the longest prompt and limit); compiles and runs nothing."""
        limits = row_limits(cfg, len(prompt_lens))
        weights = tree_bytes(self.leaves) if self.leaves is not None else 0
        return plan_estimate(self.plan, weights, len(prompt_lens), int(max(prompt_lens)),
                             int(limits.max()), cfg)

    def ledger(self, prompts: Sequence[np.ndarray], cfg: GenerationConfig, *,
               compiler: Callable[[Any], Any] | None = None) -> GenerationLedger | None:
        """This engine's generation of ``prompts`` walked dispatch by dispatch with its own
        programs compiled — never run — by ``compiler(build)`` (None: for this machine):
        :func:`~jaxrl_sym.runtime.memory.ledger_generation.sym_ledger` (with refill: its
        representative moments)."""
        return sym_ledger(self.plan, self.leaves, prompts, cfg, compiler=compiler)

    def release_params(self) -> None:
        """Drop the parameters (and what was hoisted from them) until the next
        :meth:`set_params`: a trainer frees its forward copy of the weights while its update,
        which never reads them, holds its peak. Generating in between is an error."""
        self.leaves = None
        self._hoisted = None
        self._hoisted_bytes = 0

    def _hoist(self) -> tuple[jax.Array, ...]:
        if self.leaves is None:
            raise RuntimeError("SymbolicLM: its parameters were released (release_params) and "
                               "not set again; call set_params before generating")
        if self._hoisted is None:
            self._hoisted, self._hoisted_bytes = self.plan.hoist(self.cache, self.leaves)
        return self._hoisted

    def _group(self, group: list[int], prompts: list[np.ndarray], limits: np.ndarray,
               cfg: GenerationConfig, meter: MemoryMeter, weights_bytes: int,
               waiting: list[int] | None = None) -> DecodeGroup:
        """The decode group that runs one microbatch (a subclass runs its own: speculative);
        ``waiting``: rows that refill it as its rows finish."""
        return DecodeGroup(self.plan, self.cache, group, prompts, limits, cfg, meter,
                           weights_bytes, waiting)

    # ------------------------------------------------------------------ generation
    def generate(self, prompts: Sequence[Any], cfg: GenerationConfig, *,
                 on_finished: Callable[[list[int], list[np.ndarray]], None] | None = None,
                 on_progress: Callable[[int], None] | None = None,
                 stop_when: Callable[[np.ndarray], bool] | None = None,
                 stop_live: int | None = None,
                 max_pad_fraction: float | None = None,
                 ) -> GenerationResult:
        """Generate for every prompt until EOS or its limit.

        on_finished: called from the host loop as ``on_finished(ids, responses)`` with the
          indices of rows that just finished and their final response tokens, while other rows
          still decode. The RL step uses it to queue reference scoring of finished rows behind the
          decode steps, so that work fills the device while the long tail generates instead of
          running as a separate pass afterwards.
        on_progress: called after every read-back with the number of tokens emitted so far
          (all rows), so a long run can show how far it is (the CLI prints it).
        stop_when: called after every read-back with a bool per prompt (True: that row ended at
          EOS or its limit); once it returns True generation ends there: unfinished rows keep
          the tokens they have (a microbatch not started yet has none), and ``stats`` says
          ``stopped_early`` and ``unfinished_rows``. Partial rollouts stop a step this way, a
          tile after the share of rows they wait for has finished, instead of generating in
          short segments that each re-prefill every row. Tokens are those of a run without it,
          cut short: sampling is keyed by (seed, step, row).
        stop_live: with ``stop_when``, a promise that it cannot hold while more than this many
          rows are unfinished (partial rollouts: the rows a fraction leaves). Decode tiles then
          grow as without a rule, and the tile program ends on device at the step the live
          rows fall to the bound, where the rule is asked; without it tiles stay at
          ``decode_tile`` steps so the rule is asked often enough.
        max_pad_fraction: this call's aligned-microbatch policy (None: the engine's). Partial
          rollouts pass 1.0: one decode loop, so ``stop_when`` sees all rows at once and rows
          carried from the last step (longer prompts, shorter limits) decode beside the new
          rows instead of in a second loop after them.
        """
        prompts = validate_prompts(prompts, self.vocab_size, cfg)
        limits = row_limits(cfg, len(prompts))
        if self.program.position_limit is not None:  # a table read by position: refuse overruns
            self.program.position_limit.check(self.model_name, [len(p) for p in prompts], limits)
        meter = MemoryMeter()
        out = Outputs([[] for _ in prompts], [[] for _ in prompts],
                      [[] for _ in prompts] if cfg.return_logits else None,
                      on_progress, stop_when)
        since = (self.cache.compiles, self.cache.dispatches, time.perf_counter(), self.cache.ahead)
        self.cache.begin_call()
        with CompileCounter() as cc:
            groups, work = self._run_groups(prompts, limits, cfg, meter, out, on_finished,
                                            stop_live, max_pad_fraction)
        return self._result(out, self._stats(cc, meter, since, groups, work, out))

    def _stats(self, cc: CompileCounter, meter: MemoryMeter,
               since: tuple[int, int, float, int],
               groups: int, work: WorkLog, out: Outputs) -> dict[str, Any]:
        """A call's stats; ``since``: the cache's compiles and dispatches, the clock and the
        cache's compiles ahead when it began."""
        elapsed = time.perf_counter() - since[2]
        dev_peak = device_peak_bytes()
        return {
            "xla_compiles": cc.count, "compile_cache_hits": cc.cache_hits,
            "program_compiles": self.cache.compiles - since[0],
            "programs_compiled_ahead": self.cache.ahead - since[3],
            "compile_seconds": cc.seconds,
            "dispatches": self.cache.dispatches - since[1],
            "peak_bytes": dev_peak if dev_peak is not None else meter.peak,
            "accounted_peak_bytes": meter.peak,
            "run_seconds": elapsed,
            "generated_tokens": int(sum(len(t) for t in out.toks)),
            "groups": groups,
            "stopped_early": out.stopped,
            "unfinished_rows": int((~out.finished).sum()),
            **work.report(),
        }

    def _run_groups(self, prompts: list[np.ndarray], limits: np.ndarray, cfg: GenerationConfig,
                    meter: MemoryMeter, out: Outputs, on_finished: Any, stop_live: int | None,
                    max_pad_fraction: float | None) -> tuple[int, WorkLog]:
        """Run the request's aligned microbatches one after another (until ``stop_when``
        says stop); returns how many groups it planned and their work, by cause."""
        hoisted = self._hoist()
        weights_bytes = tree_bytes(self.leaves) + self._hoisted_bytes
        work = WorkLog()
        rows = self.plan.options.microbatch_rows
        if self.plan.options.refill and rows is not None and len(prompts) > rows:
            # one resident group; the rows past it wait and refill rows as they finish
            dg = self._group(list(range(rows)), prompts, limits, cfg, meter, weights_bytes,
                             waiting=list(range(rows, len(prompts))))
            dg.run(hoisted, out, on_finished)
            work.merge(dg.work)
            return 1, work
        groups = self.plan.microbatches([len(p) for p in prompts], limits, max_pad_fraction)
        for k, group in enumerate(groups):
            if out.stopped:
                break
            if stop_live is not None:  # rows of later groups are unfinished as well
                out.stop_live = max(0, stop_live - sum(len(g) for g in groups[k + 1:]))
            dg = self._group(group, prompts, limits, cfg, meter, weights_bytes)
            dg.run(hoisted, out, on_finished)
            work.merge(dg.work)
        return len(groups), work

    def _result(self, out: Outputs, stats: dict[str, Any]) -> GenerationResult:
        return GenerationResult(
            tokens=[np.asarray(t, np.int32) for t in out.toks],
            logprobs=[np.asarray(lp, np.float32) for lp in out.lps],
            logits=None if out.logits is None else [
                np.stack(x) if x else np.zeros((0, self.vocab_size), np.float32)
                for x in out.logits],
            stats=stats,
        )

    # ------------------------------------------------------------------ packed forward
    def pack(self, sequences: Sequence[np.ndarray]) -> PackedBatch:
        return PackedBatch.build(sequences)

    def forward_fn(self):
        """``f(leaves, tokens, positions, segment_ids) -> logits`` (pure; jit/grad it)."""
        return self.builder.forward

    def packed_logits(self, sequences: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Logits for each sequence (exact lengths), computed on packed rows."""
        pb = PackedBatch.build(sequences)
        args = (self.leaves, pb.tokens, pb.positions, pb.segment_ids,
                pb.cu_seqlens if self.backend == "triton" else None)
        key = ("forward", pb.tokens.shape, None if args[-1] is None else args[-1].shape)
        out = self.cache.run(key, lambda: jax.jit(self.builder.forward).lower(*args).compile(),
                             *args)
        return pb.unpack(to_host(out))


@dataclass(frozen=True)
class PackedBatch:
    """Sequences bin-packed into rows of a bucketed length (no MAX_LEN padding).

    ``where[i] = (row, start, length)`` locates sequence i. Positions restart at 0 for each
    sequence and segment ids keep sequences from attending to each other; unused slots have
    position -1.
    """

    tokens: np.ndarray
    positions: np.ndarray
    segment_ids: np.ndarray
    where: tuple[tuple[int, int, int], ...]

    @staticmethod
    def build(sequences: Sequence[np.ndarray], *, row_len: int | None = None) -> PackedBatch:
        lens = [len(s) for s in sequences]
        if not lens or min(lens) < 1:
            raise InputError("packed forward needs at least one non-empty sequence")
        row_len = row_len or length_bucket(max(lens))
        if max(lens) > row_len:
            raise InputError(f"a sequence of {max(lens)} tokens does not fit rows of {row_len}")
        fill: list[int] = []
        where: list[tuple[int, int, int]] = [(0, 0, 0)] * len(lens)
        for i in sorted(range(len(lens)), key=lambda i: -lens[i]):  # first-fit decreasing
            for r, used in enumerate(fill):
                if used + lens[i] <= row_len:
                    where[i] = (r, used, lens[i])
                    fill[r] += lens[i]
                    break
            else:
                where[i] = (len(fill), 0, lens[i])
                fill.append(lens[i])
        rows = next_pow2(len(fill))
        tokens = np.zeros((rows, row_len), np.int32)
        positions = np.full((rows, row_len), -1, np.int32)
        segs = np.full((rows, row_len), -1, np.int32)
        for i, (r, s, n) in enumerate(where):
            tokens[r, s:s + n] = sequences[i]
            positions[r, s:s + n] = np.arange(n)
            segs[r, s:s + n] = i
        return PackedBatch(tokens, positions, segs, tuple(where))

    @property
    def cu_seqlens(self) -> np.ndarray:
        """Boundaries of the rows flattened end to end, for the packed varlen kernel.

        Every sequence and every unused gap is its own segment (gaps attend only to themselves
        and are never read back); the array is padded to a power of two with empty segments so
        that batches with different sequence counts share a compiled program.
        """
        length = self.tokens.shape[1]
        starts = sorted((r * length + s, n) for r, s, n in self.where)
        bounds = [0]
        for start, n in starts:
            if start > bounds[-1]:
                bounds.append(start)  # a gap before this sequence
            bounds.append(start + n)
        total = self.tokens.size
        if bounds[-1] < total:
            bounds.append(total)
        size = next_pow2(len(bounds))
        return np.asarray(bounds + [total] * (size - len(bounds)), np.int32)

    @property
    def padding_fraction(self) -> float:
        used = sum(n for _, _, n in self.where)
        return 1.0 - used / self.tokens.size

    def unpack(self, per_slot: np.ndarray) -> list[np.ndarray]:
        return [per_slot[r, s:s + n] for r, s, n in self.where]
