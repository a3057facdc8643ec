"""The symbolic runtime's knobs, as plain values: what :func:`~jaxrl_sym.runtime.plan.
compile_generation` plans a model's generation from.

Why a frozen dataclass without JAX: one object carries every knob from whoever sets it (the CLI,
the RL trainer, a benchmark) to the engine, with one default per knob and its check stated once
(an :class:`InputError` naming the knob); the CLI can build it to validate a flag before paying
JAX's import. Importing this module imports neither JAX nor the runtime's device code.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import operator
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxrl_sym.errors import InputError
from jaxrl_sym.runtime.policy import (
    DEFAULT_DECODE_TILE,
    DEFAULT_MAX_DECODE_TILE,
    DEFAULT_MAX_PAD_FRACTION,
    DEFAULT_MIN_CAPACITY,
    Compaction,
    Tiling,
)
from jaxrl_sym.runtime.refill import Refill

BACKENDS = ("xla", "triton", "pallas", "auto")
PREFILLS = ("packed", "block")

Check = Callable[[Any], Any]
"""A knob's domain: returns the value normalised (NumPy scalars → Python ints/floats/bools),
raises ``TypeError``/``ValueError`` when it is outside (``EngineOptions.__post_init__`` turns
that into an :class:`InputError` naming the knob)."""


def _count(low: int = 1) -> Check:
    """An integer >= ``low``: a Python or NumPy int (array arithmetic hands out NumPy scalars),
    never a bool (``True`` for a count is almost always a mistake) nor a float."""
    def check(value: Any) -> int:
        if isinstance(value, bool | np.bool_):
            raise TypeError(value)
        n = operator.index(value)  # TypeError for floats, strings, None
        if n < low:
            raise ValueError(value)
        return n
    return check


def _share(*, low_open: bool) -> Check:
    """A finite real number in ``[0, 1]`` (``(0, 1]`` with ``low_open``), as a float: NaN
    compares false everywhere, so an unchecked NaN would silently pick one branch."""
    def check(value: Any) -> float:
        if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Real):
            raise TypeError(value)
        x = float(value)
        if not (math.isfinite(x) and (x > 0 if low_open else x >= 0) and x <= 1):
            raise ValueError(value)
        return x
    return check


def _flag(value: Any) -> bool:
    """True or False (a NumPy bool too); an int or a string is refused, not read as truthy."""
    if not isinstance(value, bool | np.bool_):
        raise TypeError(value)
    return bool(value)


def _one_of(choices: tuple[str, ...]) -> Check:
    def check(value: Any) -> str:
        if not isinstance(value, str) or value not in choices:
            raise ValueError(value)
        return value
    return check


def _or_none(check: Check) -> Check:
    """``check``'s domain, or None (where None means something: no cap, the default)."""
    return lambda value: None if value is None else check(value)


_DOMAINS: dict[str, tuple[Check, str]] = {
    "backend": (_one_of(BACKENDS), "must be 'xla', 'triton' (Triton decode kernels), "
                "'pallas' (the Pallas decode kernel) or 'auto' (triton where it runs "
                "compiled, else xla)"),
    "min_capacity": (_count(), "must be a positive int; give the initial slots of a growing "
                     "store (e.g. 16)"),
    "max_len": (_or_none(_count()), "must be a positive int or None; give the cap on prompt + "
                "response slots, or None for no cap"),
    "microbatch_rows": (_or_none(_count()), "must be a positive int or None; give the most "
                        "rows one decode group runs (with refill: its resident rows), or None "
                        "for no cap"),
    "max_pad_fraction": (_share(low_open=False), "must be a finite number in [0, 1]; give the "
                         "prompt padding a microbatch may add as a share of its work (1: one "
                         "group)"),
    "decode_tile": (_count(), "must be a positive int; give the decode steps per dispatch "
                    "(1: one dispatch per token)"),
    "max_decode_tile": (_or_none(_count()), "must be a positive int or None; give the most "
                        "steps a tile grows to, or None for the default"),
    "decode_check": (_or_none(_count()), "must be a positive int or None; give the decode "
                     "steps between a tile's tests of its live rows, or None for the "
                     "platform's default (decode_tile on a GPU, 1 elsewhere)"),
    "prefill": (_one_of(PREFILLS), "must be 'packed' (prompts bin-packed into rows) or "
                "'block' (the right-aligned prompt rectangle)"),
    "compact_at": (_or_none(_share(low_open=True)), "must be a finite number in (0, 1] or "
                   "None; give the share of its row bucket a group's live rows must fit before "
                   "it is compacted, or None for the platform's default"),
    "compact_min_rows": (_or_none(_count()), "must be a positive int or None; give the fewest "
                         "rows a group is compacted to (1: down to single rows), or None for "
                         "the platform's default"),
    "compact_early": (_or_none(_flag), "must be True, False or None (the platform's default)"),
    "defer_compiles": (_flag, "must be True or False"),
    "compile_threads": (_or_none(_count(0)), "must be an int >= 0 or None; give the threads "
                        "that compile a call's decode programs ahead (0: each on first use), "
                        "or None for the platform's default"),
    "refill": (_flag, "must be True or False"),
    "refill_min_free": (_count(), "must be a positive int; give the free rows a refill waits "
                        "for (1: refill each freed row at once)"),
}
"""Every knob's domain and what to do when a value is outside it (one entry per field: a knob
added without one fails on the first construction, with a ``KeyError`` naming it)."""


