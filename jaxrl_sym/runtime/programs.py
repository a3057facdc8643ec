"""Compiled programs built from the PDG: hoist (weights → static values), step (one chunk of
every row through the whole model, stores in/out, next token out), grow, compact, and the
packed full-sequence forward.

Each program is compiled ahead of time once per distinct shape key and kept in an instance-owned
cache, so compiles are counted exactly and XLA's memory analysis of each executable is available
for the peak-bytes accounting.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxrl_sym.generation import select_tokens
from jaxrl_sym.passes.storage import StoragePlan
from jaxrl_sym.pdg.ir import PDG
from jaxrl_sym.runtime.evaluate import evaluate, static_nodes
from jaxrl_sym.runtime.metrics import executable_temp_bytes
from jaxrl_sym.runtime.stores import (
    STORE_KINDS,
    StoreSpec,
    take_rows,
)


@dataclass
class ProgramCache:
    """AOT-compiled executables keyed by (name, shape key); counts compiles and dispatches."""

    compiled: dict[tuple, Any] = field(default_factory=dict)
    temp_bytes: dict[tuple, int] = field(default_factory=dict)
    compiles: int = 0
    dispatches: int = 0

    def get(self, key: tuple, build: Callable[[], Any]) -> Any:
        exe = self.compiled.get(key)
        if exe is None:
            exe = build()
            self.compiled[key] = exe
            self.temp_bytes[key] = executable_temp_bytes(exe)
            self.compiles += 1
        return exe

    def run(self, key: tuple, build: Callable[[], Any], *args: Any) -> Any:
        exe = self.get(key, build)
        self.dispatches += 1
        return exe(*args)


def store_specs(
    pdg: PDG, plan: StoragePlan, bindings: dict[str, int], backend: str = "xla"
) -> dict[int, StoreSpec]:
    """Concrete layouts for every attention node's store."""
    out: dict[int, StoreSpec] = {}
    for sp in plan.stores:
        if sp.kind not in STORE_KINDS:  # the feedback edge's slot: the step program's own carry
            continue
        node = pdg.node(sp.node)
        ins = {e.port: pdg.node(e.src) for e in pdg.in_edges(node.id)}
        k, v = ins[1], ins[2]
        out[sp.node] = StoreSpec(
            node=sp.node, kind=STORE_KINDS[sp.kind], capacity=sp.capacity_value(bindings),
            hkv=int(k.shape[2]), d=int(k.shape[3]), dv=int(v.shape[3]),
            dtype=jnp.dtype(k.dtype), pattern=node.params["pattern"],
            scale=float(node.params["scale"]), softcap=float(node.params["softcap"]),
            backend=backend,
        )
    return out


