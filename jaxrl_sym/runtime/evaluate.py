"""Evaluate a PDG on concrete extents by binding each node's primitive in topological order.

This runs only while JAX traces a jitted program (once per compiled shape), never per step: the
resulting XLA program is the fused region. The sequence extent ``T`` is instantiated with the
*chunk* length (1 for a decode step, the prompt bucket for prefill, the packed row length for a
parallel forward) and ``B`` with the batch bucket. Nodes the runtime executes itself — attention
(against its store, or a packed kernel) and ``sample`` (token selection) — are delegated to
handlers keyed by op, so the same evaluator serves store-backed decoding and the packed forward;
a ``sample`` node without a handler is not evaluated (the packed forward samples nothing).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import sympy

from jaxrl_sym.pdg.ir import PDG, Node

Handler = Callable[[Node, list[Any]], Any]
"""Runs one node: its array, or a tuple of outputs."""


def instantiate(obj: Any, env: Mapping[sympy.Symbol, int]) -> Any:
    """Replace sympy dims inside (nested) params with ints for the given extents."""
    if isinstance(obj, sympy.Basic):
        val = obj.subs(env)
        if not val.is_Integer:
            raise ValueError(f"dimension {obj} is not determined by {dict(env)}")
        return int(val)
    if isinstance(obj, tuple):
        items = [instantiate(x, env) for x in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
    if isinstance(obj, list):
        return [instantiate(x, env) for x in obj]
    if isinstance(obj, dict):
        return {k: instantiate(v, env) for k, v in obj.items()}
    return obj


def static_nodes(pdg: PDG) -> frozenset[int]:
    """Nodes with an empty domain (weights and weight-only work): computed once, hoisted."""
    return frozenset(n.id for n in pdg.nodes if not n.domain)


def evaluate(
    pdg: PDG,
    values: dict[int, tuple[Any, ...]],
    extents: Mapping[str, int],
    handlers: Mapping[str, Handler],
    *,
    order: tuple[int, ...] | None = None,
    only: frozenset[int] | None = None,
) -> dict[int, tuple[Any, ...]]:
    """Compute every node not already in ``values`` (restricted to ``only`` if given).

    ``values`` maps node id → tuple of outputs and must hold the inputs (and, for a step program,
    the hoisted static nodes). ``extents`` binds ``B`` and ``T``. ``handlers`` maps an op name
    (``sym_attention``, ``sample``) to the runtime's implementation of that node.
    """
    env = {pdg.symbols.sym(k): v for k, v in extents.items()}
    vals = dict(values)
    in_edges = {n.id: pdg.in_edges(n.id) for n in pdg.nodes}
    for nid in order or pdg.topo_order():
        if nid in vals or (only is not None and nid not in only):
            continue
        node = pdg.node(nid)
        handler = handlers.get(node.op)
        if node.op in ("input", "weight") or (node.op == "sample" and handler is None):
            continue
        args: list[Any] = [None] * node.n_inputs
        for port, lit in node.literals:
            args[port] = lit
        for e in in_edges[nid]:
            if e.kind == "data":
                args[e.port] = vals[e.src][e.src_out]
        if handler is not None:
            out = handler(node, args)
            vals[nid] = out if isinstance(out, tuple) else (out,)
            continue
        if node.op == "sym_attention":
            raise ValueError(f"attention node %{nid} ({node.source}) reached evaluate() without "
                             "a 'sym_attention' handler")
        params = instantiate(node.params, env)
        out = node.prim.bind(*args, **params)
        vals[nid] = tuple(out) if node.prim.multiple_results else (out,)
    return vals


def constant_values(consts: tuple[tuple[int, Any], ...]) -> dict[int, tuple[Any, ...]]:
    return {nid: (np.asarray(v),) for nid, v in consts}
