"""The symbolic-shape polyhedral dependence graph (PDG): plain, immutable data.

A node is one operation that *repeats* over a symbolic domain (``b``, ``t``): ``domain=("b","t")``
means one instance per (row, position). Its full shape is symbolic (sympy), e.g. ``(B, T, 64)``;
``axes`` says which array axis each domain dim occupies. An edge says that instance ``(b, t)`` of
the consumer reads the producer at one index expression per producer domain dim: ``Point(t)`` for
position-wise data flow, ``Range(max(0,t-w+1), t+1)`` where a sliding-window attention reads keys.
Edges of kind ``feedback`` close cycles (generation: ``tok[t] = sample(logits[t-1])``); the
topological order ignores them.

Nothing here executes; the runtime compiles the graph into jitted step programs.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import sympy

from jaxrl_sym.symbols import IndexExpr, Point, SymbolTable


@dataclass(frozen=True)
class Node:
    """One repeated operation.

    ``op`` is the JAX primitive name, or one of ``input``, ``weight``, ``sample``.
    ``prim``/``params`` carry what the runtime binds; params hold sympy dims where JAX had
    symbolic ones and are excluded from equality (they may hold unhashable values).
    """

    id: int
    op: str
    domain: tuple[str, ...]
    shape: tuple[sympy.Expr, ...]
    axes: tuple[str | None, ...]
    dtype: str
    name: str = ""
    source: str = ""
    prim: Any = field(default=None, compare=False, hash=False, repr=False)
    params: dict[str, Any] = field(default_factory=dict, compare=False, hash=False, repr=False)
    literals: tuple[tuple[int, Any], ...] = field(default=(), compare=False, hash=False, repr=False)
    n_inputs: int = 0

    @property
    def spatial(self) -> tuple[sympy.Expr, ...]:
        """The per-instance shape: the full shape minus the domain axes."""
        return tuple(d for d, a in zip(self.shape, self.axes, strict=True) if a is None)

    def label(self) -> str:
        dom = ",".join(self.domain)
        shp = "x".join(str(s) for s in self.spatial) or "scalar"
        extra = f" {self.params['pattern']}" if self.op == "sym_attention" else ""
        return f"%{self.id} {self.op}{extra} [{dom}] {shp} {self.dtype}"


@dataclass(frozen=True)
class Edge:
    """Consumer input ``port`` of node ``dst`` reads node ``src`` at ``index`` (one per src dim)."""

    src: int
    dst: int
    port: int
    index: tuple[IndexExpr, ...]
    kind: str = "data"  # "data" | "feedback"
    src_out: int = 0  # which output of a multi-output producer

    def label(self) -> str:
        return ", ".join(str(ix) for ix in self.index)


@dataclass(frozen=True)
class PDG:
    """The graph plus its symbol table, inputs (by role) and outputs."""

    nodes: tuple[Node, ...]
    edges: tuple[Edge, ...]
    symbols: SymbolTable
    inputs: tuple[tuple[str, int], ...]  # (role, node id): role in weight:<i>, tokens, positions…
    outputs: tuple[int, ...]
    domain_dims: tuple[tuple[str, str], ...] = (("r", "B"), ("t", "T"))  # iterator -> extent

    # ---------------------------------------------------------------- queries
    def node(self, i: int) -> Node:
        return self.nodes[i]

    def in_edges(self, i: int) -> tuple[Edge, ...]:
        return tuple(sorted((e for e in self.edges if e.dst == i), key=lambda e: e.port))

    def out_edges(self, i: int) -> tuple[Edge, ...]:
        return tuple(e for e in self.edges if e.src == i)

    def input_id(self, role: str) -> int:
        for r, i in self.inputs:
            if r == role:
                return i
        raise KeyError(role)

    def topo_order(self) -> tuple[int, ...]:
        """Kahn's order over data edges (feedback edges are satisfied by the previous step),
        the lowest ready node id first: the traced program's own order where it is one.

        Why not first-ready-first: evaluated breadth-first, every layer's position-only work
        (RoPE's angles from the positions, a norm's weight cast) ran before the first layer, so
        the update's remat (cut at each attention call) saved it per layer for the backward
        instead of recomputing it as the model's own order does (tests/test_update_residuals.py).
        """
        indeg = {n.id: 0 for n in self.nodes}
        succ: dict[int, list[int]] = {n.id: [] for n in self.nodes}
        for e in self.edges:
            if e.kind == "data":
                indeg[e.dst] += 1
                succ[e.src].append(e.dst)
        ready = sorted(i for i, d in indeg.items() if d == 0)  # a sorted list is a heap
        order: list[int] = []
        while ready:
            i = heapq.heappop(ready)
            order.append(i)
            for j in succ[i]:
                indeg[j] -= 1
                if indeg[j] == 0:
                    heapq.heappush(ready, j)
        if len(order) != len(self.nodes):
            raise ValueError("PDG has a cycle through data edges (only feedback edges may)")
        return tuple(order)

    def with_nodes_edges(
        self,
        nodes: tuple[Node, ...],
        edges: tuple[Edge, ...],
        outputs: tuple[int, ...] | None = None,
    ) -> PDG:
        return PDG(nodes, edges, self.symbols, self.inputs,
                   self.outputs if outputs is None else outputs, self.domain_dims)

    def ranged_edges(self) -> Iterator[Edge]:
        """Edges whose index is not a plain point: these are what storage planning is about."""
        for e in self.edges:
            if any(not isinstance(ix, Point) for ix in e.index):
                yield e

    def stats(self) -> dict[str, int]:
        ops: dict[str, int] = {}
        for n in self.nodes:
            ops[n.op] = ops.get(n.op, 0) + 1
        return {"nodes": len(self.nodes), "edges": len(self.edges),
                "static_nodes": sum(1 for n in self.nodes if not n.domain),
                "ranged_edges": sum(1 for _ in self.ranged_edges()),
                "feedback_edges": sum(1 for e in self.edges if e.kind == "feedback"),
                "attention_nodes": ops.get("sym_attention", 0)}

    # ---------------------------------------------------------------- printing
    def to_text(self, *, max_nodes: int | None = None) -> str:
        """One line per node: ``%id op [domain] spatial dtype <- producer[index], …``."""
        lines = [f"PDG over {', '.join(f'{i} in 0:{x}' for i, x in self.domain_dims)}"]
        for k, n in enumerate(self.nodes):
            if max_nodes is not None and k >= max_nodes:
                lines.append(f"… {len(self.nodes) - max_nodes} more nodes")
                break
            ins = ", ".join(
                f"{'~' if e.kind == 'feedback' else ''}%{e.src}[{e.label()}]"
                for e in self.in_edges(n.id)
            )
            lines.append(f"{n.label()}" + (f" <- {ins}" if ins else ""))
        lines.append("outputs: " + ", ".join(f"%{o}" for o in self.outputs))
        return "\n".join(lines)

    def to_dot(self, *, hide_static: bool = True) -> str:
        """Graphviz DOT. Static (weight-only) nodes are hidden by default: they are hoisted."""
        keep = {n.id for n in self.nodes if n.domain or not hide_static}
        out = ["digraph PDG {", '  rankdir=TB; node [shape=box, fontname="monospace"];']
        for n in self.nodes:
            if n.id in keep:
                color = {"sym_attention": "lightblue", "sample": "lightsalmon",
                         "input": "lightgrey"}.get(n.op, "white")
                out.append(f'  n{n.id} [label="{n.label()}", style=filled, fillcolor={color}];')
        for e in self.edges:
            if e.src in keep and e.dst in keep:
                style = "dashed" if e.kind == "feedback" else "solid"
                ranged = any(not isinstance(ix, Point) for ix in e.index)
                attrs = f'label="{e.label()}", style={style}'
                if ranged or e.kind == "feedback":
                    attrs += ", color=blue, fontcolor=blue"
                out.append(f"  n{e.src} -> n{e.dst} [{attrs}];")
        out.append("}")
        return "\n".join(out)
