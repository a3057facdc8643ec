"""The memory ledger of one generation request, from shapes and compiled programs — nothing runs.

Why: a generation's peak is a handful of buffers (weights, the stores or caches, one program's
XLA temporaries) and which one wins depends on the system, the lengths and the device; the
estimate (:mod:`jaxrl_sym.runtime.memory.estimate`) bounds them by rule of thumb, this follows the
dispatches. Both systems are walked the way they run:

* **sym** — the dispatch sequence is the runtime's own policy (:func:`~jaxrl_sym.runtime.policy.
  replay`, as ``SymBound.work`` replays it) over the plan's aligned microbatches. At every
  moment the live buffers are the weights and hoisted weight values, each store at the group's
  (rows, capacity) (``StepBuilder.init_stores`` evaluated abstractly), while a store grows its
  old copy beside the new one (one store per program, as ``DecodeGroup.grow``), while a group
  compacts its old stores beside the new ones, when a new group starts the previous group's
  stores, and the running program's XLA temporaries and fresh outputs. The programs are the
  engine's own (:func:`~jaxrl_sym.runtime.group.programs_by_shape.decode_program`,
  ``packed_prefill_program``, ``grow_program``, ``compact_program``), compiled — never run —
  at those shapes, once per distinct program (the engine's cache key).
* **padded** — its one program per call, in :mod:`jaxrl_sym.baselines.padded_ledger` (the
  baselines sit below the runtime).

Program costs come from XLA's ``cost_analysis``, which counts a loop body once: a decode tile's
cost is one step's (the ledger multiplies by the steps each dispatch ran); padded's program is
also compiled without its decode loop (one new token, the same MAX_LEN), and the difference is
one decode step's cost. The roofline over these (device constants) is the bench's
(``python -m bench project --workload decode``).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from jaxrl_sym.generation import GenerationConfig, row_limits
from jaxrl_sym.runtime.group.programs_by_shape import (
    compact_store_program,
    decode_program,
    grow_program,
    packed_prefill_program,
    prompt_cache_program,
    refill_program,
)
from jaxrl_sym.runtime.memory.ledger import Buffer, Ledger, Moment, ProgramSize, moment, tree_nbytes
from jaxrl_sym.runtime.packing import PackedPrompts
from jaxrl_sym.runtime.plan import GenerationPlan
from jaxrl_sym.runtime.policy import Dispatch, replay
from jaxrl_sym.runtime.programs import Build
from jaxrl_sym.runtime.prompt_cache import CacheChunk, cache_budget, plan_chunks
from jaxrl_sym.runtime.refill import refill_shape

__all__ = ["WEIGHTS", "GenerationLedger", "ProgramRun", "decode_floor", "sym_ledger"]

WEIGHTS = "weights"
"""The name of a generation ledger's buffer of the weights it was given (the caller's arrays)."""

Sizes = dict[tuple, ProgramSize]
"""Compiled programs' sizes by the engine's cache key: pass one dict to several ledgers of the
same model (other lengths) and each distinct program compiles once."""


@dataclass(frozen=True)
class ProgramRun:
    """A program as the generation runs it: ``calls`` dispatches running ``steps`` loop
    iterations in all (a decode tile's steps; 1 per call for a loop-free program), each costing
    ``size``'s flops and bytes (per iteration). ``stage``: prefill, decode, grow or compact."""

    stage: str
    what: str
    size: ProgramSize
    calls: int
    steps: int


@dataclass(frozen=True)
class GenerationLedger:
    """A generation's ledger, the programs it runs, and how many distinct ones it compiled."""

    ledger: Ledger
    runs: tuple[ProgramRun, ...]
    compiled: int
    dispatches: int
    finished: tuple[int, ...] = ()  # rows finished before each moment (empty: none)

    def beyond_weights(self) -> list[tuple[Moment, int]]:
        """Each moment without the weights it was given, with the rows finished before it:
        what generation adds to a caller that holds those weights itself (an RL step lists them
        as its state, and scores finished rows while the others decode)."""
        fin = self.finished or (0,) * len(self.ledger.moments)
        return [(dataclasses.replace(m, buffers=tuple(b for b in m.buffers
                                                      if b.name != WEIGHTS)), f)
                for m, f in zip(self.ledger.moments, fin, strict=True)]

    def to_dict(self) -> dict[str, Any]:
        return {**self.ledger.to_dict(), "compiled": self.compiled,
                "dispatches": self.dispatches,
                "runs": [{"stage": r.stage, "what": r.what, "calls": r.calls, "steps": r.steps,
                          **dataclasses.asdict(r.size)} for r in self.runs]}


class _Programs:
    """Compile-once sizes by cache key, and how often each ran."""

    def __init__(self, sizes: Sizes | None, compiler: Callable[[Build], Any] | None = None
                 ) -> None:
        self.sizes = sizes if sizes is not None else {}
        self.compile = compiler or (lambda build: build())
        self.runs: dict[tuple, list[int]] = {}  # key -> [calls, steps]
        self.stages: dict[tuple, str] = {}

    def size(self, key: tuple, stage: str, name: str, build: Build) -> ProgramSize:
        if key not in self.sizes:
            self.sizes[key] = ProgramSize.of(name, self.compile(build))
        self.stages.setdefault(key, stage)
        return self.sizes[key]

    def ran(self, key: tuple, steps: int = 1) -> None:
        calls, total = self.runs.get(key, [0, 0])
        self.runs[key] = [calls + 1, total + steps]

    def done(self) -> tuple[ProgramRun, ...]:
        return tuple(ProgramRun(self.stages[k], self.sizes[k].name, self.sizes[k], c, s)
                     for k, (c, s) in self.runs.items())


# ------------------------------------------------------------------------------------ sym


def sym_ledger(plan: GenerationPlan, leaves: Sequence[Any], prompts: Sequence[np.ndarray],
               cfg: GenerationConfig, *, sizes: Sizes | None = None,
               compiler: Callable[[Build], Any] | None = None) -> GenerationLedger:
    """The ledger of ``plan`` generating for ``prompts`` with ``cfg`` (every row to its limit),
    its weights ``leaves`` arrays or ShapeDtypeStructs. ``sizes``: compiled sizes to reuse.
    ``compiler(build) -> Compiled``: how each program compiles (None: here; the bench compiles
    for a GPU it does not have, ``bench/lib/projection/xla_gpu.py``)."""
    lens = [len(p) for p in prompts]
    limits = [int(x) for x in row_limits(cfg, len(prompts))]
    hoisted = jax.eval_shape(plan.builder.hoist, list(leaves))
    held = [Buffer(WEIGHTS, "weights", tree_nbytes(list(leaves))),
            Buffer("hoisted weight values", "weights", tree_nbytes(hoisted))]
    args = plan.builder.assemble(list(leaves), hoisted)
    opts, progs = plan.options, _Programs(sizes, compiler)
    if opts.refill and opts.microbatch_rows is not None and len(prompts) > opts.microbatch_rows:
        return _refill_ledger(plan, cfg, args, held, progs, list(prompts), limits)
    # as DecodeGroup sizes its tiles
    plans = replay(lens, limits, min_capacity=opts.min_capacity, tiling=plan.group_tiling(cfg),
                   need=plan.growing_need, max_pad_fraction=opts.max_pad_fraction,
                   microbatch_rows=opts.microbatch_rows, compaction=plan.compaction)
    moments: list[Moment] = []
    finished: list[int] = []  # rows finished before each moment
    before: list[Buffer] = []  # the previous group's stores, alive while the next one starts
    dispatches, done, rows_done = 0, 0, 0  # tokens emitted and rows ended by the groups before
    for group, (shape, ds) in zip(plan.microbatches(lens, limits), plans, strict=True):
        ends = [limits[i] for i in group]
        walk = _SymGroup(plan, cfg, args, held, progs, shape.rows, shape.capacity)
        moments.append(_with_host(moment("init", f"stores {shape.rows}x{shape.capacity}", held,
                                         before, walk.buffers()), done))
        slots = [prompts[i] for i in group] + [None] * (shape.rows - len(group))
        moments.append(_with_host(walk.prefill(slots, shape.prompt_slots), done))
        finished += [rows_done, rows_done]
        for d in ds:  # before decode step d.step, each row has emitted min(limit, d.step)
            emitted = done + sum(min(n, d.step) for n in ends)
            ms = walk.dispatch(d)
            moments += [_with_host(m, emitted) for m in ms]
            finished += [rows_done + sum(n <= d.step for n in ends)] * len(ms)
        dispatches += 1 + len(ds) + walk.extra
        before, done, rows_done = walk.buffers(), done + sum(ends), rows_done + len(group)
    return GenerationLedger(Ledger("sym", tuple(moments)), progs.done(), len(progs.runs),
                            dispatches, tuple(finished))


def _refill_ledger(plan: GenerationPlan, cfg: GenerationConfig, hoisted: tuple[Any, ...],
                   held: list[Buffer], progs: _Programs, prompts: list[np.ndarray],
                   limits: list[int]) -> GenerationLedger:
    """With refill, one resident group of ``microbatch_rows`` rows runs every sample (the
    engine's ``_run_groups``): its stores are rings that never grow, so its moments are few and
    alike — each distinct shape of prompt-cache chunk with a fill of every row from it (the
    largest chunk last, so it is held for what follows), a decode tile, and a refill of every
    row again (:mod:`~jaxrl_sym.runtime.prompt_cache`). Walked as those representative moments
    (not every wave). Rows end throughout, so every moment after the first fill counts as
    having rows finished (``finished``: all)."""
    rows = plan.options.microbatch_rows
    shape = refill_shape([len(p) for p in prompts], limits, rows, plan.row_multiple,
                         plan.options.max_len)
    walk = _SymGroup(plan, cfg, hoisted, held, progs, shape.rows, shape.capacity)
    budget = cache_budget(shape.prompt_slots, shape.rows, shape.capacity)
    chunks = plan_chunks(list(range(len(prompts))), prompts, budget, vocab=plan.vocab_size,
                         logits_bytes=cfg.prefill_logits_bytes)
    by_shape = {(*c.packed.tokens.shape, len(c.lens)): c for c in chunks}
    moments = [moment("init", f"stores {shape.rows}x{shape.capacity}", held, walk.buffers())]
    for c in sorted(by_shape.values(), key=lambda c: c.packed.tokens.size):  # largest last
        moments += [walk.cache(c), walk.refill(shape.prompt_slots)]
    moments += walk.dispatch(Dispatch(1, plan.tiling.whole(plan.tiling.base), shape.prompt_slots,
                                      shape.rows, shape.capacity))
    moments.append(walk.refill(shape.prompt_slots))
    done = len(prompts)
    return GenerationLedger(Ledger("sym", tuple(moments)), progs.done(), len(progs.runs),
                            len(moments), (0, 0, 0, *[done] * (len(moments) - 3)))


def _with_host(m: Moment, tokens: int) -> Moment:
    return dataclasses.replace(m, buffers=(*m.buffers, _host_outputs(tokens)))


def _host_outputs(tokens: int) -> Buffer:
    """The emitted tokens and log-probs the host loop keeps in Python lists (an int and a
    float object plus a list slot each; at most: ids below 257 are shared objects)."""
    per = sys.getsizeof(1 << 20) + sys.getsizeof(0.5) + 2 * 8
    return Buffer("host: emitted tokens and log-probs", "host", tokens * per)


class _SymGroup:
    """One aligned microbatch's stores, walked through its dispatches (DecodeGroup's order)."""

    def __init__(self, plan: GenerationPlan, cfg: GenerationConfig, hoisted: tuple[Any, ...],
                 held: list[Buffer], progs: _Programs, rows: int, capacity: int) -> None:
        self.plan, self.cfg, self.hoisted, self.held, self.progs = plan, cfg, hoisted, held, progs
        self.rows, self.capacity, self.extra = rows, capacity, 0
        self.stores = jax.eval_shape(lambda: plan.builder.init_stores(rows, capacity))
        self.cached: Any = None  # the prompt cache's arrays (refill), held beside the stores

    def buffers(self, stores: dict[str, Any] | None = None) -> list[Buffer]:
        """Each store (by attention node and kind) as one buffer."""
        out = []
        for name, st in (stores or self.stores).items():
            spec = self.plan.specs.get(int(name))
            kind = spec.kind.name if spec is not None else "slot"
            slots = st["pos"].shape[1] if "pos" in st else 0
            rows = jax.tree_util.tree_leaves(st)[0].shape[0]  # mid-compaction: its own
            what = f"{kind} {rows}x{slots}" if slots else f"{kind} {rows} rows"
            out.append(Buffer(f"store {name} ({what})", "store", tree_nbytes(st)))
        if self.cached is not None:
            out.append(Buffer("prompt cache (keys, values, last logits)", "store",
                              tree_nbytes(self.cached)))
        return out

    def prefill(self, prompts: list[np.ndarray | None], pcap: int) -> Moment:
        """The packed prefill (the engine's default; ``prefill='block'`` is not walked)."""
        if self.plan.options.prefill != "packed":
            raise NotImplementedError("the generation ledger walks the packed prefill only")
        pk = PackedPrompts.build(prompts, pcap, vocab=self.plan.vocab_size,
                                 logits_bytes=self.cfg.prefill_logits_bytes)
        return self._packed("prefill", "packed_prefill", packed_prefill_program, pk, ())

    def cache(self, chunk: CacheChunk) -> Moment:
        """A prompt-cache chunk (``DecodeGroup.load_cache``): its distinct prompts packed
        through the model, their keys, values and last logits kept beside the stores."""
        pk = chunk.packed
        self.cached = None  # the engine drops the previous chunk's entries first
        arrays = (pk.tokens, pk.positions, pk.rows, pk.last)
        key, build = prompt_cache_program(self.plan, pk, (self.hoisted, *arrays))
        size = self.progs.size(key, "prefill", f"prompt_cache[{pk.tokens.shape[0]}x"
                                    f"{pk.tokens.shape[1]}]", build)
        self.progs.ran(key, pk.tokens.shape[0] // pk.chunk_rows)
        batch = Buffer("prefill: packed prompt arrays", "batch", tree_nbytes(arrays))
        out = moment("prefill", size.name, self.held, self.buffers(), [batch], size.buffers())
        self.cached = jax.eval_shape(build.fn, *build.args)
        return out

    def refill(self, pcap: int) -> Moment:
        """A refill of every row from the prompt cache (``DecodeGroup.fill_rows``) into the
        group's prompt block of ``pcap`` slots (where it ends is a run-time argument)."""
        i32 = lambda *shape: jax.ShapeDtypeStruct(shape, np.int32)
        b = self.rows
        args = (self.stores, *self.cached, i32(b), i32(b), i32(b),
                jax.ShapeDtypeStruct((b,), np.bool_), i32(), i32(), i32(b),
                jax.ShapeDtypeStruct((), np.uint32))
        key, build = refill_program(self.plan, self.cfg, pcap, args)
        size = self.progs.size(key, "prefill", f"refill[{b}x{self.capacity}]", build)
        self.progs.ran(key)
        return moment("refill", size.name, self.held, self.buffers(), size.buffers())

    def _packed(self, stage: str, name: str, program: Callable[..., tuple[tuple, Build]],
                pk: PackedPrompts, extra: tuple[Any, ...]) -> Moment:
        """A packed-prompt program over the group's stores (prefill or refill: their arguments
        are the packed arrays, row ids, seed, then ``extra``); its scan runs one chunk of
        packed rows per iteration."""
        arrays = (pk.tokens, pk.positions, pk.rows, pk.slots, pk.last, pk.copies)
        args = (self.hoisted, self.stores, *arrays, jax.ShapeDtypeStruct((self.rows,), np.int32),
                jax.ShapeDtypeStruct((), np.uint32), *extra)
        key, build = program(self.plan, self.cfg, pk, args)
        size = self.progs.size(key, "prefill", f"{name}[{pk.tokens.shape[0]}x"
                                    f"{pk.tokens.shape[1]}]", build)
        self.progs.ran(key, pk.tokens.shape[0] // pk.chunk_rows)
        batch = Buffer(f"{stage}: packed prompt arrays", "batch", tree_nbytes(arrays))
        return moment(stage, size.name, self.held, self.buffers(), [batch], size.buffers())

    def dispatch(self, d: Dispatch) -> list[Moment]:
        """A decode dispatch: its compaction and growth first, then its program."""
        out = []
        if d.rows < self.rows:
            out += self._compact(d.rows)
        if d.capacity > self.capacity:
            out += self._grow(d.capacity)
        key, build = decode_program(self.plan, self.cfg, self.hoisted, self.rows, self.capacity)
        size = self.progs.size(key, "decode", f"{key[0]}[{self.rows}x{self.capacity}]", build)
        self.progs.ran(key, d.tile)
        out.append(moment("decode", size.name, self.held, self.buffers(), size.buffers()))
        return out

    def _compact(self, new_rows: int) -> list[Moment]:
        """One store per program (as ``DecodeGroup.compact``): the old rows of the store being
        compacted beside its new ones (the per-row arrays and a lag-1 feedback edge's tokens
        come from the host)."""
        i32 = lambda n: jax.ShapeDtypeStruct((n,), np.int32)
        kept, out = i32(new_rows), []
        for name in list(self.stores):
            sp = self.plan.builder.slots.get(int(name))
            if sp is not None and sp.lag == 1:  # from the host's tokens (DecodeGroup)
                self.stores = {**self.stores, name: {"tok": jax.ShapeDtypeStruct(
                    (new_rows, 1), np.int32)}}
                continue
            key, build = compact_store_program(self.plan, self.stores[name], kept)
            size = self.progs.size(key, "compact", f"compact[{self.rows}->{new_rows}]", build)
            self.progs.ran(key)
            self.extra += 1
            out.append(moment("compact", f"{size.name} store {name}", self.held, self.buffers(),
                              size.buffers()))
            new = jax.eval_shape(self.plan.builder.compact_store, self.stores[name], kept)
            self.stores = {**self.stores, name: new}
        self.rows = new_rows
        return out

    def _grow(self, capacity: int) -> list[Moment]:
        """One store per program: the old copy of the store growing beside the new one."""
        out = []
        for g in self.plan.growing:
            key, build = grow_program(self.plan, g, self.stores[g], self.rows, capacity)
            size = self.progs.size(key, "grow", f"grow[{self.rows}x{capacity}]", build)
            self.progs.ran(key)
            self.extra += 1
            out.append(moment("grow", f"{size.name} store {g}", self.held, self.buffers(),
                              size.buffers()))
            grow = self.plan.specs[int(g)].kind.grow
            new = jax.eval_shape(lambda s, f=grow: f(s, capacity), self.stores[g])
            self.stores = {**self.stores, g: new}
        self.capacity = capacity
        return out


# ------------------------------------------------------------------------------------ floor


def decode_floor(plan: GenerationPlan, weights_bytes: int, prompt_lens: Sequence[int],
                 limits: Sequence[int]) -> dict[str, int]:
    """What the decode steps must read at least, whatever the system: the weights once per step
    (rows decode in lockstep until the longest ends) and, per live row and step, the keys its
    pattern needs (the plan's stores: a growing store every key so far, a ring or block store
    at most its slots — exact for windows, an upper bound inside a block) or a linear state.
    Decode step ``s`` (1-based, after the prefill's token 0) of a row with prompt ``p`` reads
    ``p + s`` keys where nothing caps them."""
    p = np.asarray(prompt_lens, np.int64)[:, None]
    n = np.asarray(limits, np.int64)[:, None]
    steps = int(n.max()) - 1
    s = np.arange(1, steps + 1, dtype=np.int64)[None, :]
    live = s < n  # row decodes step s
    kv = 0
    for spec in plan.specs.values():
        per_key = spec.hkv * (spec.d + spec.dv) * np.dtype(spec.dtype).itemsize
        if not spec.kind.keeps_keys:  # a recurrent state, read whole every step
            kv += int(live.sum()) * spec.hkv * spec.d * (spec.dv + 1) * 4
            continue
        keys = p + s if spec.capacity is None else np.minimum(p + s, spec.capacity)
        kv += int((keys * live).sum()) * per_key
    return {"steps": steps, "weights_bytes": steps * int(weights_bytes), "kv_bytes": kv}
