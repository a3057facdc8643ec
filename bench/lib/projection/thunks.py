"""What the GPU runtime launches for a program compiled for a GPU this machine does not have
(:mod:`bench.lib.projection.xla_gpu`), read from XLA's own thunk sequence: kernels, CUDA-graph
launches and the points where the host waits on the device.

Why the thunk sequence and not the HLO: since 2025 XLA:GPU forms its command buffers (CUDA
graphs) in a pass over thunks, after the HLO is final, so the optimised HLO no longer shows what
is captured; ``--xla_dump_to`` writes ``*.thunk_sequence_after_thunk_passes.txt`` with every
``kCommandBuffer`` and what it holds. A ``kWhile`` whose trip count XLA could not prove runs its
condition and copies the predicate to the host every iteration, outside a command buffer (the
``WhileThunk``; inside one with ``+WHILE`` the CUDA graph's conditional node tests on device);
with a known trip count (the HLO's ``known_trip_count``, matched to the thunk by its profile
annotation in ``*.thunk_metadata.txt``) the body is replayed with no test at all. FIELD_NOTES
§12 has the sources.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_LINE = re.compile(r"^(\s*)(\d+): (k\w+)\s*\[[^\]]*\]\s*(.*)$")
_LABEL = re.compile(r"^(\s*)([\w ]+):\s*$")
_META = re.compile(r'profile_annotation: "([^"]*)"\s*thunk_id: (\d+)')
_TRIPS = re.compile(r'%(while[\w.\-]*) = .*"known_trip_count":\{"n":"(\d+)"\}')

STRUCTURE = frozenset({"kCommandBuffer", "kWhile", "kConditional", "kSequential",
                       "kAsyncStart", "kAsyncDone", "kWaitForStreams", "kDynamicSlice"})
"""Thunk kinds that launch nothing themselves (containers, stream bookkeeping)."""

HOST = ("kHost", "kSend", "kRecv", "kInfeed", "kOutfeed", "kCopyDone")
"""Kind prefixes of thunks that wait on a host transfer (one host round-trip each)."""


@dataclass(frozen=True)
class Thunk:
    """One thunk: its kind, id and name (a kernel's fusion), and its sections — a command
    buffer's ``children``, a while's ``condition`` and ``body``, a conditional's branches.
    ``trips``: a while's known trip count (None: tested every iteration)."""

    kind: str
    id: int
    name: str
    sections: dict[str, tuple[Thunk, ...]] = field(default_factory=dict)
    trips: int | None = None


@dataclass(frozen=True)
class Counts:
    """What running a program costs the host and the GPU (see :func:`count`).

    launches: what the host launches — each kernel outside a CUDA graph, each graph once;
    kernels: GPU operations (kernels, copies, library calls) wherever they run;
    captured: the kernels inside a CUDA graph; syncs: host round-trips (a loop test copied to
    the host, a conditional's branch index, a host transfer)."""

    launches: float = 0.0
    kernels: float = 0.0
    captured: float = 0.0
    syncs: float = 0.0

    def __add__(self, o: Counts) -> Counts:
        return Counts(self.launches + o.launches, self.kernels + o.kernels,
                      self.captured + o.captured, self.syncs + o.syncs)

    def __mul__(self, n: float) -> Counts:
        return Counts(self.launches * n, self.kernels * n, self.captured * n, self.syncs * n)


def parse(text: str, trips: dict[int, int] | None = None) -> tuple[Thunk, ...]:
    """The thunk tree of ``*.thunk_sequence_after_thunk_passes.txt``; ``trips``: known trip
    counts by thunk id (:func:`load`)."""
    lines = [ln.rstrip() for ln in text.splitlines() if ln.strip()]
    out, i = _block(lines, 0, trips or {})
    if i != len(lines):
        raise ValueError(f"thunk sequence: line {i + 1} not understood: {lines[i]!r}")
    return tuple(out)


def _block(lines: list[str], i: int, trips: dict[int, int]) -> tuple[list[Thunk], int]:
    """Consecutive thunks at the indent of line ``i``, each with its sections."""
    out: list[Thunk] = []
    indent = None
    while i < len(lines):
        m = _LINE.match(lines[i])
        if m is None or (indent is not None and len(m.group(1)) != indent):
            break
        indent = len(m.group(1))
        kind, tid = m.group(3), int(m.group(2))
        name = m.group(4).split(" grid:")[0].strip()
        i += 1
        sections: dict[str, tuple[Thunk, ...]] = {}
        while i < len(lines):
            lab, sub = _LABEL.match(lines[i]), _LINE.match(lines[i])
            # XLA prints "condition:" unindented right after its while, other labels two
            # spaces in from their owner; a thunk indented further is a command buffer's
            if lab is not None and ((lab.group(2) == "condition" and kind == "kWhile"
                                     and "condition" not in sections)
                                    or len(lab.group(1)) == indent + 2):
                got, i = _block(lines, i + 1, trips)
                sections[lab.group(2)] = tuple(got)
            elif lab is None and sub is not None and len(sub.group(1)) > indent:
                got, i = _block(lines, i, trips)
                sections["children"] = sections.get("children", ()) + tuple(got)
            else:
                break
        out.append(Thunk(kind, tid, name, sections, trips.get(tid)))
    return out, i


def load(dump_dir: str) -> tuple[tuple[Thunk, ...], str]:
    """The thunk tree of the one program compiled into ``dump_dir`` (``xla_dump_to``), with each
    while's known trip count from the optimised HLO, and that HLO's module name."""
    d = Path(dump_dir)
    # XLA writes the sequence after its thunk passes only when a pass changed it (a program
    # too small for a CUDA graph has the emitted sequence alone)
    for suffix in (".thunk_sequence_after_thunk_passes.txt", ".thunk_sequence.txt"):
        seqs = sorted(d.glob(f"*{suffix}"))
        if seqs:
            break
    else:
        raise FileNotFoundError(f"{dump_dir}: no thunk sequence (was it compiled for a GPU "
                                "with xla_dump_to?)")
    seq = seqs[-1]
    module = seq.name[: -len(suffix)]
    meta = (d / f"{module}.thunk_metadata.txt").read_text()
    by_name = {name: int(tid) for name, tid in _META.findall(meta)}
    hlo = "\n".join(p.read_text() for p in d.glob(f"{module}.*after_optimizations.txt"))
    trips = {by_name[w]: int(n) for w, n in _TRIPS.findall(hlo) if w in by_name}
    return parse(seq.read_text(), trips), module


def count(thunks: tuple[Thunk, ...], unknown: float, graph: bool = False) -> Counts:
    """What running ``thunks`` costs when every loop of unknown trip count runs ``unknown``
    iterations (a decode tile's checks); ``graph``: inside a CUDA graph."""
    total = Counts()
    for t in thunks:
        total = total + _one(t, unknown, graph)
    return total


def _one(t: Thunk, unknown: float, graph: bool) -> Counts:
    s = t.sections
    if t.kind == "kCommandBuffer":
        inner = count(s.get("children", ()), unknown, graph=True)
        return inner + Counts(launches=0.0 if graph else 1.0)
    if t.kind == "kWhile":
        n = unknown if t.trips is None else t.trips
        body = count(s.get("body", ()), unknown, graph) * n
        if t.trips is not None:  # replayed n times, the condition never run
            return body
        tests = count(s.get("condition", ()), unknown, graph) * (n + 1)
        return body + tests + Counts(syncs=0.0 if graph else n + 1)
    if t.kind == "kConditional" or (t.kind in STRUCTURE and s):
        branches = [count(v, unknown, graph) for k, v in s.items() if k != "children"]
        inner = count(s.get("children", ()), unknown, graph)
        worst = max(branches, key=lambda c: c.kernels, default=Counts())
        sync = 1.0 if t.kind == "kConditional" and not graph else 0.0
        return inner + worst + Counts(syncs=sync)
    if t.kind in STRUCTURE:
        return Counts()
    sync = 1.0 if t.kind.startswith(HOST) else 0.0
    return Counts(launches=0.0 if graph else 1.0, kernels=1.0,
                  captured=1.0 if graph else 0.0, syncs=sync)


def custom_calls(thunks: tuple[Thunk, ...]) -> list[tuple[str, bool]]:
    """Every custom call (``kCustomCall``: a library or user kernel XLA did not generate, e.g. a
    legacy jax-triton call) with whether it runs inside a CUDA graph."""
    return _where(thunks, lambda t: t.kind == "kCustomCall")


def kernels_named(thunks: tuple[Thunk, ...], names: tuple[str, ...]) -> list[tuple[str, bool]]:
    """Every kernel whose name is one of ``names`` (a Pallas kernel keeps its ``pallas_call``
    name: XLA compiles its Triton custom call into a ``kCustomKernel`` of that name) with
    whether it runs inside a CUDA graph."""
    return _where(thunks, lambda t: t.kind == "kCustomKernel" and t.name in names)


def _where(thunks: tuple[Thunk, ...], keep: Any) -> list[tuple[str, bool]]:
    out: list[tuple[str, bool]] = []

    def walk(ts: tuple[Thunk, ...], graph: bool) -> None:
        for t in ts:
            if keep(t):
                out.append((t.name, graph))
            for v in t.sections.values():
                walk(v, graph or t.kind == "kCommandBuffer")

    walk(thunks, False)
    return out


def step_kernels(thunks: tuple[Thunk, ...]) -> list[str]:
    """The kernels of one decode step, in launch order: the body of the innermost loop with a
    known trip count (a decode tile's steps, :meth:`StepBuilder.decode_tile`), command buffers
    opened; [] for a program without one. Why: the fit prices each kernel a step at ~5.5 µs,
    so which kernels a layer launches is where generation's time goes."""
    def inner(ts: tuple[Thunk, ...]) -> tuple[Thunk, ...] | None:
        for t in ts:
            for v in t.sections.values():
                deeper = inner(v)
                if deeper is not None:
                    return deeper
            if t.kind == "kWhile" and t.trips is not None:
                return t.sections.get("body", ())
        return None

    def names(ts: tuple[Thunk, ...]) -> list[str]:
        return [n for t in ts for n in (names(t.sections.get("children", ()))
                                        if t.kind == "kCommandBuffer" else
                                        [] if t.kind in STRUCTURE else [t.name])]

    body = inner(thunks)
    return [] if body is None else names(body)


def loops(thunks: tuple[Thunk, ...]) -> list[tuple[int, int | None, bool]]:
    """Every while loop: (thunk id, known trip count or None, inside a CUDA graph)."""
    out: list[tuple[int, int | None, bool]] = []

    def walk(ts: tuple[Thunk, ...], graph: bool) -> None:
        for t in ts:
            if t.kind == "kWhile":
                out.append((t.id, t.trips, graph))
            for v in t.sections.values():
                walk(v, graph or t.kind == "kCommandBuffer")

    walk(thunks, False)
    return out
