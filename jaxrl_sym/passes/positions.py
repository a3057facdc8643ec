"""Which positions a prefill needs past the last attention: the position-wise tail.

A prefill chunk runs the model on every prompt position, but the sampler reads the logits of one
position per row (the last prompt token). Everything that no attention node reads — the last
layer's output projection and MLP, the final norm, the head, the sample node — is position-wise:
under the contract only ``attend`` mixes positions, and the PDG states it edge by edge (every
edge into such a node reads its source at the same ``(r, t)`` point). So those nodes can run on
the needed positions alone: gather the tensors that cross into the tail at those (row, position)
pairs and evaluate the tail with extents ``B = pairs, T = 1``. At a 151,936-word vocabulary the
head alone is 0.6 MB of fp32 logits per prompt position; 128 rows x 16 positions per chunk hold
1.25 GB where 128 rows' last positions need 78 MB. On a tiny model the packed prefill's
temporaries shrink by more than an order of magnitude (``tests/test_positions.py``; the numbers:
``bench/results/projection.md``).

Build time only (sympy): :func:`position_tail` returns a :class:`PositionTail` (node ids and the
axes each crossing tensor is gathered on) or None where the model does not allow it — a node
after the last attention that reads another position, or a crossing tensor indexed by position
but not by row — and the runtime then evaluates every position as before.
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxrl_sym.ops.attention import attention_p
from jaxrl_sym.pdg.ir import PDG
from jaxrl_sym.symbols import Point


@dataclass(frozen=True)
class Crossing:
    """A tensor computed before the tail and read inside it: gathered at the needed (row,
    position) pairs on axis ``row_axis`` and (when it has one) ``pos_axis``."""

    node: int
    out: int
    row_axis: int
    pos_axis: int | None


@dataclass(frozen=True)
class PositionTail:
    """The position-wise nodes after the last attention (``nodes``, in topological order) and
    the tensors that cross into them (``crossings``)."""

    nodes: tuple[int, ...]
    crossings: tuple[Crossing, ...]

    @property
    def members(self) -> frozenset[int]:
        return frozenset(self.nodes)


def _ancestors(pdg: PDG, roots: list[int]) -> set[int]:
    seen: set[int] = set(roots)
    stack = list(roots)
    while stack:
        for e in pdg.in_edges(stack.pop()):
            if e.kind == "data" and e.src not in seen:
                seen.add(e.src)
                stack.append(e.src)
    return seen


def position_tail(pdg: PDG) -> PositionTail | None:
    """The tail of ``pdg`` after its last attention nodes (see the module docstring), or None
    when it is empty or not position-wise."""
    attends = [n.id for n in pdg.nodes if n.prim is attention_p]
    if not attends:
        return None
    before = _ancestors(pdg, attends)
    tail = [nid for nid in pdg.topo_order()
            if nid not in before and pdg.node(nid).domain and pdg.node(nid).op != "input"]
    members = set(tail)
    if pdg.outputs[0] not in members:
        return None
    crossings: dict[tuple[int, int], Crossing] = {}
    for nid in tail:
        for e in pdg.in_edges(nid):
            src = pdg.node(e.src)
            if e.kind != "data" or not src.domain:
                continue  # weights and hoisted values: the same for every position
            same = all(isinstance(ix, Point) and ix.expr == pdg.symbols.sym(it)
                       for ix, it in zip(e.index, src.domain, strict=True))
            if not same:
                return None  # a node after the last attention reads another position
            if e.src in members:
                continue
            axes = {a: i for i, a in enumerate(src.axes) if a is not None}
            rows, pos = axes.get("B"), axes.get("T")
            if rows is None:
                return None  # indexed by position only: no per-pair gather
            crossings[(e.src, e.src_out)] = Crossing(e.src, e.src_out, rows, pos)
    return PositionTail(tuple(tail), tuple(crossings.values()))
