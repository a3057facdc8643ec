"""jaxpr (traced with symbolic B and T) → PDG.

``jax.make_jaxpr`` runs the user's Flax model once with ``tokens: int32[B, T]``; JAX carries the
symbolic extents through every shape. We inline call-like primitives (jit, custom_jvp, …), label
each axis whose extent is exactly ``B`` or ``T``, check every equation against the rule table in
:mod:`jaxrl_sym.tracer.rules`, and emit one PDG node per equation. Position-wise data flow becomes
``Point`` edges; the library's attention primitive turns its key/value inputs into ``Range`` edges
given by the pattern's S(t).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import sympy
from flax import nnx
from jax.extend import core as jcore

from jaxrl_sym.dimexpr import is_symbolic, to_sympy
from jaxrl_sym.errors import NonCausalMixingError, SymbolError, source_line
from jaxrl_sym.ops.attention import Pattern
from jaxrl_sym.pdg.ir import PDG, Edge, Node
from jaxrl_sym.symbols import IndexExpr, Point, Range, SymbolTable
from jaxrl_sym.tracer.flatten import attention_eqns, call_body, flatten
from jaxrl_sym.tracer.position_limit import PositionLimit, position_limit
from jaxrl_sym.tracer.rules import EqnView, check_equation
from jaxrl_sym.tracer.static_slice import as_slice, fold

# extent symbol -> iterator symbol of the domain
DOMAIN = (("r", "B"), ("t", "T"))
ITER = {"B": "r", "T": "t"}
# ports of sym_attention that read keys (k, v, kv_positions, kv_segment_ids)
KV_PORTS = (1, 2, 4, 6)


@dataclass(frozen=True)
class SeqInput:
    """A sequence input of the traced function: shape spec over B/T and dtype."""

    role: str
    shape: str  # e.g. "B, T"
    dtype: Any = jnp.int32


def _size_symbols(patterns: Sequence[Pattern]) -> dict[Pattern, str]:
    """One symbol per distinct size of each sized pattern kind: ``w`` (or ``w0``, ``w1``, …)."""
    names: dict[Pattern, str] = {}
    for base in sorted({p.symbol for p in patterns if p.symbol}):
        sizes = sorted({p.size for p in patterns if p.symbol == base})
        for p in patterns:
            if p.symbol == base:
                i = sizes.index(p.size)
                names[p] = base if len(sizes) == 1 else f"{base}{i}"
    return names


def _base_table(patterns: Sequence[Pattern]) -> tuple[SymbolTable, dict[Pattern, Range]]:
    """Symbols for the domain plus one per distinct window/block size; each pattern's S(t)."""
    sym_names = _size_symbols(patterns)
    extra = sorted(set(sym_names.values()))
    table = SymbolTable.create(
        ", ".join(["r", "t", "B", "T", *extra]), constraints=["t <= T - 1", "r <= B - 1"],
        bounds={n: (1, None) for n in extra},
    )
    t = table.sym("t")
    ranges = {p: Range(*p.key_range(t, table.sym(sym_names[p]) if p in sym_names else None))
              for p in patterns}
    return table, ranges


def pattern_bindings(table: SymbolTable, patterns: Sequence[Pattern]) -> dict[str, int]:
    """Concrete values of the pattern symbols (w, b, …) for this model."""
    del table
    return {name: p.size for p, name in _size_symbols(patterns).items()}


