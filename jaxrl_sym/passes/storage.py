"""Storage planning: choose a store for every ranged or lagged edge from its index expression.

The decision is symbolic (sympy, via :func:`jaxrl_sym.symbols.classify_access`), not by looking at
the pattern's name: an edge reading ``max(0,t-w+1):t+1`` has a length bounded by ``w``, so a ring
buffer of ``w`` slots suffices; ``t-(t mod b):t+1`` is bounded by ``b`` (block buffer);
``0:t+1`` is unbounded (growing buffer, geometric capacity) — unless its consumer is a sum, as
in linear attention, where a recurrent state replaces the keys; ``t-1`` is a single slot.

No store is sized by a maximum length unless the user passes one (``max_len``).
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy

from jaxrl_sym.errors import SymbolError
from jaxrl_sym.ops.attention import Linear, Pattern
from jaxrl_sym.passes.stores import (
    BLOCK,
    FIXED,
    GROWING,
    RING,
    SLOT,
    STATE,
    RingStore,
    StoreKind,
)
from jaxrl_sym.pdg.ir import PDG
from jaxrl_sym.symbols import IndexExpr, SymbolTable, classify_access, compile_int, compile_jax


@dataclass(frozen=True)
class StorePlan:
    """One store: which node reads it, how, and how big it is (symbolically)."""

    node: int  # the consumer (attention) or the feedback target
    kind: StoreKind  # one of jaxrl_sym.passes.stores.STORE_KINDS
    index: IndexExpr  # index over t of the edge that motivated it
    capacity: sympy.Expr | None  # None: grows geometrically with t
    pattern: Pattern | None
    reason: str

    def capacity_value(self, bindings: dict[str, int]) -> int | None:
        if self.capacity is None:
            return None
        subs = {s: bindings[s.name] for s in self.capacity.free_symbols if s.name in bindings}
        val = self.capacity.subs(subs)
        if not val.is_Integer:
            raise SymbolError(
                f"store for node %{self.node}: capacity {self.capacity} is not determined by the "
                f"bindings {bindings}"
            )
        return int(val)


@dataclass(frozen=True)
class StoragePlan:
    stores: tuple[StorePlan, ...]

    def for_node(self, node: int) -> StorePlan:
        for s in self.stores:
            if s.node == node:
                return s
        raise KeyError(node)

    def to_text(self) -> str:
        return "\n".join(
            f"%{s.node:<5} {s.kind.name:<8} index {s.index!s:<22} capacity "
            f"{'geometric' if s.capacity is None else s.capacity!s:<10} {s.reason}"
            for s in self.stores
        )


def plan_storage(pdg: PDG, *, max_len: int | None = None) -> StoragePlan:
    """Plan stores for the attention nodes and the generation feedback edge."""
    table = pdg.symbols
    stores: list[StorePlan] = []
    for node in pdg.nodes:
        if node.op != "sym_attention":
            continue
        k_edge = next(e for e in pdg.in_edges(node.id) if e.port == 1)
        t_index = k_edge.index[pdg.node(k_edge.src).domain.index("t")]
        acc = classify_access(table, t_index, "t")
        pattern = node.params["pattern"]
        if acc.kind == "prefix" and isinstance(pattern, Linear):
            plan = StorePlan(node.id, STATE, t_index, sympy.Integer(1), pattern,
                             "prefix read consumed by a kernelised sum: keep (S, z)")
        elif acc.kind == "prefix":
            if max_len is not None:
                plan = StorePlan(node.id, FIXED, t_index, sympy.Integer(max_len), pattern,
                                 "prefix read; user asked for max_len")
            else:
                plan = StorePlan(node.id, GROWING, t_index, None, pattern,
                                 "prefix read, length t+1 unbounded")
        elif acc.kind == "window":
            plan = StorePlan(node.id, RING, t_index, acc.bound, pattern,
                             f"length bounded by {acc.bound}, start monotone")
        elif acc.kind == "block":
            plan = StorePlan(node.id, BLOCK, t_index, acc.bound, pattern,
                             f"length bounded by {acc.bound}, start resets")
        else:
            # Correct for any pattern (masking is by position), only not minimal.
            plan = StorePlan(node.id, GROWING, t_index, None, pattern,
                             f"general access {t_index}: keep all keys")
        stores.append(plan)
    for e in pdg.edges:
        if e.kind != "feedback":
            continue
        t_index = e.index[pdg.node(e.src).domain.index("t")]
        acc = classify_access(table, t_index, "t")
        if acc.kind != "point":
            raise SymbolError(f"feedback edge %{e.src}->%{e.dst} reads {t_index}; need a point")
        stores.append(StorePlan(e.dst, SLOT, t_index, sympy.Integer(acc.lag or 1), None,
                                f"point access with lag {acc.lag}"))
    return StoragePlan(tuple(stores))


def live_count_fn(table: SymbolTable, plan: StorePlan, bindings: dict[str, int], *,
                  device: bool = False):
    """Compile (once) the number of live slots after writing step ``t``.

    growing/fixed: t+1; ring/block (a ring of ``capacity`` slots): min(t+1, capacity). The host
    loop uses the plain-integer version (growth decisions); with ``device=True`` the same source
    runs over jax.numpy inside a step program (the slots a decode kernel reads).
    """
    t = table.sym("t")
    if isinstance(plan.kind, RingStore):  # ring and block
        expr = sympy.Min(t + 1, plan.capacity_value(bindings))
    else:
        expr = t + 1
    return (compile_jax if device else compile_int)(table, [expr], ["t"])