@dataclass(frozen=True)
class EngineOptions:
    """How :class:`~jaxrl_sym.runtime.engine.SymbolicLM` plans and runs generation.

    min_capacity: initial slots of a growing store, at least (it then grows on
      :func:`~jaxrl_sym.runtime.policy.capacity_grid`).
    max_len: optional user cap; with it, full-attention stores are allocated at that size.
    microbatch_rows / max_pad_fraction: the aligned-microbatch policy
      (:func:`~jaxrl_sym.runtime.policy.microbatches`).
    backend: ``xla``, ``triton`` (Triton kernels for decode steps; interpreted on CPU),
      ``pallas`` (single-token attention as one Pallas kernel that XLA:GPU captures in its
      CUDA graphs; interpreted on CPU; everything else as xla) or ``auto`` (triton where it
      runs compiled, else xla); resolved when the plan is compiled.
    decode_tile: decode steps per dispatch while rows are ending (one device→host sync per tile;
      a row that ends inside a tile wastes the tile's remaining steps). 1: a dispatch per token.
    max_decode_tile: the tile doubles up to this after a dispatch in which no row ended
      (:class:`~jaxrl_sym.runtime.policy.Tiling`; one program serves every length); None:
      :data:`~jaxrl_sym.runtime.policy.DEFAULT_MAX_DECODE_TILE` (``decode_tile`` when it is 1).
    decode_check: decode steps between the tile program's tests of its live rows (a tile runs
      whole checks; steps past a row's end are discarded and counted as ``tile_overrun``).
      None: ``decode_tile`` on a GPU, where each test XLA cannot count is a device→host
      round-trip, and 1 elsewhere, where a test costs nothing (:meth:`tiling`).
    prefill: ``packed`` (prompts bin-packed into rows, :mod:`jaxrl_sym.runtime.prefill`) or
      ``block`` (the right-aligned ``[rows, prompt block]`` rectangle, in chunks).
    compact_at / compact_min_rows / compact_early: when finished rows are compacted away
      (:class:`~jaxrl_sym.runtime.policy.Compaction`); None: the platform's default
      (:meth:`~jaxrl_sym.runtime.policy.Compaction.default`: coarser and early on a GPU).
      With early compaction the tile keeps its length while rows end
      (:attr:`~jaxrl_sym.runtime.policy.Tiling.shrink`).
    defer_compiles: a compaction whose smaller bucket has no decode program yet does not wait
      for it: the program is compiled on a background thread and the group decodes on at its
      current bucket; a later compaction to that bucket (in a later call) waits for it if it is
      still compiling (``DecodeGroup._defer``). Which buckets a call uses depends only on what
      earlier calls requested, never on compile timing, so runs stay reproducible. Off by
      default: it moves compile time rather than removing it. On the CPU step benchmark (2
      cores) the first generation and the warm-up step were much faster, but the second step
      waited for the background compiles, so two steps gained little; steady state is the
      same (``bench/results/headline.md``). It pays where spare cores compile while the step's
      reference and update run.
    compile_threads: threads that compile a call's decode programs *ahead*: when a group
      starts, the policy's replay of it (:func:`~jaxrl_sym.runtime.policy.replay_group`, rows
      running to their limits) names the (rows, capacity) buckets it will decode at, and their
      programs compile in the background while the prefill compiles and runs and the first
      tiles decode; a bucket the replay did not name (rows ending early at EOS) compiles on
      first use, as without it. Tokens and the buckets a call uses do not change, only when
      programs compile. 0: every program on first use. None: the platform's default
      (:meth:`compile_ahead`): on a GPU, where a decode program took ~8 s to compile on the
      H100 (31 of them in sym's first RL step), up to 4 threads as the host's cores allow; 0
      elsewhere, where the compiles would take the cores the programs run on. On a GPU XLA
      autotunes while it compiles, on the device: a compile ahead then holds its scratch
      buffers beside the running step's (the step's ``MemoryBudget`` does not see them); give
      0 where the step runs near the device's memory.
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
    decode_check: int | None = None
    prefill: str = "packed"
    compact_at: float | None = None
    compact_min_rows: int | None = None
    compact_early: bool | None = None
    defer_compiles: bool = False
    compile_threads: int | None = None
    refill: bool = False
    refill_min_free: int = 1

    @classmethod
    def from_json(cls, text: str, flag: str = "--engine") -> EngineOptions:
        """The options a command line gives as one JSON object (``--engine '{"refill": true}'``
        in ``decode``, ``train`` and the bench); a malformed object, an unknown field or a value
        out of its domain is an :class:`InputError` naming ``flag`` (and the field)."""
        try:
            obj = json.loads(text)
        except ValueError as err:
            raise InputError(f"{flag}: not JSON ({err}); give an object such as "
                             "'{\"refill\": true, \"microbatch_rows\": 8}'") from None
        if not isinstance(obj, dict):
            raise InputError(f"{flag} must be a JSON object ({{...}}), got {text!r}")
        return cls.from_fields(obj, flag)

    @classmethod
    def from_fields(cls, obj: dict[str, Any], flag: str = "--engine") -> EngineOptions:
        """The options from a mapping of field names (a parsed ``--engine``), an unknown field
        or a value out of its domain named with ``flag`` (empty: the caller names it, e.g.
        argparse's ``argument --engine:``)."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(obj) - known)
        pre = f"{flag}: " if flag else ""
        if unknown:
            raise InputError(f"{pre}EngineOptions has no field {', '.join(unknown)}; its "
                             f"fields: {', '.join(sorted(known))}")
        try:
            return cls(**obj)
        except InputError as err:
            raise InputError(f"{pre}{err}") from None

    def __post_init__(self) -> None:
        """Check every knob against its domain (:data:`_DOMAINS`) and normalise it, then the
        rules between knobs. Why here: a value outside its domain used to run — e.g.
        ``microbatch_rows=-1`` with ``refill=True`` generated one row's sample twice — instead
        of failing where it was given, naming the knob."""
        for f in dataclasses.fields(self):
            check, rule = _DOMAINS[f.name]
            value = getattr(self, f.name)
            try:
                object.__setattr__(self, f.name, check(value))  # frozen: set once, here
            except (TypeError, ValueError):
                raise InputError(f"EngineOptions.{f.name}={value!r}: {rule}") from None
        self.tiling()
        if self.refill and self.prefill != "packed":
            raise InputError("EngineOptions.refill=True needs prefill='packed': refilled "
                             "prompts are packed into the rows they take; drop one of them")

    def tiling(self, platform: str = "cpu") -> Tiling:
        """The tile policy these options ask for on ``platform`` (``jax.Device.platform``:
        "cpu", "gpu", "tpu"), refused by name when ``max_decode_tile`` is below
        ``decode_tile`` (the tile only grows).

        Why the check interval depends on the platform: XLA:GPU runs a loop whose trip count
        it cannot count by copying the test's predicate to the host and waiting, once per
        iteration (``xla/backends/gpu/runtime/while_thunk.cc``), so a tile tests its rows once
        per ``decode_tile`` steps there. XLA:CPU evaluates the test on the thread that runs the
        loop and a TPU on the device: testing every step costs nothing and runs no step past
        a row's end (on the test suite's short rows, checks of 8 doubled some generations)."""
        top = DEFAULT_MAX_DECODE_TILE if self.decode_tile > 1 else 1
        top = max(top, self.decode_tile) if self.max_decode_tile is None else self.max_decode_tile
        if top < self.decode_tile:
            raise InputError(f"EngineOptions.max_decode_tile={self.max_decode_tile}: must be >= "
                             f"decode_tile={self.decode_tile} (the tile only grows from "
                             "decode_tile); raise it or give None")
        check = self.decode_check if self.decode_check is not None else (
            self.decode_tile if platform == "gpu" else 1)
        return Tiling(self.decode_tile, top, check, shrink=not self.compaction(platform).early)

    def compaction(self, platform: str = "cpu") -> Compaction:
        """The compaction rule these options ask for on ``platform`` (its knobs checked on
        construction; None: the platform's default)."""
        return Compaction.default(platform, self.compact_at, self.compact_min_rows,
                                  self.compact_early)

    def compile_ahead(self, platform: str = "cpu") -> int:
        """Threads compiling a call's decode programs ahead on ``platform`` (see
        ``compile_threads``; None: 4 on a GPU, as the host's cores allow, else 0)."""
        if self.compile_threads is not None:
            return self.compile_threads
        return min(4, os.cpu_count() or 1) if platform == "gpu" else 0

    def refill_policy(self) -> Refill | None:
        """The refill rule these options ask for (None: no refill; its knob checked on
        construction)."""
        return Refill(self.refill_min_free) if self.refill else None

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
    {1, 2, 4, …, k} (:func:`~jaxrl_sym.runtime.speculative.lm.choose_k`); False: always k.
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