def _map_dims(obj: Any, f: Callable[[Any], Any]) -> Any:
    """Apply ``f`` to every JAX symbolic dim inside (nested) tuples/lists/namedtuples."""
    if is_symbolic(obj):
        return f(obj)
    if isinstance(obj, tuple):
        items = [_map_dims(x, f) for x in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
    if isinstance(obj, list):
        return [_map_dims(x, f) for x in obj]
    return obj


class _Builder:
    """Mutable scratchpad used only while building; the result is an immutable PDG."""

    def __init__(self, table: SymbolTable, ranges: Mapping[Pattern, Range]) -> None:
        self.table = table
        self.ranges = ranges
        self.nodes: list[Node] = []
        self.edges: list[Edge] = []
        self.env: dict[Any, tuple[int, int]] = {}  # jaxpr Var -> (node id, output index)
        self.consts: dict[int, Any] = {}  # node id -> constant value
        self.known: dict[Any, np.ndarray] = {}  # jaxpr Var -> value of small index arithmetic
        self.call_sources: list[str] = []  # user lines of the calls being inlined
        self.T = table.sym("T")
        self.B = table.sym("B")

    def shape(self, aval: Any, where: str) -> tuple[tuple[sympy.Expr, ...], tuple[str | None, ...]]:
        dims = tuple(to_sympy(d, self.table) for d in aval.shape)
        labels: list[str | None] = []
        for d in dims:
            if d == self.T:
                labels.append("T")
            elif d == self.B:
                labels.append("B")
            elif d.free_symbols & {self.T, self.B}:
                which = "sequence dimension T" if self.T in d.free_symbols else "batch dimension B"
                raise NonCausalMixingError(
                    f"{where} produces an axis of extent {d}, which mixes the {which} (a slice "
                    f"like x[:, 1:], padding or concatenation along it, or a reshape merging it "
                    f"with another axis); such positions cannot be computed one step at a time."
                )
            else:
                labels.append(None)
        for lab in ("B", "T"):
            if labels.count(lab) > 1:
                raise NonCausalMixingError(
                    f"{where} builds an array with two axes of extent {lab} (shape "
                    f"{tuple(dims)}): a pairwise position×position tensor, as in hand-written "
                    f"attention. Use jaxrl_sym.attend(q, k, v, pattern, …) instead."
                )
        return dims, tuple(labels)

    def add_node(self, **kw: Any) -> int:
        nid = len(self.nodes)
        self.nodes.append(Node(id=nid, **kw))
        return nid

    def domain(self, labels: Sequence[str | None]) -> tuple[str, ...]:
        return tuple(ITER[lab] for lab in ("B", "T") if lab in labels)

    def index_for(self, src: Node, dst_prim: str, port: int, params: Mapping[str, Any]) -> tuple:
        out: list[IndexExpr] = []
        for it in src.domain:
            sym = self.table.sym(it)
            if it == "t" and dst_prim == "sym_attention" and port in KV_PORTS:
                out.append(self.ranges[params["pattern"]])
            else:
                out.append(Point(sym))
        return tuple(out)

    def add_var_node(self, var: Any, op: str, name: str, value: Any = None) -> int:
        dims, labels = self.shape(var.aval, f"input {name!r}")
        nid = self.add_node(op=op, domain=self.domain(labels), shape=dims, axes=labels,
                            dtype=str(var.aval.dtype), name=name)
        self.env[var] = (nid, 0)
        if value is not None:
            self.consts[nid] = value
        return nid

    def read(self, atom: Any) -> tuple[int, int] | None:
        if isinstance(atom, jcore.Literal):
            return None
        return self.env[atom]

    def equations(self, jaxpr: jcore.Jaxpr, consts: Sequence[Any]) -> None:
        for var, val in zip(jaxpr.constvars, consts, strict=True):
            self.add_var_node(var, "weight", f"const{len(self.consts)}", np.asarray(val))
        for eqn in jaxpr.eqns:
            inner = call_body(eqn)
            if inner is not None:
                self.inline(eqn, inner)
            else:
                self.equation(eqn)

    def source(self, eqn: Any) -> str:
        """The user's line; for library internals inlined from a call, the call's line."""
        src = source_line(eqn)
        for outer in reversed(self.call_sources):
            if src.startswith("<unknown") or "/site-packages/jax/" in src:
                src = outer
        return src

    def inline(self, eqn: Any, inner: jcore.ClosedJaxpr) -> None:
        self.call_sources.append(self.source(eqn))
        try:
            self._inline(eqn, inner)
        finally:
            self.call_sources.pop()

    def _inline(self, eqn: Any, inner: jcore.ClosedJaxpr) -> None:
        for cv, val in zip(inner.jaxpr.constvars, inner.consts, strict=True):
            self.add_var_node(cv, "weight", f"const{len(self.consts)}", np.asarray(val))
        n_in = len(inner.jaxpr.invars)
        outer_in = eqn.invars[-n_in:] if n_in else []  # custom_vjp may prepend extra operands
        literal_nodes: dict[Any, Any] = {}
        for iv, ov in zip(inner.jaxpr.invars, outer_in, strict=True):
            if isinstance(ov, jcore.Literal):
                literal_nodes[iv] = ov
            else:
                self.env[iv] = self.env[ov]
                self._alias(iv, ov)
        if literal_nodes:
            # Literal operands of a call become constant nodes inside the inlined body.
            for iv, lit in literal_nodes.items():
                self.add_var_node(iv, "weight", f"const{len(self.consts)}", np.asarray(lit.val))
        for eqn_inner in inner.jaxpr.eqns:
            sub = call_body(eqn_inner)
            if sub is not None:
                self.inline(eqn_inner, sub)
            else:
                self.equation(eqn_inner)
        for ov, iv in zip(eqn.outvars, inner.jaxpr.outvars, strict=True):
            if isinstance(iv, jcore.Literal):
                self.add_var_node(ov, "weight", f"const{len(self.consts)}", np.asarray(iv.val))
            else:
                self.env[ov] = self.env[iv]
                self._alias(ov, iv)

    def _alias(self, var: Any, same: Any) -> None:
        if same in self.known:
            self.known[var] = self.known[same]

    def equation(self, eqn: Any) -> None:
        # x[..., :k] under symbolic shapes is a gather at a constant start: node it as the
        # slice it is (its transpose a pad, not a scatter-add into zeros; tracer.static_slice)
        eqn = as_slice(eqn, self.known) or eqn
        fold(eqn, self.known)
        prim = eqn.primitive.name
        src = self.source(eqn)
        where = f"primitive '{prim}' at {src}"
        in_shapes, in_labels, in_lits = [], [], []
        for a in eqn.invars:
            dims, labels = self.shape(a.aval, where)
            in_shapes.append(dims)
            in_labels.append(labels)
            in_lits.append(a.val if isinstance(a, jcore.Literal) else None)
        out_shapes, out_labels = [], []
        for v in eqn.outvars:
            dims, labels = self.shape(v.aval, where)
            out_shapes.append(dims)
            out_labels.append(labels)
        params = {k: _map_dims(v, lambda d: to_sympy(d, self.table))
                  for k, v in eqn.params.items()}
        check_equation(EqnView(prim, params, tuple(in_shapes), tuple(in_labels),
                               tuple(out_shapes), tuple(out_labels), tuple(in_lits), src))
        nid = self.add_node(
            op=prim, domain=self.domain(out_labels[0]), shape=out_shapes[0], axes=out_labels[0],
            dtype=str(eqn.outvars[0].aval.dtype), name=str(eqn.outvars[0]), source=src,
            prim=eqn.primitive, params=params,
            literals=tuple((i, lit) for i, lit in enumerate(in_lits)
                           if isinstance(eqn.invars[i], jcore.Literal)),
            n_inputs=len(eqn.invars),
        )
        for port, a in enumerate(eqn.invars):
            ref = self.read(a)
            if ref is None:
                continue
            src_node = self.nodes[ref[0]]
            self.edges.append(Edge(ref[0], nid, port, self.index_for(src_node, prim, port, params),
                                   src_out=ref[1]))
        for k, v in enumerate(eqn.outvars):
            self.env[v] = (nid, k)


@dataclass(frozen=True)
class TracedProgram:
    """A PDG plus what is needed to feed it: the weight leaves and their treedef, bindings."""

    pdg: PDG
    weight_treedef: Any
    consts: tuple[tuple[int, Any], ...]  # (node id, value) for captured constants
    bindings: tuple[tuple[str, int], ...]  # pattern symbols (w, b, …) -> values
    patterns: tuple[Pattern, ...]
    # how far the model's position tables reach (None: none read by position, e.g. RoPE)
    position_limit: PositionLimit | None = None

    @property
    def binding_dict(self) -> dict[str, int]:
        return dict(self.bindings)


def _symbolic_jaxpr(fn: Callable[..., Any], leaves: list[Any], treedef: Any,
                    seq_inputs: Sequence[SeqInput]) -> Any:
    """``fn``'s closed jaxpr with the sequence inputs at symbolic ``B, T`` (shape errors
    explained: every sequence input and intermediate must keep the same B and T)."""
    symdims = dict(zip(("B", "T"), jax.export.symbolic_shape("B, T"), strict=True))
    specs = []
    for s in seq_inputs:
        names = [n.strip() for n in s.shape.split(",") if n.strip()]
        try:
            shape = tuple(symdims[n] if n in symdims else int(n) for n in names)
        except ValueError:
            raise SymbolError(
                f"sequence input {s.role!r} has shape {s.shape!r}: use B, T or integers"
            ) from None
        specs.append(jax.ShapeDtypeStruct(shape, s.dtype))
    leaf_specs = [jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)) for x in leaves]

    def flat(leaves_: list[Any], *seq: Any) -> Any:
        return fn(jax.tree_util.tree_unflatten(treedef, leaves_), *seq)

    try:
        closed = jax.make_jaxpr(flat)(leaf_specs, *specs)
    except TypeError as err:
        if "shape" not in str(err):
            raise
        raise SymbolError(
            f"tracing with symbolic B, T failed: {err}. Arrays whose extents are different "
            f"symbolic expressions (e.g. T and T - 1) were combined; every sequence input and "
            f"intermediate must keep the same B and T."
        ) from err
    return closed


