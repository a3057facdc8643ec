"""SymbolicLM: a Flax LM traced once into a PDG, planned, and run on exact-size buffers.

Data flow: tracer (PDG) → passes (generation loop, storage plan) → programs (jitted per shape
bucket) → this host loop. The host loop is plain integer code: it decides when a growing store
doubles, when finished rows are compacted away, which slot the next step writes; sympy is never
touched here (the live-slot counts come from functions compiled once by the planner).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
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
from jaxrl_sym.passes.generation import add_generation_loop
from jaxrl_sym.passes.storage import StoragePlan, live_count_fn, plan_storage
from jaxrl_sym.runtime.evaluate import constant_values
from jaxrl_sym.runtime.group import DecodeGroup, Outputs
from jaxrl_sym.runtime.metrics import (
    CompileCounter,
    MemoryMeter,
    WorkLog,
    device_peak_bytes,
    tree_bytes,
)
from jaxrl_sym.runtime.policy import (
    COMPACT_AT,
    COMPACT_MIN_ROWS,
    DEFAULT_DECODE_TILE,
    DEFAULT_MAX_DECODE_TILE,
    DEFAULT_MAX_PAD_FRACTION,
    DEFAULT_MIN_CAPACITY,
    Compaction,
    Tiling,
    length_bucket,
    microbatches,
    next_pow2,
)
from jaxrl_sym.runtime.programs import ProgramCache, StepBuilder, slot_specs, store_specs
from jaxrl_sym.sharding import data_size, global_args, make_mesh, to_host, tree_shardings
from jaxrl_sym.tracer.trace import trace_model


def resolve_backend(backend: str) -> str:
    """``xla`` everywhere; ``triton`` = jax-triton on a GPU, Triton's interpreter on CPU (slow,
    for checking); ``auto`` = triton where it runs compiled (a GPU with jax-triton), else xla."""
    from jaxrl_sym.backends.launch import backend_name

    if backend == "auto":
        return "triton" if backend_name() == "gpu" else "xla"
    if backend == "xla":
        return backend
    if backend == "triton":
        if backend_name() is None:
            raise InputError(
                "backend='triton' needs triton (pip install -e '.[interp]' on CPU, '.[gpu]' with "
                "jax-triton on a GPU); use backend='xla' otherwise"
            )
        return backend
    raise InputError(f"backend={backend!r}: choose 'xla', 'triton' or 'auto'")


def _tiling(decode_tile: int, max_decode_tile: int | None) -> Tiling:
    """The engine's tile policy from its arguments, refused by name when it cannot be."""
    if decode_tile < 1:
        raise InputError(f"decode_tile={decode_tile} must be >= 1 (1: one dispatch per token)")
    top = DEFAULT_MAX_DECODE_TILE if decode_tile > 1 else 1
    top = max(top, int(decode_tile)) if max_decode_tile is None else int(max_decode_tile)
    if top < decode_tile:
        raise InputError(f"max_decode_tile={max_decode_tile} must be >= decode_tile="
                         f"{decode_tile} (the tile only grows from decode_tile)")
    return Tiling(int(decode_tile), top)


def _compaction(compact_at: float, compact_min_rows: int, compact_early: bool) -> Compaction:
    """The engine's compaction rule from its arguments, refused by name when it cannot be."""
    if not 0 < compact_at <= 1:
        raise InputError(f"compact_at={compact_at} must be in (0, 1]: the share of its row "
                         "bucket a group's live rows must fit before it is compacted")
    if compact_min_rows < 1:
        raise InputError(f"compact_min_rows={compact_min_rows} must be >= 1 (1: compact "
                         "down to single rows)")
    return Compaction(float(compact_at), int(compact_min_rows), bool(compact_early))


