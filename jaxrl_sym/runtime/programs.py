"""Compiled programs built from the PDG: hoist (weights → static values), step (one chunk of
every row through the whole model, stores in/out, next token out), grow, compact, and the
packed full-sequence forward.

Each program is compiled ahead of time once per distinct shape key and kept in an instance-owned
cache, so compiles are counted exactly and XLA's memory analysis of each executable is available
for the peak-bytes accounting.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxrl_sym.backends import triton_ops
from jaxrl_sym.ops.attention import attention_p
from jaxrl_sym.ops.sampling import sample as sample_tokens
from jaxrl_sym.passes.positions import PositionTail
from jaxrl_sym.passes.storage import StoragePlan, live_count_fn
from jaxrl_sym.passes.stores import SlotSpec, SlotStore, StoreSpec, take_rows
from jaxrl_sym.pdg.ir import PDG
from jaxrl_sym.runtime.evaluate import bind, evaluate, evaluate_nodes, static_nodes
from jaxrl_sym.runtime.metrics import executable_temp_bytes, trim_host_heap
from jaxrl_sym.sharding import data_size, global_args, replicated, rows_sharding


@dataclass(frozen=True)
class Build:
    """A program to compile: the jitted function and the arguments (arrays or
    ``jax.ShapeDtypeStruct``s) it is lowered at, ``kwargs`` its static keyword arguments.
    Calling it compiles for this machine (what the caches do); a ledger may hand the same
    function and arguments to another compiler (``bench/lib/projection/xla_gpu.py``: for a GPU)."""

    fn: Any
    args: tuple[Any, ...]
    kwargs: tuple[tuple[str, Any], ...] = ()
    jit: tuple[tuple[str, Any], ...] = ()  # jax.jit's options, when ``fn`` is not jitted yet

    @property
    def jitted(self) -> Any:
        """``fn`` under ``jax.jit`` — made here, on a cache miss, not on every dispatch that
        only needs the cache key."""
        return self.fn if hasattr(self.fn, "lower") else jax.jit(self.fn, **dict(self.jit))

    def __call__(self) -> Any:
        return self.jitted.lower(*self.args, **dict(self.kwargs)).compile()


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class DecodeRows:
    """The per-row arrays a decode program takes, as one argument: the device half of a decode
    group's host state (:class:`~jaxrl_sym.runtime.group.rows.RowState`, which makes it).

    Why one value: the decode programs took them as four positional arrays among eleven, and
    every caller (the group, the ledger's abstract arguments, compile-ahead) spelled them again.
    ``pos0 [B]``: the position of each row's response token 0, less ``off``; ``row_id [B]``: the
    id its sampling draws with; ``off [B]``: the group step before its first decode step (a
    refilled row starts late); ``last [B]``: its last group step, -1 for an ended or filler row
    (the tile program's per-row stop). Arrays, or ``jax.ShapeDtypeStruct``s (:meth:`abstract`).
    """

    pos0: Any
    row_id: Any
    off: Any
    last: Any

    @property
    def shape(self) -> tuple[int, ...]:
        """``(rows,)``: what distinguishes the decode programs over these rows."""
        return tuple(self.pos0.shape)

    @staticmethod
    def abstract(rows: int) -> DecodeRows:
        """The shapes alone, for compiling a program that has not run (a ledger, compile-ahead)."""
        i32 = jax.ShapeDtypeStruct((rows,), jnp.int32)
        return DecodeRows(i32, i32, i32, i32)


@dataclass
class ProgramCache:
    """AOT-compiled executables keyed by (name, shape key); counts compiles and dispatches.

    A program may also be compiled *ahead* (:meth:`prefetch`) on ``threads`` background threads
    owned by the cache: the runtime asks for programs it will want later — a group's decode
    buckets, a compaction's smaller bucket — without waiting for them, and :meth:`get` waits for
    a pending one only when it is actually run. XLA's compiler releases the GIL, so the
    compiles overlap each other (tracing and lowering, in Python, do not), the host loop and
    the device work of the current dispatch.
    """

    compiled: dict[tuple, Any] = field(default_factory=dict)
    temp_bytes: dict[tuple, int] = field(default_factory=dict)
    compiles: int = 0
    dispatches: int = 0
    ahead: int = 0  # compiles that were started by prefetch before they were needed
    budget: Any = None  # a jaxrl_sym.sharding.MemoryBudget: every new program is checked
    device_bytes: dict[tuple, int] = field(default_factory=dict)  # per-device, when checked
    pending: dict[tuple, Future] = field(default_factory=dict)  # prefetched, maybe compiling
    settled: frozenset[tuple] = frozenset()  # requested before the current call (begin_call)
    threads: int = 1  # background compile threads (prefetch)
    _pool: ThreadPoolExecutor | None = field(default=None, repr=False)

    def get(self, key: tuple, build: Callable[[], Any]) -> Any:
        exe = self.compiled.get(key)
        if exe is None:
            fut = self.pending.pop(key, None)
            exe = build() if fut is None else fut.result()
            self.ahead += fut is not None
            trim_host_heap()  # the compiler's freed working memory (see trim_host_heap)
            if self.budget is not None:
                self.device_bytes[key] = self.budget.check_program(exe, str(key[0]))
            self.compiled[key] = exe
            self.temp_bytes[key] = executable_temp_bytes(exe)
            self.compiles += 1
        return exe

    def requested(self, key: tuple) -> bool:
        """Compiled, or being compiled ahead."""
        return key in self.compiled or key in self.pending

    def begin_call(self) -> None:
        """Mark every program requested so far as *settled*: a caller that defers programs
        requested during its own call may wait for these (see ``DecodeGroup._defer``), so
        what a call runs depends on the calls before it, not on compile timing."""
        self.settled = frozenset(self.compiled) | frozenset(self.pending)

    def prefetch(self, key: tuple, build: Callable[[], Any]) -> None:
        """Start compiling ``key`` in the background unless it was requested before."""
        if self.requested(key):
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="jaxrl-sym-compile")
        self.pending[key] = self._pool.submit(build)

    def cancel(self, keys: Sequence[tuple]) -> None:
        """Drop the prefetched programs among ``keys`` whose compile has not started (one
        that has runs to its end; a later :meth:`get` compiles a dropped one on demand)."""
        for key in keys:
            fut = self.pending.get(key)
            if fut is not None and fut.cancel():
                del self.pending[key]

    def run(self, key: tuple, build: Callable[[], Any], *args: Any) -> Any:
        exe = self.get(key, build)
        self.dispatches += 1
        return exe(*global_args(exe, args))


def store_specs(
    pdg: PDG, plan: StoragePlan, bindings: dict[str, int], backend: str = "xla"
) -> dict[int, StoreSpec]:
    """Concrete layouts for every attention node's store."""
    out: dict[int, StoreSpec] = {}
    for sp in plan.stores:
        if isinstance(sp.kind, SlotStore):  # the feedback edge: see slot_specs
            continue
        node = pdg.node(sp.node)
        ins = {e.port: pdg.node(e.src) for e in pdg.in_edges(node.id)}
        k, v = ins[1], ins[2]
        out[sp.node] = StoreSpec(
            node=sp.node, kind=sp.kind, capacity=sp.capacity_value(bindings),
            hkv=int(k.shape[2]), d=int(k.shape[3]), dv=int(v.shape[3]),
            dtype=jnp.dtype(k.dtype), pattern=node.params["pattern"],
            scale=float(node.params["scale"]), softcap=float(node.params["softcap"]),
            backend=backend, live=live_count_fn(pdg.symbols, sp, bindings, device=True),
        )
    return out


def slot_specs(pdg: PDG, plan: StoragePlan, bindings: dict[str, int]) -> dict[int, SlotSpec]:
    """The feedback edges' stores, keyed by the input each one feeds."""
    out: dict[int, SlotSpec] = {}
    for sp in plan.stores:
        if not isinstance(sp.kind, SlotStore):
            continue
        (edge,) = (e for e in pdg.edges if e.kind == "feedback" and e.dst == sp.node)
        out[sp.node] = SlotSpec(node=sp.node, source=edge.src,
                                lag=int(sp.capacity_value(bindings) or 1), kind=sp.kind)
    return out


@dataclass(frozen=True)
class StepBuilder:
    """Pure functions (to be jitted) over a generation PDG and its stores.

    A step program is "evaluate the PDG against these stores": attention nodes read and write
    their :class:`StoreSpec` stores, the ``sample`` node selects the next token, and the feedback
    edge's :class:`SlotSpec` store carries that token to the next step's tokens input. The host
    passes no token back in: it only reads the sampled tokens out.
    """

    pdg: PDG
    specs: dict[int, StoreSpec]
    slots: dict[int, SlotSpec]
    consts: dict[int, tuple[Any, ...]]
    backend: str = "xla"
    mesh: Any = None  # a jax.sharding.Mesh: stores' rows stay split over its data axes
    # the position-wise nodes after the last attention (passes.positions): a prefill runs them
    # on the positions its sampler reads only; None: every position
    tail: PositionTail | None = None

    def store_sharding(self, stores: Any) -> Any:
        """Where stores of this row count live: rows split over the mesh's data axes, or
        replicated when those do not divide the row count (an uneven split is refused). Always
        one of the two, never XLA's choice: a compiled step program accepts only the shardings
        it was compiled for, and XLA's choice differs between programs (it once split a
        store's heads over ``model``), which made the next dispatch refuse its stores."""
        leaves = jax.tree_util.tree_leaves(stores)
        if self.mesh is None or not leaves:
            return None
        if leaves[0].shape[0] % data_size(self.mesh):
            return replicated(self.mesh)
        return rows_sharding(self.mesh)

    def rows(self, stores: Any) -> Any:
        """Inside a program: pin the stores to :meth:`store_sharding` (no-op without a mesh)."""
        sh = self.store_sharding(stores)
        return stores if sh is None else jax.lax.with_sharding_constraint(stores, sh)

    def place_stores(self, stores: Any) -> Any:
        """Outside a program: move stores made elsewhere (a grow, a prefill path that does not
        pin them) to :meth:`store_sharding`; arrays already there are not copied."""
        sh = self.store_sharding(stores)
        if sh is None or all(isinstance(x, jax.Array) and x.sharding.is_equivalent_to(sh, x.ndim)
                             for x in jax.tree_util.tree_leaves(stores)):
            return stores  # the common case, every dispatch: no device_put walk at all
        return jax.device_put(stores, sh)

    @property
    def boundary(self) -> tuple[int, ...]:
        """Static nodes read by per-step nodes: the hoisted values a step program takes."""
        static = static_nodes(self.pdg)
        return tuple(sorted({e.src for e in self.pdg.edges
                             if e.src in static and e.dst not in static and e.kind == "data"}))

    def static_values(self, hoisted: tuple[jax.Array, ...]) -> dict[int, tuple[jax.Array]]:
        """The hoisted boundary values by node id: what a step program's evaluation starts
        from (:func:`evaluate` with ``dynamic_only``)."""
        return {nid: (x,) for nid, x in zip(self.boundary, hoisted, strict=True)}

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
        vals = evaluate_nodes(self.pdg, vals, {}, {attention_p: _no_attention}, only=static)
        return tuple(vals[nid][0] for nid in self.computed_boundary())

    def assemble(self, leaves: list[jax.Array], hoisted: tuple[jax.Array, ...]):
        """The step programs' static inputs in boundary order: weights by reference."""
        by_id = dict(zip(self.weight_ids(), leaves, strict=True))
        by_id.update({nid: v[0] for nid, v in self.consts.items()})
        by_id.update(zip(self.computed_boundary(), hoisted, strict=True))
        return tuple(by_id[nid] for nid in self.boundary)

    def init_stores(self, batch: int, capacity: int) -> dict[str, dict[str, jax.Array]]:
        stores = {str(nid): spec.kind.init(spec, batch, spec.kind.capacity(spec, capacity))
                  for nid, spec in self.specs.items()}
        stores.update({str(nid): sp.kind.init(sp, batch, sp.lag) for nid, sp in self.slots.items()})
        return self.rows(stores)

    def prefill(self, hoisted, stores, tokens, positions, row_ids, seed, *, temperature: float,
                want_logits: bool, chunk: int):
        """The right-aligned prompt block, written from slot 0 in chunks of ``chunk`` slots.

        The first chunk (``P mod chunk`` slots, or ``chunk``) starts from empty stores; a scan
        feeds the rest through the stores as multi-slot steps, so only one chunk's
        ``[B, chunk, vocab]`` logits are alive (see :meth:`GenerationConfig.prefill_chunk`).
        The prompt is the tokens input here (the feedback edge is not read); token 0 is sampled
        from the last chunk's last slot and left in the slot store for decode step 1.
        """
        p = tokens.shape[1]
        first = p % chunk or chunk
        zero = jnp.zeros((), jnp.int32)
        kw = dict(temperature=temperature, want_logits=want_logits, step=zero)
        out = self._chunk(hoisted, stores, tokens[:, :first], positions[:, :first], zero, row_ids,
                          seed, fresh=True, **kw)
        if first == p:
            return out

        def fill(st, start):
            sl = lambda x: lax.dynamic_slice_in_dim(x, start, chunk, axis=1)
            st, tok, lp, lg = self._chunk(hoisted, st, sl(tokens), sl(positions), start, row_ids,
                                          seed, **kw)
            return st, (tok, lp, lg)

        stores, (toks, lps, lgs) = lax.scan(fill, out[0], jnp.arange(first, p, chunk,
                                                                      dtype=jnp.int32))
        return stores, toks[-1], lps[-1], lgs[-1]

    def decode(self, hoisted, stores, rows: DecodeRows, step, write_index, seed, *,
               temperature: float, want_logits: bool):
        """Decode step ``step`` (>= 1): its tokens input is the feedback edge, read from the slot
        store (the token step ``step-1`` sampled); returns (stores, tokens, log-probs, logits).

        ``rows.off``: the group step before each row's first decode step (0, but for a row a
        refill gave a sample mid-group), so a row samples its response token ``step - off``
        under that index's key whatever step of the group it runs at; ``rows.pos0`` is likewise
        its prompt length minus ``off``."""
        positions = (rows.pos0 + (step - 1))[:, None]
        return self._chunk(hoisted, stores, None, positions, write_index, rows.row_id, seed,
                           step=step, temperature=temperature, want_logits=want_logits,
                           off=rows.off)

    def decode_tile(self, hoisted, stores, rows: DecodeRows, step, write_index, seed, n, stop,
                    *, temperature: float, want_logits: bool, k: int, check: int = 1,
                    eos: tuple[int, ...] = ()):
        """Decode steps ``step ..`` in one program: whole checks of ``check`` steps, at most
        ``n`` steps (``n <= k``, a run-time argument; the host asks for whole checks).

        Why: a host-driven loop pays a dispatch and a device→host sync per token, which for
        small models or batches costs as much as the step itself. A tile pays them once; tokens
        a row samples after its EOS or limit inside a tile are discarded by the host, and
        sampling is keyed by (seed, step, row), so the tokens are the ones single steps would
        give. ``n`` being an argument lets the host size every tile
        (:class:`~jaxrl_sym.runtime.policy.Tiling`) with one compiled program.

        The steps run in inner loops of ``check`` steps with a static trip count; only between
        them does the program test its rows (an outer ``while_loop``; its body is not peeled
        for a test-free first check, which would compile the step twice). XLA:GPU runs a loop
        whose trip count it cannot prove by copying the loop test to the host every iteration
        (``xla/backends/gpu/runtime/while_thunk.cc``):
        a test per step was a host round-trip per generated token; per check it is one per
        ``check`` steps, and none inside (counted by ``python -m bench dispatch``). The outer
        loop ends once at most ``stop`` rows are live: ``rows.last[b]`` is the group step of
        row b's last allowed token (-1: a finished or filler row), ``eos`` the end tokens —
        with ``stop`` 0 a group's last tile ends at the check after its last row ends, and
        with the compaction's threshold the host compacts there. The host guarantees capacity
        for every write of a row within its limit. Returns (stores, tokens [k, B], log-probs
        [k, B], logits [k, …], steps run); entries past the steps run are zeros.
        """
        def one(st, i):
            return self.decode(hoisted, st, rows, step + i, write_index + i, seed,
                               temperature=temperature, want_logits=want_logits)

        shapes = jax.eval_shape(lambda: one(stores, jnp.zeros((), jnp.int32))[1:])
        bufs = tuple(jnp.zeros((k, *x.shape), x.dtype) for x in shapes)

        def steps(carry):  # one check: ``check`` steps, a static trip count (no loop test)
            def body(j, inner):
                st, ended, outs = inner
                i = carry[0] + j
                st, *got = one(st, i)
                outs = tuple(lax.dynamic_update_index_in_dim(b, x, i, 0)
                             for b, x in zip(outs, got, strict=True))
                hit = step + i >= rows.last
                for e in eos:
                    hit = hit | (got[0] == e)
                return st, ended | hit, outs

            return carry[0] + check, *lax.fori_loop(0, check, body, carry[1:])

        def cond(carry):
            i, _, ended, _ = carry
            return (i < n) & (jnp.sum(~ended) > stop)

        carry = (jnp.zeros((), jnp.int32), stores, rows.last < step, bufs)
        ran, stores, _, (toks, lps, lgs) = lax.while_loop(cond, steps, carry)
        return stores, toks, lps, lgs, ran

    def _chunk(
        self,
        hoisted: tuple[jax.Array, ...],
        stores: dict[str, dict[str, jax.Array]],
        tokens: jax.Array | None,
        positions: jax.Array,
        write_index: jax.Array,
        row_ids: jax.Array,
        seed: jax.Array,
        *,
        step: jax.Array,
        temperature: float,
        want_logits: bool,
        fresh: bool = False,
        off: jax.Array | None = None,
    ) -> tuple[Any, ...]:
        """One chunk of every row: evaluate the PDG against the stores, ``sample`` included.

        ``tokens`` (a prompt chunk) is the tokens input; ``None`` reads it from the feedback
        edge's slot store. ``step`` is the index of the token this chunk samples in each row's
        response (0 for prefill): the slot it writes and, less ``off`` per row (decode), the
        sampling key. A chunk samples only its last position — earlier positions' samples would
        be replaced by the prompt.
        """
        pdg = self.pdg
        if tokens is None:  # the feedback edge's slot store feeds the tokens input
            ((nid, sp),) = self.slots.items()
            tokens = sp.kind.read(sp, stores[str(nid)], step)
        new_stores: dict[str, dict[str, jax.Array]] = {}

        def attn(node: Any, args: list[jax.Array]) -> jax.Array:
            spec = self.specs[node.id]
            out, new = spec.kind.attend(spec, stores[str(node.id)], args, write_index,
                                        fresh=fresh)
            new_stores[str(node.id)] = new
            return out

        def sample(node: Any, args: list[jax.Array]) -> tuple[jax.Array, ...]:
            logits = args[0][:, -1].astype(jnp.float32)
            steps = jnp.full(logits.shape[:1], step, jnp.int32)
            if off is not None:
                steps = steps - off
            tok, lp = sample_tokens(logits, seed=seed, steps=steps, row_ids=row_ids,
                                    temperature=temperature)
            return tok, lp, logits

        b, t = positions.shape
        at = None
        if t > 1 and self.tail is not None:  # a prompt chunk: the sampler reads its last position
            at = (jnp.arange(b), jnp.full((b,), t - 1), self.tail)
        out = evaluate(pdg, self.static_values(hoisted), tokens, positions,
                             attention=attn, sample=sample, dynamic_only=True, at=at)
        for nid, sp in self.slots.items():
            new_stores[str(nid)] = sp.kind.write(sp, stores[str(nid)], out[sp.source][0], step)
        tok, lp, logits = out[pdg.outputs[1]]
        kept = logits if want_logits else jnp.zeros((0,), jnp.float32)
        return self.rows(new_stores), tok, lp, kept

    def compact(self, stores, rows, filler, pos0, row_ids):
        """Keep ``rows`` (finished rows dropped) of every store at once (a draft model's small
        stores); filler slots get dead (negative) positions."""
        return (self.rows({k: take_rows(s, rows) for k, s in stores.items()}),
                *self.compact_rows(rows, filler, pos0, row_ids))

    def compact_store(self, store, rows):
        """One store's ``rows`` kept: the runtime compacts store by store
        (``DecodeGroup.compact``: all old and new stores at once were the generation's peak)."""
        return self.rows(take_rows(store, rows))

    def compact_rows(self, rows, filler, pos0, row_ids):
        """The group's per-row arrays after a compaction to ``rows``; filler slots get dead
        (negative) positions."""
        pos0 = jnp.where(filler, DEAD_POSITION, jnp.take(pos0, rows, axis=0))
        return pos0, jnp.take(row_ids, rows, axis=0)

    def forward(self, leaves: list[jax.Array], tokens: jax.Array, positions: jax.Array,
                segment_ids: jax.Array, cu_seqlens: jax.Array | None = None) -> jax.Array:
        """Full-sequence forward (packed rows): logits [R, L, V]; differentiable in leaves.

        With the Triton backend and ``cu_seqlens`` (see ``PackedBatch.cu_seqlens``), softmax
        attention runs in the packed variable-length kernel (forward + backward kernels via
        custom_vjp) over the rows flattened end to end; otherwise the masked primitive.
        """
        r, length = tokens.shape

        def attn(node: Any, args: list[jax.Array]) -> jax.Array:
            pattern = node.params["pattern"]
            if self.backend == "triton" and cu_seqlens is not None and \
                    pattern.kernel_mask() is not None:
                q, k, v = args[:3]
                flat = lambda x: x.reshape(r * length, *x.shape[2:])
                out = triton_ops.packed_attention(flat(q), flat(k), flat(v), cu_seqlens,
                                                  pattern=pattern, scale=node.params["scale"],
                                                  softcap=node.params["softcap"])
                return out.reshape(r, length, *out.shape[1:])
            return bind(node, args)  # the primitive itself: masked, differentiable

        statics = {nid: (x,) for nid, x in zip(self.weight_ids(), leaves, strict=True)}
        out = evaluate(self.pdg, {**statics, **self.consts}, tokens, positions,
                             segment_ids, attention=attn)
        return out[self.pdg.outputs[0]][0]


DEAD_POSITION = -(1 << 30)  # position offset of filler rows: their positions stay negative (masked)


def _no_attention(node: Any, args: list[jax.Array]) -> jax.Array:  # pragma: no cover
    raise AssertionError("static region contains attention")


