"""Evaluate a PDG on concrete extents by binding each node's primitive in topological order.

This runs only while JAX traces a jitted program (once per compiled shape), never per step: the
resulting XLA program is the fused region. The sequence extent ``T`` is instantiated with the
*chunk* length (1 for a decode step, the prompt bucket for prefill, the packed row length for a
parallel forward) and ``B`` with the batch bucket. Nodes the runtime executes itself — attention
(against its store, or a packed kernel) and ``sample`` (token selection with the runtime's seed
and row ids) — are delegated to handlers keyed by their primitive, so one evaluator serves every
program that runs a model (:func:`evaluate`): a prefill chunk or decode step against the
stores, the packed prefill, a speculative verify or draft step, the packed training forward and
the RL features forward. A ``sample`` node without a handler is not evaluated (a forward samples
nothing).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np
import sympy

from jaxrl_sym.ops.attention import attention_p
from jaxrl_sym.ops.sampling import sample_p
from jaxrl_sym.passes.positions import Crossing, PositionTail
from jaxrl_sym.pdg.ir import PDG, Node

Handler = Callable[[Node, list[Any]], Any]
"""Runs one node: its array, or a tuple of outputs."""


def bind(node: Node, args: list[Any]) -> Any:
    """A node's own primitive on its operands (attention: the masked primitive, differentiable;
    the handler of a forward over whole sequences)."""
    return node.prim.bind(*args, **node.params)


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


def evaluate_nodes(
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
    the hoisted static nodes). ``extents`` binds ``B`` and ``T``. ``handlers`` maps a primitive
    (``attention_p``, ``sample_p``) to the runtime's implementation of its nodes.
    """
    env = {pdg.symbols.sym(k): v for k, v in extents.items()}
    vals = dict(values)
    in_edges = {n.id: pdg.in_edges(n.id) for n in pdg.nodes}
    for nid in order or pdg.topo_order():
        if nid in vals or (only is not None and nid not in only):
            continue
        node = pdg.node(nid)
        handler = handlers.get(node.prim) if node.prim is not None else None
        if node.prim is None or (node.prim is sample_p and handler is None):
            continue  # an input or weight (given), or a sample no program asked for
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
        if node.prim is attention_p:
            raise ValueError(f"attention node %{nid} ({node.source}) reached evaluate_nodes() "
                             "without an attention handler")
        params = instantiate(node.params, env)
        out = node.prim.bind(*args, **params)
        vals[nid] = tuple(out) if node.prim.multiple_results else (out,)
    return vals


def dynamic_nodes(pdg: PDG) -> frozenset[int]:
    """Nodes with a domain (per row and position): what a step program computes."""
    static = static_nodes(pdg)
    return frozenset(n.id for n in pdg.nodes if n.id not in static)


def evaluate(pdg: PDG, static: Mapping[int, tuple[Any, ...]], tokens: Any, positions: Any,
                   segment_ids: Any = None, *, attention: Handler = bind,
                   sample: Handler | None = None, dynamic_only: bool = False,
                   at: tuple[Any, Any, PositionTail] | None = None
                   ) -> dict[int, tuple[Any, ...]]:
    """A model's PDG on one batch of sequence inputs ``[B, T]``: the one evaluator behind every
    program that runs a model (see the module docstring). What differs between those programs
    is only how an attention node meets its store (``attention``; default: the primitive
    itself) and whether the ``sample`` node picks tokens (``sample``; None: not evaluated).

    static: node id → values of the weights and constants (then every node is computed: a
    forward), or of the hoisted boundary with ``dynamic_only`` (only per-position nodes are
    computed: a step program). ``segment_ids`` None: one segment per row. ``at = (rows, pos,
    tail)``: the position-wise tail after the last attention
    (:func:`~jaxrl_sym.passes.positions.position_tail`) runs only at the pairs ``(rows[i],
    pos[i])``, its values ``[pairs, 1, ...]`` (a prefill's sampler reads one position per row).
    Returns every value computed, by node id.
    """
    vals = dict(static)
    vals[pdg.input_id("tokens")] = (tokens,)
    vals[pdg.input_id("positions")] = (positions,)
    vals[pdg.input_id("segment_ids")] = (jnp.zeros_like(positions) if segment_ids is None
                                         else segment_ids,)
    handlers: dict[Any, Handler] = {attention_p: attention}
    if sample is not None:
        handlers[sample_p] = sample
    extents = {"B": positions.shape[0], "T": positions.shape[1]}
    only = dynamic_nodes(pdg) if dynamic_only else None
    if at is None:
        return evaluate_nodes(pdg, vals, extents, handlers, only=only)
    rows, pos, tail = at
    head = (only or frozenset(n.id for n in pdg.nodes)) - tail.members
    vals = evaluate_nodes(pdg, vals, extents, handlers, only=head)
    inside = dict(vals)
    for c in tail.crossings:
        outs = list(inside[c.node])
        outs[c.out] = _gather(outs[c.out], c, rows, pos)
        inside[c.node] = tuple(outs)
    done = evaluate_nodes(pdg, inside, {"B": rows.shape[0], "T": 1}, handlers,
                          order=tail.nodes, only=tail.members)
    return {**vals, **{nid: done[nid] for nid in tail.nodes if nid in done}}


def _gather(x: Any, c: Crossing, rows: Any, pos: Any) -> Any:
    """``x`` at the pairs ``(rows[i], pos[i])``: its row axis becomes the pairs, its position
    axis (if any) one position; other axes keep their place."""
    if c.pos_axis is None:
        return jnp.take(x, rows, axis=c.row_axis)
    y = jnp.moveaxis(x, (c.row_axis, c.pos_axis), (0, 1))[rows, pos][:, None]
    return jnp.moveaxis(y, (0, 1), (c.row_axis, c.pos_axis))


def constant_values(consts: tuple[tuple[int, Any], ...]) -> dict[int, tuple[Any, ...]]:
    return {nid: (np.asarray(v),) for nid, v in consts}
