"""A memory ledger: which named buffers are alive at each moment of a run, and the peak with the
buffers that make it up — plus what each compiled program costs in flops and bytes.

Why a ledger and not one peak number: on the first H100 RL step, sym's peak was above padded's and
nobody could say which buffer made the difference (``bench/results/gpu.md``). A ledger names them
(weights, optimiser state, reference copy, each store, a program's arguments, outputs and XLA
temporaries) so a peak can be taken apart, compared between systems and projected to a device that
is not here. Program sizes come from XLA itself: ``compiled.memory_analysis()`` (buffer assignment:
argument, output, alias and temporary bytes) and ``compiled.cost_analysis()`` (flops, bytes
accessed), both available from ``jax.jit(f).lower(*shapes).compile()`` without running anything, on
any backend, at any shape that compiles.

This module is plain data and arithmetic over those numbers; it neither compiles nor runs. The
RL step's ledger is built by :mod:`jaxrl_sym.rl.step.ledger`, the projection to a device by
``python -m bench project``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from jaxrl_sym.runtime.memory.loop_cost import loop_aware_cost

KINDS = ("weights", "optimizer", "reference", "gradients", "store", "batch", "program_args",
         "program_temp", "program_out", "queued", "host")
"""What a buffer is, for grouping a peak into the terms a user can act on."""


@dataclass(frozen=True)
class Buffer:
    """One named allocation: ``kind`` is one of :data:`KINDS`."""

    name: str
    kind: str
    nbytes: int

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"buffer {self.name!r}: kind {self.kind!r} is not one of {KINDS}")
        if self.nbytes < 0:
            raise ValueError(f"buffer {self.name!r}: negative size {self.nbytes}")


@dataclass(frozen=True)
class ProgramSize:
    """XLA's account of one compiled program (``memory_analysis``/``cost_analysis``).

    ``args``/``out``: argument and output bytes; ``alias``: output bytes that reuse donated
    arguments (not allocated twice); ``temp``: XLA's temporaries while it runs. ``flops`` and
    ``bytes_accessed``: the cost model's totals (0 where the backend reports none)."""

    name: str
    args: int
    out: int
    alias: int
    temp: int
    flops: float = 0.0
    bytes_accessed: float = 0.0
    batch: int = 0  # argument bytes that are this call's own (the rest the caller holds)

    @staticmethod
    def of(name: str, compiled: Any, *, loops: bool = False) -> ProgramSize:
        """Read a compiled executable's analyses (``jax.stages.Compiled``). ``loops``: count
        each loop XLA proved a trip count for that many times
        (:func:`~jaxrl_sym.runtime.memory.loop_cost.loop_aware_cost`); without it a loop body
        counts once, as XLA counts it (the generation ledger multiplies a decode tile's one
        step by the steps each dispatch ran)."""
        ma = compiled.memory_analysis()
        if loops:
            ca = loop_aware_cost(compiled)
        else:
            ca = compiled.cost_analysis()
            ca = ca[0] if isinstance(ca, list | tuple) else (ca or {})
        return ProgramSize(name, int(ma.argument_size_in_bytes), int(ma.output_size_in_bytes),
                           int(ma.alias_size_in_bytes), int(ma.temp_size_in_bytes),
                           float(ca.get("flops", 0.0)), float(ca.get("bytes accessed", 0.0)))

    def with_batch(self, nbytes: int) -> ProgramSize:
        """This size with ``nbytes`` of its arguments marked as the call's own batch."""
        return dataclasses.replace(self, batch=int(nbytes))

    def buffers(self, *, args_named: bool = True) -> tuple[Buffer, ...]:
        """The program's own buffers while it runs: its temporaries and its fresh outputs, plus
        its arguments unless the caller already holds them under their own names
        (``args_named``: weights, optimiser state and batches are listed once, as themselves)."""
        out = [Buffer(f"{self.name}: XLA temporaries", "program_temp", self.temp),
               Buffer(f"{self.name}: outputs", "program_out", max(0, self.out - self.alias))]
        if not args_named:
            out.insert(0, Buffer(f"{self.name}: arguments", "program_args", self.args))
        return tuple(out)


@dataclass(frozen=True)
class Moment:
    """The buffers alive at one point of a run (``stage``: generation, reference, update, …;
    ``what``: the dispatch or program that runs then)."""

    stage: str
    what: str
    buffers: tuple[Buffer, ...]

    @property
    def total(self) -> int:
        return sum(b.nbytes for b in self.buffers)

    def by_kind(self) -> dict[str, int]:
        """Bytes per :data:`KINDS` entry (those present), in :data:`KINDS` order."""
        sums = {k: 0 for k in KINDS}
        for b in self.buffers:
            sums[b.kind] += b.nbytes
        return {k: v for k, v in sums.items() if v}


@dataclass(frozen=True)
class Ledger:
    """A run's moments in order; :meth:`peak` is the one with the most bytes alive."""

    system: str
    moments: tuple[Moment, ...]

    def peak(self) -> Moment:
        if not self.moments:
            raise ValueError(f"ledger of {self.system!r} has no moments")
        return max(self.moments, key=lambda m: m.total)

    def stage_peaks(self) -> dict[str, Moment]:
        """The largest moment of each stage, in stage order of first appearance."""
        out: dict[str, Moment] = {}
        for m in self.moments:
            if m.stage not in out or m.total > out[m.stage].total:
                out[m.stage] = m
        return out

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: every stage's peak with its buffers, and the overall peak."""
        def moment(m: Moment) -> dict[str, Any]:
            return {"stage": m.stage, "what": m.what, "total": m.total, "by_kind": m.by_kind(),
                    "buffers": [{"name": b.name, "kind": b.kind, "bytes": b.nbytes}
                                for b in sorted(m.buffers, key=lambda b: -b.nbytes)]}
        return {"system": self.system, "peak": moment(self.peak()),
                "stages": {s: moment(m) for s, m in self.stage_peaks().items()}}


def moment(stage: str, what: str, *groups: Iterable[Buffer]) -> Moment:
    """A :class:`Moment` from several groups of buffers (persistent state, a program's own …)."""
    return Moment(stage, what, tuple(b for g in groups for b in g))


def tree_buffer(name: str, kind: str, tree: Any) -> Buffer:
    """One buffer holding every array leaf of ``tree`` (arrays or ``ShapeDtypeStruct``)."""
    return Buffer(name, kind, tree_nbytes(tree))


def tree_nbytes(tree: Any) -> int:
    """Bytes of every leaf of ``tree`` with a shape and dtype (arrays or ShapeDtypeStructs, so
    a ledger can be built from shapes alone)."""
    return sum(int(np.prod(x.shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize
               for x in jax.tree_util.tree_leaves(tree) if hasattr(x, "dtype"))