class SymbolicLM:
    """Generation and packed scoring for a Flax NNX LM without padding to a maximum length.

    Args:
      model: an NNX module called as ``model(tokens, positions, segment_ids) -> logits``.
      min_capacity: initial slots of a growing store (it then doubles).
      max_len: optional user cap; with it, full-attention stores are allocated at that size.
      microbatch_rows / max_pad_fraction: aligned-microbatch policy (see :func:`microbatches`).
      backend: ``xla``, ``triton`` (Triton kernels for decode steps; interpreted on CPU) or
        ``auto``.
      decode_tile: decode steps per dispatch while rows are ending (one device→host sync per
        tile; a row that ends inside a tile wastes the tile's remaining steps). 1: a dispatch
        per token.
      max_decode_tile: the tile doubles up to this after a dispatch in which no row ended
        (:class:`~jaxrl_sym.runtime.policy.Tiling`; one program serves every length). Kept at
        ``decode_tile`` when logits are returned (the program's buffers hold a tile of them).
      prefill: ``packed`` (default: prompts bin-packed into rows, so neither prompt padding nor
        filler rows are computed; :mod:`jaxrl_sym.runtime.prefill`) or ``block`` (the
        right-aligned ``[rows, prompt block]`` rectangle, in chunks).
      mesh: a ``jax.sharding.Mesh`` (or ``"data=4"`` / a :class:`~jaxrl_sym.sharding.MeshConfig`):
        weights are placed by :mod:`jaxrl_sym.sharding`'s rule and every program keeps its
        stores' rows split over the data axes, so XLA partitions each step; the host loop is
        unchanged (it reads lengths and tokens back as before). Row buckets are rounded up to a
        multiple of the data axes (:attr:`row_multiple`, filler rows), so stores split evenly.
      compact_at: compact finished rows away once the live rows fit this share of the row
        bucket (:data:`~jaxrl_sym.runtime.policy.COMPACT_AT`); lower compiles fewer programs.
      compact_min_rows: never compact below this many rows
        (:data:`~jaxrl_sym.runtime.policy.COMPACT_MIN_ROWS`: where a decode step costs about
        the same whatever its rows, a smaller bucket only adds a program to compile).
      compact_early: a decode tile ends at the step its live rows fall to the compaction
        share, so finished rows are dropped then, not at the tile's end
        (:class:`~jaxrl_sym.runtime.policy.Compaction`: less waste, more row buckets).
      defer_compiles: a compaction whose smaller bucket has no decode program yet does not
        wait for one: the program is compiled on a background thread and the group decodes on
        at its current bucket; a later compaction to that bucket (in a later call) waits for
        it if it is still compiling. Which buckets a call uses depends only on what earlier
        calls requested, never on compile timing, so runs stay reproducible. Off by default:
        it moves compile time rather than removing it. On the CPU step benchmark (2 cores) the
        first generation took 7.0 s instead of 18-21 s and the warm-up step 18.3 s instead of
        29-31 s, but the second step waited 8 s for the background compiles, so two steps
        took 28.7 s against about 32 s; steady state is the same. It pays where spare cores
        compile while the step's reference and update run.
    """

    group_class: type[DecodeGroup] = DecodeGroup  # a subclass runs groups its own way (speculative)

    def __init__(
        self,
        model: nnx.Module,
        *,
        min_capacity: int = DEFAULT_MIN_CAPACITY,
        max_len: int | None = None,
        microbatch_rows: int | None = None,
        max_pad_fraction: float = DEFAULT_MAX_PAD_FRACTION,
        backend: str = "xla",
        decode_tile: int = DEFAULT_DECODE_TILE,
        max_decode_tile: int | None = None,
        mesh: Any = None,
        prefill: str = "packed",
        compact_at: float = COMPACT_AT,
        compact_min_rows: int = COMPACT_MIN_ROWS,
        compact_early: bool = False,
        defer_compiles: bool = False,
    ) -> None:
        self.tiling = _tiling(decode_tile, max_decode_tile)
        self.decode_tile = self.tiling.base
        self.compaction = _compaction(compact_at, compact_min_rows, compact_early)
        self.defer_compiles = bool(defer_compiles)
        if prefill not in ("packed", "block"):
            raise InputError(f"prefill={prefill!r}: choose 'packed' (prompts bin-packed into "
                             "rows) or 'block' (the right-aligned prompt rectangle)")
        self.prefill = prefill
        self.backend = resolve_backend(backend)
        check_model(model)  # the contract, stated, before any symbolic-shape tracing
        self.program, self.graphdef, state = trace_model(model)
        self.vocab_size = int(self.program.pdg.node(self.program.pdg.outputs[0]).shape[-1])
        self.pdg = add_generation_loop(self.program.pdg)
        self.plan: StoragePlan = plan_storage(self.pdg, max_len=max_len)
        self.bindings = self.program.binding_dict
        self.specs = store_specs(self.pdg, self.plan, self.bindings, self.backend)
        self.builder = StepBuilder(self.pdg, self.specs,
                                   slot_specs(self.pdg, self.plan, self.bindings),
                                   constant_values(self.program.consts), self.backend,
                                   mesh=make_mesh(mesh))
        self.mesh = self.builder.mesh
        self.leaves = self._place(jax.tree_util.tree_leaves(state))
        self.min_capacity = min_capacity
        self.max_len = max_len
        self.microbatch_rows = microbatch_rows
        self.max_pad_fraction = max_pad_fraction
        self.cache = ProgramCache()
        live_fns = {str(s.node): live_count_fn(self.pdg.symbols, s, self.bindings)
                    for s in self.plan.stores if s.kind != "slot"}
        self.growing = tuple(str(n) for n, s in self.specs.items() if s.kind.grows)
        fns = [live_fns[g] for g in self.growing]
        # live slots of the growing stores after writing slot t (None: nothing grows)
        self.growing_need: Callable[[int], int] | None = (
            (lambda t: max(int(f(t)[0]) for f in fns)) if fns else None)
        self._hoisted: tuple[jax.Array, ...] | None = None
        self._hoisted_bytes = 0

    # ------------------------------------------------------------------ parameters
    def set_params(self, state: Any) -> None:
        """Swap in new parameters (same structure); hoisted values are recomputed lazily."""
        self.leaves = self._place(jax.tree_util.tree_leaves(state))
        self._hoisted = None

    @property
    def row_multiple(self) -> int:
        """Row buckets this many rows apart split evenly over the mesh's data axes (1 without
        a mesh); a bucket that is not a multiple runs with replicated stores."""
        return data_size(self.mesh)

    def _place(self, leaves: list[Any]) -> list[Any]:
        """On a mesh, weights go where the sharding rule puts them (a no-op when a trainer on
        the same mesh already placed them); without one, untouched."""
        if self.mesh is None:
            return leaves
        return jax.device_put(leaves, tree_shardings(leaves, self.mesh))

    def _hoist(self) -> tuple[jax.Array, ...]:
        if self._hoisted is None:
            key = ("hoist",)
            build = lambda: jax.jit(self.builder.hoist).lower(self.leaves).compile()
            computed = self.cache.run(key, build, self.leaves)
            self._hoisted_bytes = tree_bytes(computed)
            self._hoisted = self.builder.assemble(self.leaves, computed)
        return self._hoisted

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
        lengths = [len(p) for p in prompts]
        meter = MemoryMeter()
        toks: list[list[int]] = [[] for _ in prompts]
        lps: list[list[float]] = [[] for _ in prompts]
        logits: list[list[np.ndarray]] | None = [[] for _ in prompts] if cfg.return_logits else None
        compiles0, disp0 = self.cache.compiles, self.cache.dispatches
        self.cache.begin_call()
        t0 = time.perf_counter()
        with CompileCounter() as cc:
            hoisted = self._hoist()
            weights_bytes = tree_bytes(self.leaves) + self._hoisted_bytes
            out = Outputs(toks, lps, logits, on_progress, stop_when)
            work = WorkLog()
            groups = microbatches(lengths, limits, max_rows=self.microbatch_rows,
                                  max_pad_fraction=(self.max_pad_fraction
                                                    if max_pad_fraction is None
                                                    else max_pad_fraction))
            for k, group in enumerate(groups):
                if out.stopped:
                    break
                if stop_live is not None:  # rows of later groups are unfinished as well
                    out.stop_live = max(0, stop_live - sum(len(g) for g in groups[k + 1:]))
                dg = self.group_class(self, group, prompts, limits, cfg, meter, weights_bytes)
                dg.run(hoisted, out, on_finished)
                work.merge(dg.work)
        elapsed = time.perf_counter() - t0
        dev_peak = device_peak_bytes()
        stats = {
            "xla_compiles": cc.count, "compile_cache_hits": cc.cache_hits,
            "program_compiles": self.cache.compiles - compiles0,
            "compile_seconds": cc.seconds,
            "dispatches": self.cache.dispatches - disp0,
            "peak_bytes": dev_peak if dev_peak is not None else meter.peak,
            "accounted_peak_bytes": meter.peak,
            "run_seconds": elapsed,
            "generated_tokens": int(sum(len(t) for t in toks)),
            "groups": len(groups),
            "stopped_early": out.stopped,
            "unfinished_rows": int((~out.finished).sum()),
            **work.report(),
        }
        return GenerationResult(
            tokens=[np.asarray(t, np.int32) for t in toks],
            logprobs=[np.asarray(lp, np.float32) for lp in lps],
            logits=None if logits is None else [
                np.stack(x) if x else np.zeros((0, self.vocab_size), np.float32) for x in logits],
            stats=stats,
        )

    def run_program(self, name: str, cfg: GenerationConfig, *args: Any, **static: int
                    ) -> tuple[Any, tuple]:
        """Run the prefill/decode(-tile) program for these shapes, compiling it on first use."""
        if self.mesh is not None:  # a compiled program takes only the shardings it was built for
            args = (args[0], self.builder.place_stores(args[1]), *args[2:])
        key, build = self.program_for(name, cfg, *args, **static)
        exe = self.cache.get(key, build)
        self.cache.dispatches += 1
        return exe(*global_args(exe, args)), key

    def program_for(self, name: str, cfg: GenerationConfig, *args: Any, **static: int
                    ) -> tuple[tuple, Callable[[], Any]]:
        """The cache key of the prefill/decode(-tile) program for these arguments (arrays or
        ``jax.ShapeDtypeStruct``s) and the function that compiles it."""
        stores = args[1]
        caps = tuple(sorted((k, s["pos"].shape[1]) for k, s in stores.items() if "pos" in s))
        key = (name, args[2].shape, caps, cfg.temperature, cfg.return_logits,
               *sorted(static.items()))
        fn = getattr(self.builder, name)

        def build() -> Any:
            jitted = jax.jit(fn, static_argnames=("temperature", "want_logits", *static),
                             donate_argnums=(1,))
            return jitted.lower(*args, temperature=cfg.temperature,
                                want_logits=cfg.return_logits, **static).compile()

        return key, build

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
