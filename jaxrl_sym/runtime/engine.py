"""SymbolicLM: a Flax LM traced once into a PDG, planned, and run on exact-size buffers.

Data flow: tracer (PDG) → passes (generation loop, storage plan) → programs (jitted per shape
bucket) → this host loop. The host loop is plain integer code: it decides when a growing store
doubles, when finished rows are compacted away, which slot the next step writes; sympy is never
touched here (the live-slot counts come from functions compiled once by the planner).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from flax import nnx

from jaxrl_sym.errors import InputError
from jaxrl_sym.generation import (
    GenerationConfig,
    GenerationResult,
    row_limits,
    validate_prompts,
)
from jaxrl_sym.models.contract import check_model
from jaxrl_sym.passes.generation import add_generation_loop
from jaxrl_sym.passes.storage import StoragePlan, live_count_fn, plan_storage
from jaxrl_sym.runtime.evaluate import constant_values
from jaxrl_sym.runtime.metrics import CompileCounter, MemoryMeter, device_peak_bytes, tree_bytes
from jaxrl_sym.runtime.programs import DEAD_POSITION, ProgramCache, StepBuilder, store_specs
from jaxrl_sym.runtime.stores import grow_store
from jaxrl_sym.tracer.trace import trace_model


def resolve_backend(backend: str) -> str:
    """``xla`` everywhere; ``triton`` = jax-triton on a GPU, Triton's interpreter on CPU (slow,
    for checking); ``auto`` = triton where it runs compiled (a GPU with jax-triton), else xla."""
    from jaxrl_sym.backends.launch import backend_name

    if backend == "auto":
        return "triton" if backend_name() == "gpu" else "xla"
    if backend == "xla":
        return backend
    if backend == "triton":
        if backend_name() is None:
            raise InputError(
                "backend='triton' needs triton (pip install -e '.[interp]' on CPU, '.[gpu]' with "
                "jax-triton on a GPU); use backend='xla' otherwise"
            )
        return backend
    raise InputError(f"backend={backend!r}: choose 'xla', 'triton' or 'auto'")


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def length_bucket(n: int, *, per_octave: int = 4, minimum: int = 8) -> int:
    """Round up to a geometric grid with ``per_octave`` steps (≤ 1/per_octave waste)."""
    if n <= minimum:
        return minimum
    top = next_pow2(n)
    step = max(1, top // (2 * per_octave))
    return -(-n // step) * step


def microbatches(
    lengths: Sequence[int], limits: Sequence[int], *, max_rows: int | None,
    max_pad_fraction: float,
) -> list[list[int]]:
    """Aligned microbatches (paper §4.2): rows sorted by prompt length, right-aligned so that all
    rows of a group decode at the same step. A row joins the current group while the group's
    prompt padding stays within ``max_pad_fraction`` of the group's work (prompt + response
    tokens) and the group has room; otherwise a new group starts. Weighing padding against the
    whole row matters: 16 tokens of prompt padding are noise next to 1024 generated tokens, and a
    needless split costs a second set of compiled programs and halves the batch."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    groups: list[list[int]] = []
    for i in order:
        g = groups[-1] if groups else None
        if g is not None and (max_rows is None or len(g) < max_rows):
            members = [*g, i]
            top = max(lengths[j] for j in members)
            pad = sum(top - lengths[j] for j in members)
            work = sum(top + int(limits[j]) for j in members)
            if pad <= max_pad_fraction * work:
                g.append(i)
                continue
        groups.append([i])
    return groups


@dataclass
class _Rows:
    """Host-side bookkeeping of one microbatch (plain ints and numpy)."""

    ids: np.ndarray  # request row index per batch slot (-1 = filler)
    limits: np.ndarray  # per slot
    done: np.ndarray  # per slot