def trace_function(
    fn: Callable[..., Any],
    weights: Any,
    seq_inputs: Sequence[SeqInput],
    patterns: Sequence[Pattern] = (),
) -> TracedProgram:
    """Trace ``fn(weights, *seq_inputs)`` with symbolic B, T and build its PDG.

    The attention patterns are read from the traced ``attend`` calls (after loops over layers
    are unrolled, :mod:`jaxrl_sym.tracer.flatten`); each distinct window/block size gets its own
    symbol (w, b, w0, w1, …). ``patterns`` may add more (symbols for patterns not traced).
    """
    leaves, treedef = jax.tree_util.tree_flatten(weights)
    closed = _symbolic_jaxpr(fn, leaves, treedef, seq_inputs)
    # Loops over layers become one attention equation per layer; the patterns are read from
    # those equations (the model declares nothing).
    closed = flatten(closed)
    roles = [s.role for s in seq_inputs]
    limit = (position_limit(closed, len(leaves) + roles.index("positions"))
             if "positions" in roles else None)
    found = tuple(dict.fromkeys(e.params["pattern"] for e in attention_eqns(closed.jaxpr)))
    patterns = tuple(dict.fromkeys((*found, *(patterns or ()))))
    table, ranges = _base_table(patterns)
    b = _Builder(table, ranges)
    inputs: list[tuple[str, int]] = []
    n_leaves = len(leaves)
    for k, var in enumerate(closed.jaxpr.invars):
        if k < n_leaves:
            nid = b.add_var_node(var, "weight", f"w{k}")
            inputs.append((f"weight:{k}", nid))
        else:
            role = seq_inputs[k - n_leaves].role
            inputs.append((role, b.add_var_node(var, "input", role)))
    b.equations(closed.jaxpr, closed.consts)
    outputs = []
    for ov in closed.jaxpr.outvars:
        if isinstance(ov, jcore.Literal):
            raise SymbolError("the traced function returns a constant; return model outputs")
        ref = b.env[ov]
        if ref[1] != 0:
            raise SymbolError("multi-output primitives as program outputs are not supported")
        outputs.append(ref[0])
    pdg = PDG(tuple(b.nodes), tuple(b.edges), table, tuple(inputs), tuple(outputs), DOMAIN)
    return TracedProgram(pdg, treedef, tuple(b.consts.items()),
                         tuple(pattern_bindings(table, patterns).items()), tuple(patterns), limit)