@dataclass(frozen=True)
class StepBuilder:
    """Pure functions (to be jitted) over a generation PDG and its store specs."""

    pdg: PDG
    specs: dict[int, StoreSpec]
    consts: dict[int, tuple[Any, ...]]
    backend: str = "xla"

    @property
    def boundary(self) -> tuple[int, ...]:
        """Static nodes read by per-step nodes: the hoisted values a step program takes."""
        static = static_nodes(self.pdg)
        return tuple(sorted({e.src for e in self.pdg.edges
                             if e.src in static and e.dst not in static and e.kind == "data"}))

    def weight_ids(self) -> tuple[int, ...]:
        return tuple(nid for role, nid in self.pdg.inputs if role.startswith("weight:"))

    def computed_boundary(self) -> tuple[int, ...]:
        """Boundary nodes that compute something (casts, transposes of weights): hoisted once.
        Boundary weights themselves are passed by reference, never copied."""
        return tuple(n for n in self.boundary if self.pdg.node(n).op != "weight")

    def hoist(self, leaves: list[jax.Array]) -> tuple[jax.Array, ...]:
        vals = {nid: (x,) for nid, x in zip(self.weight_ids(), leaves, strict=True)}
        vals.update(self.consts)
        static = static_nodes(self.pdg)
        vals = evaluate(self.pdg, vals, {}, _no_attention, only=static)
        return tuple(vals[nid][0] for nid in self.computed_boundary())

    def assemble(self, leaves: list[jax.Array], hoisted: tuple[jax.Array, ...]):
        """The step programs' static inputs in boundary order: weights by reference."""
        by_id = dict(zip(self.weight_ids(), leaves, strict=True))
        by_id.update({nid: v[0] for nid, v in self.consts.items()})
        by_id.update(zip(self.computed_boundary(), hoisted, strict=True))
        return tuple(by_id[nid] for nid in self.boundary)

    def init_stores(self, batch: int, capacity: int) -> dict[str, dict[str, jax.Array]]:
        return {str(nid): spec.kind.init(spec, batch, spec.kind.capacity(spec, capacity))
                for nid, spec in self.specs.items()}

    def prefill(self, hoisted, stores, tokens, positions, row_ids, seed, *, temperature: float,
                want_logits: bool, chunk: int):
        """The right-aligned prompt block, written from slot 0 in chunks of ``chunk`` slots.

        The first chunk (``P mod chunk`` slots, or ``chunk``) starts from empty stores; a scan
        feeds the rest through the stores as multi-slot steps, so only one chunk's
        ``[B, chunk, vocab]`` logits are alive (see :meth:`GenerationConfig.prefill_chunk`).
        Token 0 is selected from the last chunk's last slot.
        """
        p = tokens.shape[1]
        first = p % chunk or chunk
        steps = jnp.zeros(tokens.shape[:1], jnp.int32)
        kw = dict(temperature=temperature, want_logits=want_logits)
        out = self._chunk(hoisted, stores, tokens[:, :first], positions[:, :first],
                          jnp.zeros((), jnp.int32), steps, row_ids, seed, fresh=True, **kw)
        if first == p:
            return out

        def fill(st, start):
            sl = lambda x: lax.dynamic_slice_in_dim(x, start, chunk, axis=1)
            st, tok, lp, lg = self._chunk(hoisted, st, sl(tokens), sl(positions), start, steps,
                                          row_ids, seed, **kw)
            return st, (tok, lp, lg)

        stores, (toks, lps, lgs) = lax.scan(fill, out[0], jnp.arange(first, p, chunk,
                                                                      dtype=jnp.int32))
        return stores, toks[-1], lps[-1], lgs[-1]

    def decode(self, hoisted, stores, prev_tokens, pos0, step, write_index, row_ids, seed, *,
               temperature: float, want_logits: bool):
        """Decode step ``step`` (>= 1): feed back token step-1 (the t-1 feedback edge)."""
        positions = (pos0 + (step - 1))[:, None]
        steps = jnp.full(prev_tokens.shape, step, jnp.int32)
        return self._chunk(hoisted, stores, prev_tokens[:, None], positions, write_index, steps,
                           row_ids, seed, temperature=temperature, want_logits=want_logits)

    def decode_tile(self, hoisted, stores, prev_tokens, pos0, step, write_index, row_ids, seed,
                    *, temperature: float, want_logits: bool, k: int):
        """Decode steps ``step .. step+k-1`` in one program (``lax.scan`` over :meth:`decode`).

        Why: a host-driven loop pays a dispatch and a device→host sync per token, which for
        small models or batches costs as much as the step itself. A tile of k steps pays them
        once; tokens a row samples after its EOS or limit inside a tile are discarded by the
        host (at most k-1 per row), and sampling is keyed by (seed, step, row), so the tokens
        are the ones k single steps would give. The host guarantees capacity for all k writes.
        Returns (stores, last tokens [B], tokens [k, B], log-probs [k, B], logits [k, …]).
        """

        def body(carry, i):
            st, tok = carry
            st, tok, lp, lg = self.decode(hoisted, st, tok, pos0, step + i, write_index + i,
                                          row_ids, seed, temperature=temperature,
                                          want_logits=want_logits)
            return (st, tok), (tok, lp, lg)

        (stores, last), (toks, lps, lgs) = lax.scan(body, (stores, prev_tokens),
                                                   jnp.arange(k, dtype=jnp.int32))
        return stores, last, toks, lps, lgs

    def _chunk(
        self,
        hoisted: tuple[jax.Array, ...],
        stores: dict[str, dict[str, jax.Array]],
        tokens: jax.Array,
        positions: jax.Array,
        write_index: jax.Array,
        steps: jax.Array,
        row_ids: jax.Array,
        seed: jax.Array,
        *,
        temperature: float,
        want_logits: bool,
        fresh: bool = False,
    ) -> tuple[Any, ...]:
        """One chunk for every row: model forward on [B, c] with stores, then token selection."""
        pdg = self.pdg
        vals: dict[int, tuple[Any, ...]] = {nid: (x,) for nid, x in
                                             zip(self.boundary, hoisted, strict=True)}
        vals[pdg.input_id("tokens")] = (tokens,)
        vals[pdg.input_id("positions")] = (positions,)
        vals[pdg.input_id("segment_ids")] = (jnp.zeros_like(positions),)
        new_stores: dict[str, dict[str, jax.Array]] = {}

        def attn(node: Any, args: list[jax.Array]) -> jax.Array:
            spec = self.specs[node.id]
            out, new = spec.kind.attend(spec, stores[str(node.id)], args, write_index,
                                        fresh=fresh)
            new_stores[str(node.id)] = new
            return out

        b, c = tokens.shape
        logits_id = pdg.outputs[0]
        out = evaluate(pdg, vals, {"B": b, "T": c}, attn, only=_dynamic(pdg))
        logits = out[logits_id][0][:, -1].astype(jnp.float32)
        tok, lp = select_tokens(logits, seed=seed, steps=steps, row_ids=row_ids,
                                temperature=temperature)
        return new_stores, tok, lp, (logits if want_logits else jnp.zeros((0,), jnp.float32))

    @staticmethod
    def compact(stores, rows, filler, tok, pos0, row_ids):
        """Keep ``rows`` (finished rows dropped); filler slots get dead (negative) positions."""
        pos0 = jnp.where(filler, DEAD_POSITION, jnp.take(pos0, rows, axis=0))
        return ({k: take_rows(s, rows) for k, s in stores.items()},
                jnp.take(tok, rows, axis=0), pos0, jnp.take(row_ids, rows, axis=0))

    def forward(self, leaves: list[jax.Array], tokens: jax.Array, positions: jax.Array,
                segment_ids: jax.Array, cu_seqlens: jax.Array | None = None) -> jax.Array:
        """Full-sequence forward (packed rows): logits [R, L, V]; differentiable in leaves.

        With the Triton backend and ``cu_seqlens`` (see ``PackedBatch.cu_seqlens``), softmax
        attention runs in the packed variable-length kernel (forward + backward kernels via
        custom_vjp) over the rows flattened end to end; otherwise the masked primitive.
        """
        pdg = self.pdg
        vals = {nid: (x,) for nid, x in zip(self.weight_ids(), leaves, strict=True)}
        vals.update(self.consts)
        vals[pdg.input_id("tokens")] = (tokens,)
        vals[pdg.input_id("positions")] = (positions,)
        vals[pdg.input_id("segment_ids")] = (segment_ids,)
        r, length = tokens.shape

        def attn(node: Any, args: list[jax.Array]) -> jax.Array:
            pattern = node.params["pattern"]
            if self.backend == "triton" and cu_seqlens is not None and \
                    pattern.kernel_mask() is not None:
                from jaxrl_sym.backends import triton_ops

                q, k, v = args[:3]
                flat = lambda x: x.reshape(r * length, *x.shape[2:])
                out = triton_ops.packed_attention(flat(q), flat(k), flat(v), cu_seqlens,
                                                  pattern=pattern, scale=node.params["scale"],
                                                  softcap=node.params["softcap"])
                return out.reshape(r, length, *out.shape[1:])
            # The primitive itself: masked by positions and segments, differentiable.
            return node.prim.bind(*args, **node.params)

        out = evaluate(pdg, vals, {"B": r, "T": length}, attn)
        return out[pdg.outputs[0]][0]


DEAD_POSITION = -(1 << 30)  # position offset of filler rows: their positions stay negative (masked)


def _no_attention(node: Any, args: list[jax.Array]) -> jax.Array:  # pragma: no cover
    raise AssertionError("static region contains attention")


def _dynamic(pdg: PDG) -> frozenset[int]:
    static = static_nodes(pdg)
    return frozenset(n.id for n in pdg.nodes if n.id not in static)