class SymbolicLM:
    """Generation and packed scoring for a Flax NNX LM without padding to a maximum length.

    Args:
      model: an NNX module called as ``model(tokens, positions, segment_ids) -> logits``.
      min_capacity: initial slots of a growing store (it then doubles).
      max_len: optional user cap; with it, full-attention stores are allocated at that size.
      microbatch_rows / max_pad_fraction: aligned-microbatch policy (see :func:`microbatches`).
      backend: ``xla``, ``triton`` (Triton kernels for decode steps; interpreted on CPU) or
        ``auto``.
      decode_tile: decode steps per dispatch (one device→host sync per tile; rows that end
        inside a tile waste at most ``decode_tile - 1`` steps). 1: a dispatch per token.
    """

    def __init__(
        self,
        model: nnx.Module,
        *,
        min_capacity: int = 128,
        max_len: int | None = None,
        microbatch_rows: int | None = None,
        max_pad_fraction: float = 0.1,
        backend: str = "xla",
        decode_tile: int = 8,
    ) -> None:
        if decode_tile < 1:
            raise InputError(f"decode_tile={decode_tile} must be >= 1 (1: one dispatch per token)")
        self.decode_tile = int(decode_tile)
        self.backend = resolve_backend(backend)
        check_model(model)  # the contract, stated, before any symbolic-shape tracing
        self.program, self.graphdef, state = trace_model(model)
        self.vocab_size = int(self.program.pdg.node(self.program.pdg.outputs[0]).shape[-1])
        self.pdg = add_generation_loop(self.program.pdg)
        self.plan: StoragePlan = plan_storage(self.pdg, max_len=max_len)
        self.bindings = self.program.binding_dict
        self.specs = store_specs(self.pdg, self.plan, self.bindings, self.backend)
        self.builder = StepBuilder(self.pdg, self.specs, constant_values(self.program.consts),
                                   self.backend)
        self.leaves = jax.tree_util.tree_leaves(state)
        self.min_capacity = min_capacity
        self.max_len = max_len
        self.microbatch_rows = microbatch_rows
        self.max_pad_fraction = max_pad_fraction
        self.cache = ProgramCache()
        self._live_fns = {str(s.node): live_count_fn(self.pdg.symbols, s, self.bindings)
                          for s in self.plan.stores if s.kind != "slot"}
        self._growing = tuple(str(n) for n, s in self.specs.items() if s.kind == "growing")
        self._hoisted: tuple[jax.Array, ...] | None = None
        self._hoisted_bytes = 0

    # ------------------------------------------------------------------ parameters
    def set_params(self, state: Any) -> None:
        """Swap in new parameters (same structure); hoisted values are recomputed lazily."""
        self.leaves = jax.tree_util.tree_leaves(state)
        self._hoisted = None

    def _hoist(self) -> tuple[jax.Array, ...]:
        if self._hoisted is None:
            key = ("hoist",)
            build = lambda: jax.jit(self.builder.hoist).lower(self.leaves).compile()
            computed = self.cache.run(key, build, self.leaves)
            self._hoisted_bytes = tree_bytes(computed)
            self._hoisted = self.builder.assemble(self.leaves, computed)
        return self._hoisted

    # ------------------------------------------------------------------ generation
    def generate(self, prompts: Sequence[Any], cfg: GenerationConfig, *,
                 on_finished: Callable[[list[int], list[np.ndarray]], None] | None = None,
                 ) -> GenerationResult:
        """Generate for every prompt until EOS or its limit.

        on_finished: called from the host loop as ``on_finished(ids, responses)`` with the
          indices of rows that just finished and their final response tokens, while other rows
          still decode. The RL step uses it to queue reference scoring of finished rows behind the
          decode steps, so that work fills the device while the long tail generates instead of
          running as a separate pass afterwards.
        """
        prompts = validate_prompts(prompts, self.vocab_size, cfg)
        limits = row_limits(cfg, len(prompts))
        lengths = [len(p) for p in prompts]
        meter = MemoryMeter()
        toks: list[list[int]] = [[] for _ in prompts]
        lps: list[list[float]] = [[] for _ in prompts]
        logits: list[list[np.ndarray]] | None = [[] for _ in prompts] if cfg.return_logits else None
        compiles0, disp0 = self.cache.compiles, self.cache.dispatches
        t0 = time.perf_counter()
        with CompileCounter() as cc:
            hoisted = self._hoist()
            weights_bytes = tree_bytes(self.leaves) + self._hoisted_bytes
            for group in microbatches(lengths, limits, max_rows=self.microbatch_rows,
                                      max_pad_fraction=self.max_pad_fraction):
                self._run_group(group, prompts, limits, cfg, hoisted, weights_bytes, meter,
                                toks, lps, logits, on_finished)
        elapsed = time.perf_counter() - t0
        dev_peak = device_peak_bytes()
        stats = {
            "xla_compiles": cc.count,
            "program_compiles": self.cache.compiles - compiles0,
            "compile_seconds": cc.seconds,
            "dispatches": self.cache.dispatches - disp0,
            "peak_bytes": dev_peak if dev_peak is not None else meter.peak,
            "accounted_peak_bytes": meter.peak,
            "run_seconds": elapsed,
            "generated_tokens": int(sum(len(t) for t in toks)),
        }
        return GenerationResult(
            tokens=[np.asarray(t, np.int32) for t in toks],
            logprobs=[np.asarray(lp, np.float32) for lp in lps],
            logits=None if logits is None else [
                np.stack(x) if x else np.zeros((0, self.vocab_size), np.float32) for x in logits],
            stats=stats,
        )

    def _run(self, name: str, cfg: GenerationConfig, *args: Any, **static: int
             ) -> tuple[Any, tuple]:
        """Run the prefill/decode(-tile) program for these shapes, compiling it on first use."""
        stores = args[1]
        caps = tuple(sorted((k, s["pos"].shape[1]) for k, s in stores.items() if "pos" in s))
        shape = args[2].shape
        key = (name, shape, caps, cfg.temperature, cfg.return_logits, *sorted(static.items()))
        fn = getattr(self.builder, name)

        def build() -> Any:
            jitted = jax.jit(fn, static_argnames=("temperature", "want_logits", *static),
                             donate_argnums=(1,))
            return jitted.lower(*args, temperature=cfg.temperature,
                                want_logits=cfg.return_logits, **static).compile()

        exe = self.cache.get(key, build)
        self.cache.dispatches += 1
        return exe(*args), key

    def _grow(self, stores: dict[str, Any], bcap: int, capacity: int, meter: Any,
              weights_bytes: int, step: int) -> None:
        """Grow the growing stores to ``capacity`` in place, one store per program.

        Why one at a time: a padded copy cannot alias its input, so growing every layer in one
        program keeps all old and all new buffers live together. On an H100 (GPT-2-small shape,
        batch 64, 4096 tokens) that made sym's peak 39.7 GB for a 19.4 GB final store, above
        padded's 22.7 GB. Here each store is replaced in the caller's dict as soon as its copy
        exists, so its old buffers are freed before the next store grows: the excess is one store.
        Stores of equal shape share one compiled program.
        """
        for g in self._growing:
            old_bytes = tree_bytes(stores[g])
            key = ("grow", bcap, capacity,
                   tuple((n, a.shape, str(a.dtype)) for n, a in sorted(stores[g].items())))
            stores[g] = self.cache.run(key, lambda o=stores[g]: jax.jit(
                grow_store, static_argnums=1).lower(o, capacity).compile(), stores[g])
            meter.observe(weights_bytes + tree_bytes(stores) + old_bytes,
                          self.cache.temp_bytes[key], step=step)

    def _run_group(self, group, prompts, limits, cfg, hoisted, weights_bytes, meter, toks, lps,
                   logits, on_finished=None) -> None:
        n = len(group)
        bcap = next_pow2(n)
        plen = max(len(prompts[i]) for i in group)
        pcap = length_bucket(plen)
        horizon = int(max(limits[i] for i in group))
        total = pcap + horizon  # slots this group can ever need
        cap = min(max(self.min_capacity, next_pow2(pcap + 1)), total)
        if self.max_len is not None:
            cap = self.max_len + (pcap - plen)
        # Right-aligned prompt block (left padding within the microbatch only).
        tok_in = np.zeros((bcap, pcap), np.int32)
        pos_in = np.full((bcap, pcap), -1, np.int32)
        pos0 = np.full((bcap,), DEAD_POSITION, np.int32)
        ids = np.full((bcap,), -1, np.int64)
        lim = np.zeros((bcap,), np.int64)
        for slot, i in enumerate(group):
            p = prompts[i]
            tok_in[slot, pcap - len(p):] = p
            pos_in[slot, pcap - len(p):] = np.arange(len(p))
            pos0[slot] = len(p)
            ids[slot] = i
            lim[slot] = limits[i]
        rows = _Rows(ids=ids, limits=lim, done=ids < 0)
        seed = jax.device_put(np.uint32(cfg.seed))
        row_ids = jax.device_put(np.maximum(ids, 0).astype(np.int32))
        key_init = ("init", bcap, cap)
        stores = self.cache.run(key_init, lambda: jax.jit(
            self.builder.init_stores, static_argnums=(0, 1)).lower(bcap, cap).compile())
        pos0_d = jax.device_put(pos0)
        # ---- prefill: the prompt block in chunks whose logits fit cfg.prefill_logits_bytes
        (stores, tok, lp, lg), key = self._run(
            "prefill", cfg, hoisted, stores, jax.device_put(tok_in), jax.device_put(pos_in),
            row_ids, seed, chunk=cfg.prefill_chunk(bcap, pcap, self.vocab_size))
        store_bytes = tree_bytes(stores)
        meter.observe(weights_bytes + store_bytes, self.cache.temp_bytes[key], step=0)
        # Outputs of the last dispatch: device arrays with a leading step axis when tiled.
        out_tok, out_lp, out_lg, tiled = tok, lp, lg, False
        last_tok = tok  # token fed back into the next step
        step = 0  # decode steps dispatched so far (prefill produced token 0)
        while True:
            # host copies with a leading step axis (one entry unless the dispatch was a tile)
            tok_h, lp_h, lg_h = (None if x is None else np.asarray(x) if tiled
                                 else np.asarray(x)[None]
                                 for x in (out_tok, out_lp, out_lg if cfg.return_logits
                                           else None))
            finished: list[int] = []
            for j in range(tok_h.shape[0]):
                for slot in np.nonzero(~rows.done)[0]:
                    i = int(rows.ids[slot])
                    toks[i].append(int(tok_h[j, slot]))
                    lps[i].append(float(lp_h[j, slot]))
                    if logits is not None:
                        logits[i].append(lg_h[j, slot])
                    if (cfg.eos_id is not None and tok_h[j, slot] == cfg.eos_id) or \
                            len(toks[i]) >= rows.limits[slot]:
                        rows.done[slot] = True
                        finished.append(i)
            if finished and on_finished is not None:
                on_finished(finished, [np.asarray(toks[i], np.int32) for i in finished])
            if rows.done.all():
                break
            live = np.nonzero(~rows.done)[0]
            # Tile only while every step of the tile is within some live row's limit, so no
            # write lands past the slots the group can ever need.
            remaining = max(int(rows.limits[s]) - len(toks[int(rows.ids[s])]) for s in live)
            k = self.decode_tile if remaining >= self.decode_tile > 1 else 1
            step += 1
            write = pcap + step - 1  # slot of the token being fed back
            # ---- compaction: drop finished rows once at most half the bucket is live
            if bcap > 1 and len(live) <= bcap // 2:
                new_b = next_pow2(len(live))
                keep = np.concatenate([live, np.repeat(live[:1], new_b - len(live))])
                key_c = ("compact", bcap, new_b, tuple(sorted(
                    (k_, s["pos"].shape[1]) for k_, s in stores.items() if "pos" in s)))
                filler = np.arange(new_b) >= len(live)
                cargs = (stores, jax.device_put(keep.astype(np.int32)), jax.device_put(filler),
                         last_tok, pos0_d, row_ids)
                stores, last_tok, pos0_d, row_ids = self.cache.run(
                    key_c, lambda a=cargs: jax.jit(self.builder.compact)
                    .lower(*a).compile(), *cargs)
                del cargs  # holds the pre-compaction stores: free them now, not at the next one
                rows = _Rows(ids=np.where(filler, -1, rows.ids[keep]),
                             limits=rows.limits[keep], done=filler.copy())
                bcap = new_b
                store_bytes = tree_bytes(stores)
            # ---- growth: a growing store doubles when the tile's last write would not fit
            need = max((self._live_fns[g](write + k - 1)[0] for g in self._growing), default=0)
            cur = min((s["pos"].shape[1] for g, s in stores.items() if g in self._growing),
                      default=need)
            if need > cur:
                self._grow(stores, bcap, min(max(2 * cur, need), total), meter,
                           weights_bytes, step)
                store_bytes = tree_bytes(stores)
            args = (hoisted, stores, last_tok, pos0_d, np.int32(step), np.int32(write), row_ids,
                    seed)
            if k == 1:
                (stores, out_tok, out_lp, out_lg), key = self._run("decode", cfg, *args)
                last_tok, tiled = out_tok, False
            else:
                (stores, last_tok, out_tok, out_lp, out_lg), key = self._run(
                    "decode_tile", cfg, *args, k=k)
                tiled = True
            step += k - 1
            meter.observe(weights_bytes + store_bytes, self.cache.temp_bytes[key], step=step)

    # ------------------------------------------------------------------ packed forward
    def pack(self, sequences: Sequence[np.ndarray]) -> PackedBatch:
        return PackedBatch.build(sequences)

    def forward_fn(self):
        """``f(leaves, tokens, positions, segment_ids) -> logits`` (pure; jit/grad it)."""
        return self.builder.forward

    def packed_logits(self, sequences: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Logits for each sequence (exact lengths), computed on packed rows."""
        pb = PackedBatch.build(sequences)
        args = (self.leaves, pb.tokens, pb.positions, pb.segment_ids,
                pb.cu_seqlens if self.backend == "triton" else None)
        key = ("forward", pb.tokens.shape, None if args[-1] is None else args[-1].shape)
        out = self.cache.run(key, lambda: jax.jit(self.builder.forward).lower(*args).compile(),
                             *args)
        return pb.unpack(np.asarray(out))


@dataclass(frozen=True)
class PackedBatch:
    """Sequences bin-packed into rows of a bucketed length (no MAX_LEN padding).

    ``where[i] = (row, start, length)`` locates sequence i. Positions restart at 0 for each
    sequence and segment ids keep sequences from attending to each other; unused slots have
    position -1.
    """

    tokens: np.ndarray
    positions: np.ndarray
    segment_ids: np.ndarray
    where: tuple[tuple[int, int, int], ...]

    @staticmethod
    def build(sequences: Sequence[np.ndarray], *, row_len: int | None = None) -> PackedBatch:
        lens = [len(s) for s in sequences]
        if not lens or min(lens) < 1:
            raise InputError("packed forward needs at least one non-empty sequence")
        row_len = row_len or length_bucket(max(lens))
        if max(lens) > row_len:
            raise InputError(f"a sequence of {max(lens)} tokens does not fit rows of {row_len}")
        fill: list[int] = []
        where: list[tuple[int, int, int]] = [(0, 0, 0)] * len(lens)
        for i in sorted(range(len(lens)), key=lambda i: -lens[i]):  # first-fit decreasing
            for r, used in enumerate(fill):
                if used + lens[i] <= row_len:
                    where[i] = (r, used, lens[i])
                    fill[r] += lens[i]
                    break
            else:
                where[i] = (len(fill), 0, lens[i])
                fill.append(lens[i])
        rows = next_pow2(len(fill))
        tokens = np.zeros((rows, row_len), np.int32)
        positions = np.full((rows, row_len), -1, np.int32)
        segs = np.full((rows, row_len), -1, np.int32)
        for i, (r, s, n) in enumerate(where):
            tokens[r, s:s + n] = sequences[i]
            positions[r, s:s + n] = np.arange(n)
            segs[r, s:s + n] = i
        return PackedBatch(tokens, positions, segs, tuple(where))

    @property
    def cu_seqlens(self) -> np.ndarray:
        """Boundaries of the rows flattened end to end, for the packed varlen kernel.

        Every sequence and every unused gap is its own segment (gaps attend only to themselves
        and are never read back); the array is padded to a power of two with empty segments so
        that batches with different sequence counts share a compiled program.
        """
        length = self.tokens.shape[1]
        starts = sorted((r * length + s, n) for r, s, n in self.where)
        bounds = [0]
        for start, n in starts:
            if start > bounds[-1]:
                bounds.append(start)  # a gap before this sequence
            bounds.append(start + n)
        total = self.tokens.size
        if bounds[-1] < total:
            bounds.append(total)
        size = next_pow2(len(bounds))
        return np.asarray(bounds + [total] * (size - len(bounds)), np.int32)

    @property
    def padding_fraction(self) -> float:
        used = sum(n for _, _, n in self.where)
        return 1.0 - used / self.tokens.size

    def unpack(self, per_slot: np.ndarray) -> list[np.ndarray]:
        return [per_slot[r, s:s + n] for r, s, n in self.where]