MODEL_INPUTS = (SeqInput("tokens", "B, T"), SeqInput("positions", "B, T"),
                SeqInput("segment_ids", "B, T"))


def _model_fn(graphdef: Any) -> Callable[..., Any]:
    def fn(st: Any, tokens: jax.Array, positions: jax.Array, segment_ids: jax.Array) -> Any:
        return nnx.merge(graphdef, st)(tokens, positions, segment_ids)

    return fn


def trace_model(model: nnx.Module) -> tuple[TracedProgram, Any, Any]:
    """Trace a Flax NNX LM called as ``model(tokens, positions, segment_ids) -> logits``.

    Returns (program, graphdef, params-state): the params state is the weights pytree the runtime
    feeds, so training can swap in new parameters without re-tracing.
    """
    graphdef, state = nnx.split(model)
    prog = trace_function(_model_fn(graphdef), state, MODEL_INPUTS)
    return prog, graphdef, state


def model_position_limit(model: nnx.Module) -> PositionLimit | None:
    """How far ``model``'s position tables reach (:mod:`jaxrl_sym.tracer.position_limit`), for
    a system that runs the model without the PDG (the padded baseline). Traces, compiles
    nothing."""
    graphdef, state = nnx.split(model)
    leaves, treedef = jax.tree_util.tree_flatten(state)
    closed = flatten(_symbolic_jaxpr(_model_fn(graphdef), leaves, treedef, MODEL_INPUTS))
    return position_limit(closed, len(leaves) + 1)
