"""XLA's cost analysis with every loop counted as many times as it runs.

Why: ``compiled.cost_analysis()`` walks each computation once, so a ``while`` body is counted
once whatever its trip count: a ``fori_loop`` of 10 matmuls reports one matmul's flops, and
``lax.map`` over 8 query blocks reports 1/8 of the attention (measured 2026-11-29 on jax 0.11.2).
The update and reference programs of long sequences run their attention blockwise
(``bounded_reference``), so their projected seconds came out low by up to the block count.

How: from the optimised HLO text (the module XLA runs), each ``while`` whose trip count XLA
proved (``known_trip_count`` in its backend config: every ``scan``, ``fori_loop`` and ``map``
with static bounds) adds ``(n - 1)`` times its body's cost; nested loops multiply. A body's cost
is counted the way XLA's analysis counts a computation: flops of its ``dot``s (inside fusions
too), and bytes of each top-level instruction's operands and result (a fusion's, not its
insides'; tuples, bitcasts, parameters and constants are free). Loops whose trip count is
unknown stay counted once, as XLA counts them.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

_COMP = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s+\(.*\)\s+->\s+.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s+=\s+(.+?)\s+([\w\-]+)\((.*)$")
_ARRAY = re.compile(r"\b(pred|[suf]\d+|bf16|f8e\w+|c64|c128)\[([\d,]*)\]")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CALLS = re.compile(r"\b(?:calls|to_apply|body)=%?([\w.\-]+)")
_LHS_CONTRACT = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")
_FREE = frozenset({"parameter", "get-tuple-element", "tuple", "bitcast", "constant",
                   "after-all", "partition-id", "replica-id"})
_BITS = {"pred": 8, "bf16": 16, "c64": 64, "c128": 128}


def _bytes(shape_text: str) -> int:
    """Bytes of every array in a shape string (a tuple's arrays summed)."""
    total = 0
    for dtype, dims in _ARRAY.findall(shape_text):
        bits = _BITS.get(dtype) or int(re.sub(r"\D", "", dtype) or 8)
        n = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
        total += n * bits // 8
    return total


@dataclass
class _Computation:
    flops: float = 0.0  # its own dots
    bytes: float = 0.0  # its own top-level instructions' operands and results
    calls: list[str] = field(default_factory=list)  # fusions and calls: counted once per run
    called: set[str] = field(default_factory=set)  # of those, ``call``s (bytes counted inside)
    loops: list[tuple[str, int]] = field(default_factory=list)  # (body, trips; 1 if unknown)


def _dims(shape_text: str | None) -> list[int]:
    m = _ARRAY.search(shape_text or "")
    return [int(d) for d in m.group(2).split(",") if d] if m else []


def _dot_flops(result: str, lhs: str | None, attrs: str) -> float:
    """2 x (result elements) x (contracted extent): what XLA's analysis counts for a dot."""
    contract = _LHS_CONTRACT.search(attrs)
    lhs_dims = _dims(lhs)
    if contract is None or not lhs_dims or _ARRAY.search(result) is None:
        return 0.0
    k = math.prod(lhs_dims[int(i)] for i in contract.group(1).split(",") if i)
    return 2.0 * math.prod(_dims(result)) * k


def _parse(text: str) -> tuple[dict[str, _Computation], str | None]:
    """Each computation's own dot flops and instruction bytes, the computations it calls and
    the loops it runs; and the entry's name. Operands are printed by name, so each
    computation's result shapes are kept to size them."""
    comps: dict[str, _Computation] = {}
    entry, cur, shapes = None, None, {}
    for line in text.splitlines():
        head = _COMP.match(line)
        if head is not None:
            cur, shapes = comps.setdefault(head.group(1), _Computation()), {}
            entry = head.group(1) if line.startswith("ENTRY") else entry
            continue
        m = _INSTR.match(line) if cur is not None else None
        if m is None:
            continue
        name, result, op, rest = m.groups()
        shapes[name] = result
        args, _, attrs = rest.partition(")")
        names = re.findall(r"%([\w.\-]+)", args)
        if op == "dot":
            cur.flops += _dot_flops(result, shapes.get(names[0]) if names else None, attrs)
        if op == "while":
            body = re.search(r"\bbody=%?([\w.\-]+)", rest)
            trip = _TRIP.search(rest)
            if body is not None:
                cur.loops.append((body.group(1), int(trip.group(1)) if trip else 1))
            continue
        cur.calls.extend(_CALLS.findall(attrs))
        if op == "call":
            cur.called.update(_CALLS.findall(attrs))
        if op not in _FREE and op not in ("call", "conditional"):
            cur.bytes += _bytes(result) + sum(_bytes(shapes.get(n, "")) for n in names)
    return comps, entry


def _totals(comps: dict[str, _Computation], name: str, full: bool,
            memo: dict[tuple[str, bool], tuple[float, float]]) -> tuple[float, float]:
    """(flops, bytes) of one run of computation ``name``; ``full``: loops at their trip counts,
    else each body once (as XLA counts). Bytes stop at fusions (their insides are in the
    fusion's operands and result)."""
    key = (name, full)
    if key in memo:
        return memo[key]
    c = comps.get(name)
    if c is None:
        return (0.0, 0.0)
    flops, nbytes = c.flops, c.bytes
    for callee in c.calls:
        f, b = _totals(comps, callee, full, memo)
        flops += f  # a fusion's bytes are its operands and result, counted at the call
        nbytes += b if callee in c.called else 0.0
    for body, trips in c.loops:
        f, b = _totals(comps, body, full, memo)
        times = trips if full else 1
        flops, nbytes = flops + times * f, nbytes + times * b
    memo[key] = (flops, nbytes)
    return memo[key]


def uncounted_loop_cost(hlo_text: str) -> tuple[float, float]:
    """(flops, bytes) that XLA's analysis of this optimised module leaves out: each proved
    loop's extra trips."""
    comps, entry = _parse(hlo_text)
    if entry is None:
        return (0.0, 0.0)
    memo: dict[tuple[str, bool], tuple[float, float]] = {}
    full, once = _totals(comps, entry, True, memo), _totals(comps, entry, False, memo)
    return (max(0.0, full[0] - once[0]), max(0.0, full[1] - once[1]))


def loop_aware_cost(compiled: Any) -> dict[str, float]:
    """``compiled.cost_analysis()`` (a ``jax.stages.Compiled``) with ``flops`` and
    ``bytes accessed`` raised by :func:`uncounted_loop_cost` of its optimised modules."""
    ca = compiled.cost_analysis()
    ca = dict((ca[0] if isinstance(ca, list | tuple) else ca) or {})
    try:
        modules = compiled.runtime_executable().hlo_modules()
    except (AttributeError, NotImplementedError):  # no modules to read: XLA's counts as they are
        return ca
    for module in modules:
        flops, nbytes = uncounted_loop_cost(module.to_string())
        if "flops" in ca:
            ca["flops"] = float(ca["flops"]) + flops
        if "bytes accessed" in ca:
            ca["bytes accessed"] = float(ca["bytes accessed"]) + nbytes
    return ca
