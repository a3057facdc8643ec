"""The symbolic runtime's knobs, as plain values: what :func:`~jaxrl_sym.runtime.plan.
compile_generation` plans a model's generation from.

Why a frozen dataclass without JAX: one object carries every knob from whoever sets it (the CLI,
the RL trainer, a benchmark) to the engine, with one default per knob and its check stated once
(an :class:`InputError` naming the knob); the CLI can build it to validate a flag before paying
JAX's import. Importing this module imports neither JAX nor the runtime's device code.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from jaxrl_sym.errors import InputError
from jaxrl_sym.runtime.policy import (
    COMPACT_AT,
    COMPACT_MIN_ROWS,
    DEFAULT_DECODE_TILE,
    DEFAULT_MAX_DECODE_TILE,
    DEFAULT_MAX_PAD_FRACTION,
    DEFAULT_MIN_CAPACITY,
    Compaction,
    Tiling,
)
from jaxrl_sym.runtime.refill import Refill

BACKENDS = ("xla", "triton", "auto")
PREFILLS = ("packed", "block")


@dataclass(frozen=True)
class EngineOptions:
    """How :class:`~jaxrl_sym.runtime.engine.SymbolicLM` plans and runs generation.

    min_capacity: initial slots of a growing store, at least (it then grows on
      :func:`~jaxrl_sym.runtime.policy.capacity_grid`).
    max_len: optional user cap; with it, full-attention stores are allocated at that size.
    microbatch_rows / max_pad_fraction: the aligned-microbatch policy
      (:func:`~jaxrl_sym.runtime.policy.microbatches`).
    backend: ``xla``, ``triton`` (Triton kernels for decode steps; interpreted on CPU) or
      ``auto`` (triton where it runs compiled, else xla); resolved when the plan is compiled.
    decode_tile: decode steps per dispatch while rows are ending (one device→host sync per tile;
      a row that ends inside a tile wastes the tile's remaining steps). 1: a dispatch per token.
    max_decode_tile: the tile doubles up to this after a dispatch in which no row ended
      (:class:`~jaxrl_sym.runtime.policy.Tiling`; one program serves every length); None:
      :data:`~jaxrl_sym.runtime.policy.DEFAULT_MAX_DECODE_TILE` (``decode_tile`` when it is 1).
    prefill: ``packed`` (prompts bin-packed into rows, :mod:`jaxrl_sym.runtime.prefill`) or
      ``block`` (the right-aligned ``[rows, prompt block]`` rectangle, in chunks).
    compact_at / compact_min_rows / compact_early: when finished rows are compacted away
      (:class:`~jaxrl_sym.runtime.policy.Compaction`).
    defer_compiles: a compaction whose smaller bucket has no decode program yet does not wait
      for it: the program is compiled on a background thread and the group decodes on at its
      current bucket; a later compaction to that bucket (in a later call) waits for it if it is
      still compiling (``DecodeGroup._defer``). Which buckets a call uses depends only on what
      earlier calls requested, never on compile timing, so runs stay reproducible. Off by
      default: it moves compile time rather than removing it. On the CPU step benchmark (2
      cores) the first generation took 7.0 s instead of 18-21 s and the warm-up step 18.3 s
      instead of 29-31 s, but the second step waited 8 s for the background compiles, so two
      steps took 28.7 s against about 32 s; steady state is the same. It pays where spare cores
      compile while the step's reference and update run.
    refill: with ``microbatch_rows`` R below the request's rows, one group of R resident rows
      runs the whole request: as rows finish, waiting samples take them (their prompts' keys
      and values copied from the prompt cache, :mod:`jaxrl_sym.runtime.prompt_cache`), so the
      batch stays full instead of each group running to its longest row. Its stores are
      rings sized for one sample's span and never grow. Off by default: on a CPU it measures
      slower than compaction (``bench/results/cpu/refill/``); the GPU plan measures it there.
    refill_min_free: free rows a refill waits for (each refill is one dispatch, and while
      samples wait a decode tile ends once this many rows are free).
    """

    backend: str = "xla"
    min_capacity: int = DEFAULT_MIN_CAPACITY
    max_len: int | None = None
    microbatch_rows: int | None = None
    max_pad_fraction: float = DEFAULT_MAX_PAD_FRACTION
    decode_tile: int = DEFAULT_DECODE_TILE
    max_decode_tile: int | None = None
    prefill: str = "packed"
    compact_at: float = COMPACT_AT
    compact_min_rows: int = COMPACT_MIN_ROWS
    compact_early: bool = False
    defer_compiles: bool = False
    refill: bool = False
    refill_min_free: int = 1

    def __post_init__(self) -> None:
        self.tiling()  # each raises an InputError naming its knob
        self.compaction()
        if self.prefill not in PREFILLS:
            raise InputError(f"prefill={self.prefill!r}: choose 'packed' (prompts bin-packed "
                             "into rows) or 'block' (the right-aligned prompt rectangle)")
        if self.backend not in BACKENDS:
            raise InputError(f"backend={self.backend!r}: choose 'xla', 'triton' or 'auto'")
        if self.refill:
            self.refill_policy()
            if self.prefill != "packed":
                raise InputError("refill=True needs prefill='packed': refilled prompts are "
                                 "packed into the rows they take")

    def tiling(self) -> Tiling:
        """The tile policy these options ask for, refused by name when it cannot be."""
        if self.decode_tile < 1:
            raise InputError(f"decode_tile={self.decode_tile} must be >= 1 (1: one dispatch "
                             "per token)")
        top = DEFAULT_MAX_DECODE_TILE if self.decode_tile > 1 else 1
        top = (max(top, int(self.decode_tile)) if self.max_decode_tile is None
               else int(self.max_decode_tile))
        if top < self.decode_tile:
            raise InputError(f"max_decode_tile={self.max_decode_tile} must be >= decode_tile="
                             f"{self.decode_tile} (the tile only grows from decode_tile)")
        return Tiling(int(self.decode_tile), top)

    def compaction(self) -> Compaction:
        """The compaction rule these options ask for, refused by name when it cannot be."""
        if not 0 < self.compact_at <= 1:
            raise InputError(f"compact_at={self.compact_at} must be in (0, 1]: the share of its "
                             "row bucket a group's live rows must fit before it is compacted")
        if self.compact_min_rows < 1:
            raise InputError(f"compact_min_rows={self.compact_min_rows} must be >= 1 (1: "
                             "compact down to single rows)")
        return Compaction(float(self.compact_at), int(self.compact_min_rows),
                          bool(self.compact_early))

    def refill_policy(self) -> Refill | None:
        """The refill rule these options ask for (None: no refill), refused by name when it
        cannot be."""
        if not self.refill:
            return None
        if isinstance(self.refill_min_free, bool) or not isinstance(self.refill_min_free, int) \
                or self.refill_min_free < 1:
            raise InputError(f"refill_min_free={self.refill_min_free!r} must be an int >= 1 "
                             "(free rows a refill waits for)")
        return Refill(self.refill_min_free)

    def replace(self, **changes: object) -> EngineOptions:
        """A copy with ``changes`` (checked again)."""
        return dataclasses.replace(self, **changes)

    @staticmethod
    def knobs() -> tuple[str, ...]:
        """The knob names (the fields a caller may set, e.g. from a system variant's fixed
        options)."""
        return tuple(f.name for f in dataclasses.fields(EngineOptions))


@dataclass(frozen=True)
class Speculation:
    """Speculative decoding as a planning input: ring/block stores are planned ``k`` slots
    larger (:meth:`StoreKind.speculative_capacity`), a recurrent-state store is refused.

    k: the most draft tokens per verify (>= 1). adaptive: pick k per verify tile from
    {1, 2, 4, …, k} (:func:`~jaxrl_sym.runtime.speculative.choose_k`); False: always k.
    verify_tile: draft + verify steps per dispatch (one device→host sync per tile).
    """

    k: int
    adaptive: bool = False
    verify_tile: int = 4

    def __post_init__(self) -> None:
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1:
            raise InputError(f"speculate={self.k!r}: give the most draft tokens per verify "
                             "step, an int >= 1 (0/None: use SymbolicLM, plain decoding)")
        vt = self.verify_tile
        if isinstance(vt, bool) or not isinstance(vt, int) or vt < 1:
            raise InputError(f"verify_tile={vt!r}: verify steps per dispatch, an int >= 1")

    @property
    def ks(self) -> tuple[int, ...]:
        """The k a verify tile may use: powers of two below ``k`` when adaptive, then ``k``."""
        smaller = [k for k in (1, 2, 4, 8, 16, 32) if k < self.k] if self.adaptive else []
        return (*smaller, self.k)
