"""One aligned microbatch decoding on device: the host loop as a small state object.

:class:`DecodeGroup` owns the device state of a group (its stores, the fed-back token's slot
included; positions; row ids) and its host bookkeeping (which request row sits in which batch
slot, which rows are done). It makes no decision: before every dispatch it asks the pure policy
(:func:`jaxrl_sym.runtime.policy.next_dispatch`) for the tile, the write slot, the row bucket and
the store capacity, then carries them out — compaction, growth, one decode program.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from functools import partial
from typing import Any

import jax
import numpy as np

from jaxrl_sym.generation import GenerationConfig
from jaxrl_sym.passes.stores import GrowingStore
from jaxrl_sym.runtime.group.outputs import OnFinished, Outputs
from jaxrl_sym.runtime.group.programs_by_shape import (
    compact_store_program,
    decode_kind,
    decode_program,
    grow_program,
    packed_prefill_program,
)
from jaxrl_sym.runtime.group.refills import RefillRows
from jaxrl_sym.runtime.group.rows import RowState
from jaxrl_sym.runtime.metrics import MemoryMeter, WorkLog, capped_sum, tree_bytes
from jaxrl_sym.runtime.packing import PackedPrompts
from jaxrl_sym.runtime.plan import GenerationPlan
from jaxrl_sym.runtime.policy import Compaction, Cursor, Dispatch, replay_group
from jaxrl_sym.runtime.programs import DecodeRows, ProgramCache
from jaxrl_sym.runtime.prompt_cache import PromptCache, cache_budget, plan_chunks
from jaxrl_sym.runtime.refill import Refill, refill_shape
from jaxrl_sym.sharding import to_host

NEVER = Compaction(share=0.0)  # a deferred compaction: the group decodes on at its bucket

class DecodeGroup(RefillRows):
    """A microbatch from prefill to its last row's end (see the module docstring).

    plan: the model's generation plan (what every decision reads); cache: the engine's compiled
    programs (shared by its groups, so a program compiles once per engine). waiting: request
    rows that take the group's rows as they free up (:mod:`jaxrl_sym.runtime.refill`); the
    group is then sized for every one of them and its stores never grow (they wrap), and every
    row — the first ``group`` too — takes its prompt from the prompt cache
    (:mod:`jaxrl_sym.runtime.prompt_cache`)."""

    def __init__(self, plan: GenerationPlan, cache: ProgramCache, group: list[int],
                 prompts: list[np.ndarray], limits: np.ndarray, cfg: GenerationConfig,
                 meter: MemoryMeter, weights_bytes: int, waiting: list[int] | None = None
                 ) -> None:
        self.plan, self.cache = plan, cache
        self.cfg, self.meter, self.weights_bytes = cfg, meter, weights_bytes
        self.waiting = list(waiting or [])
        self.refill: Refill | None = plan.options.refill_policy() if self.waiting else None
        if self.refill is not None:
            every = [*group, *self.waiting]
            self.shape = refill_shape([len(prompts[i]) for i in every],
                                      [int(limits[i]) for i in every], len(group),
                                      plan.row_multiple, plan.options.max_len)
        else:
            self.shape = plan.group_shape([len(prompts[i]) for i in group],
                                          [limits[i] for i in group])
        self.all_limits = limits
        # the tile program's output buffers hold plan.tile_buffer(cfg) steps: tiles grow to it
        self.at = Cursor.start(self.shape, plan.group_tiling(cfg))
        b = self.shape.rows
        if self.refill is not None:  # every row starts free: the cache fills them (run)
            self.waiting, group = [*group, *self.waiting], []
            budget = cache_budget(self.shape.prompt_slots, b, self.capacity)
            self.feed = PromptCache(plan_chunks(self.waiting, prompts, budget,
                                                vocab=plan.vocab_size,
                                                logits_bytes=cfg.prefill_logits_bytes))
        self.state = RowState.empty(b).seat(range(len(group)), group,
                                            [limits[i] for i in group],
                                            [len(prompts[i]) for i in group], off=0)
        self.prompts = prompts
        self.work = WorkLog()
        self._tile = 0  # steps of the dispatch whose tokens ``collect`` reads next (0: prefill)
        self._ran: Any = None  # the tile program's count of steps run (a device scalar)
        self.seed = jax.device_put(np.uint32(cfg.seed))
        self._put: tuple[RowState, DecodeRows] | None = None  # see on_device
        self.stores = cache.run(("init", b, self.capacity), lambda: jax.jit(
            plan.builder.init_stores, static_argnums=(0, 1)).lower(b, self.capacity).compile())

    @property
    def rows(self) -> int:
        return self.at.rows

    @property
    def capacity(self) -> int:
        return self.at.capacity

    @property
    def steps_done(self) -> int:
        return self.at.steps_done

    @property
    def on_device(self) -> DecodeRows:
        """The rows' arrays the programs take, put on the device once per state value: the
        state is immutable, so a new value is the only way the rows change."""
        if self._put is None or self._put[0] is not self.state:
            self._put = (self.state, jax.device_put(self.state.decode_rows()))
        return self._put[1]

    @property
    def row_ids(self) -> jax.Array:
        return self.on_device.row_id

    # ------------------------------------------------------------------ the loop
    def run(self, hoisted: tuple[jax.Array, ...], out: Outputs,
            on_finished: OnFinished | None) -> None:
        """Prefill, then decode until every row hit EOS or its limit.

        With a ``stop_when`` rule the tile does not grow: the rule is asked at every read-back,
        so it sees rows end within ``decode_tile`` steps (partial rollouts stop on time). With
        its ``stop_live`` bound as well, tiles grow as usual and the tile program itself ends at
        the step the live rows fall to the bound — the first step the rule can hold — so the
        rule is asked exactly there; past it, tiles stay at the base."""
        if out.stop_when is not None:
            self.at = self.at.bounded(out.stop_live)
        ahead = self.compile_ahead(hoisted)
        try:
            self._loop(hoisted, out, on_finished)
        finally:  # what the replay named and this group did not start is not compiled
            self.cache.cancel(ahead)

    def _loop(self, hoisted: tuple[jax.Array, ...], out: Outputs,
              on_finished: OnFinished | None) -> None:
        last = self.prefill(hoisted) if self.refill is None else None
        while True:
            if last is not None:
                self.collect(last, out, on_finished)
            while self.waiting and not out.should_stop() and self.refill_rows(hoisted, out,
                                                                              on_finished):
                pass  # a refilled row may end at its token 0, freeing its row again
            if self.state.done.all() or out.should_stop():
                return
            live, st = self.state.live(), self.state
            remaining = max(int(st.limits[s]) - len(out.toks[int(st.ids[s])]) for s in live)
            ask = partial(self.next_dispatch, live, remaining=remaining,
                          compaction=NEVER if self.waiting else None)
            d = ask()
            if d.rows < self.rows and self._defer(d, hoisted):
                d = ask(compaction=NEVER)
            self.carry_out(d, live)
            last = self.decode(hoisted, d)

    def compile_ahead(self, hoisted: tuple[jax.Array, ...]) -> list[tuple]:
        """Start compiling the decode programs this group will run, in the background
        (``EngineOptions.compile_threads``): the buckets the policy's replay of the group names
        when its rows run to their limits, in the order it runs them, so the first tile's
        program compiles while the prefill's does. A refill group runs one bucket. Returns
        the programs' keys (the group cancels those not started when it ends: rows that ended
        early at EOS never reached their buckets, and a process would wait for them at exit)."""
        if self.plan.compile_threads == 0 or self.refill is not None:
            return []
        live = self.state.live()
        ds = replay_group(self.shape, [int(self.state.limits[s]) for s in live],
                          tiling=self.at.tiling,
                          need=self.plan.growing_need, row_multiple=self.plan.row_multiple,
                          compaction=self.plan.compaction)
        keys = []
        for rows, capacity in dict.fromkeys((d.rows, d.capacity) for d in ds):
            key, build = decode_program(self.plan, self.cfg, hoisted, rows, capacity)
            self.cache.prefetch(key, build)
            keys.append(key)
        return keys

    def next_dispatch(self, live: np.ndarray, *, remaining: int,
                      compaction: Compaction | None = None, **over: int | bool) -> Dispatch:
        """The policy's next dispatch for this group (:meth:`Cursor.ask`): the group asks, it
        does not decide. ``over``: the speculative group's own terms (``steps_done``,
        ``tile``, ``check`` — 1 for a program that takes exactly the steps asked — and
        ``grow_with_compaction``)."""
        return self.at.ask(self.shape, live=len(live), remaining=remaining,
                           need=None if self.refill is not None else self.plan.growing_need,
                           row_multiple=self.plan.row_multiple,
                           compaction=compaction or self.plan.compaction, **over)

    def carry_out(self, d: Dispatch, live: np.ndarray) -> None:
        """The compaction and growth ``d`` decided, before its program runs."""
        if d.rows < self.rows:
            self.compact(live, d.rows)
        if d.capacity > self.capacity:
            self.grow(d.capacity)

    def _defer(self, d: Dispatch, hoisted: tuple[jax.Array, ...]) -> bool:
        """Whether the compaction ``d`` asks for waits (``EngineOptions.defer_compiles``):
        its decode program was not requested before this generate call, so it compiles in the
        background (if it is not already) and this dispatch runs at the current bucket. A
        program requested by an earlier call is waited for, so the buckets a call uses never
        depend on how fast a compile ran. On a mesh programs are built for placed stores, so
        nothing is deferred there."""
        if not self.plan.options.defer_compiles or self.plan.mesh is not None:
            return False
        key, build = decode_program(self.plan, self.cfg, hoisted, d.rows, d.capacity)
        if key in self.cache.settled:
            return False
        self.cache.prefetch(key, build)
        return True

    def prefill(self, hoisted: tuple[jax.Array, ...]) -> tuple[Any, ...]:
        """Fill the stores from the prompts (packed, or as the right-aligned block)."""
        if self.plan.options.prefill == "packed":
            return self.packed_prefill(hoisted)
        return self.block_prefill(hoisted)

    def packed_prefill(self, hoisted: tuple[jax.Array, ...]) -> tuple[Any, ...]:
        """The prompts bin-packed into rows (:mod:`jaxrl_sym.runtime.prefill`): no prompt
        padding and no filler row is computed, only the packing's tail."""
        prompts = [self.prompts[i] if i >= 0 else None for i in self.state.ids]
        pk = PackedPrompts.build(prompts, self.shape.prompt_slots, vocab=self.plan.vocab_size,
                                 logits_bytes=self.cfg.prefill_logits_bytes)
        self.work.computed += pk.positions_computed  # a repeated prompt is needed once
        self.work.needed += pk.prompt_tokens
        self.work.add("packing", pk.positions_computed - pk.prompt_tokens)
        self._tile = 0
        if self.plan.mesh is not None:  # as GenerationPlan.run: stores in their shardings
            self.stores = self.plan.builder.place_stores(self.stores)
        args = (hoisted, self.stores, *(jax.device_put(x) for x in (
            pk.tokens, pk.positions, pk.rows, pk.slots, pk.last, pk.copies)), self.row_ids,
                self.seed)
        key, build = packed_prefill_program(self.plan, self.cfg, pk, args)
        self.stores, tok, lp, lg = self.cache.run(key, build, *args)
        del args, build  # they hold the empty stores, donated
        self._observe(key, step=0)
        return tok, lp, lg if self.cfg.return_logits else None, False

    def block_prefill(self, hoisted: tuple[jax.Array, ...]) -> tuple[Any, ...]:
        """The right-aligned prompt block, in chunks whose logits fit the config's budget."""
        b, pcap = self.shape.rows, self.shape.prompt_slots
        tok_in = np.zeros((b, pcap), np.int32)
        pos_in = np.full((b, pcap), -1, np.int32)
        for slot, i in enumerate(self.state.ids):
            if i >= 0:
                p = self.prompts[i]
                tok_in[slot, pcap - len(p):] = p
                pos_in[slot, pcap - len(p):] = np.arange(len(p))
        lens = [len(self.prompts[i]) for i in self.state.ids if i >= 0]
        self.work.computed += b * pcap
        self.work.needed += sum(lens)
        self.work.add("prompt_alignment", sum(pcap - n for n in lens))
        self.work.add("row_bucket", (b - len(lens)) * pcap)
        self._tile = 0
        chunk = self.cfg.prefill_chunk(b, pcap, self.plan.vocab_size)
        (self.stores, tok, lp, lg), key = self.plan.run(self.cache,
            "prefill", self.cfg, hoisted, self.stores, jax.device_put(tok_in),
            jax.device_put(pos_in), self.row_ids, self.seed, chunk=chunk)
        self._observe(key, step=0)
        return tok, lp, lg if self.cfg.return_logits else None, False

    def _program(self) -> tuple[str, bool, dict[str, Any]]:
        """The decode program this group runs: (name, tiled, static arguments)."""
        return decode_kind(self.plan, self.cfg)

    def decode(self, hoisted: tuple[jax.Array, ...], d: Dispatch) -> tuple[Any, ...]:
        """One decode program: a single step, or a tile of ``d.tile`` steps."""
        self._tile, self._dispatch = d.tile, d
        args = (hoisted, self.stores, self.on_device, np.int32(d.step), np.int32(d.write),
                self.seed)
        name, tiled, static = self._program()
        ran = None
        if tiled:
            stop = max(d.stop, self.at.stop_live,
                       self.refill.stop_live(self.rows, len(self.waiting)) if self.waiting else 0)
            args = (*args, np.int32(d.tile), np.int32(stop))
            (self.stores, tok, lp, lg, ran), key = self.plan.run(self.cache, name, self.cfg,
                                                                 *args, **static)
        else:
            (self.stores, tok, lp, lg), key = self.plan.run(self.cache, name, self.cfg, *args)
        self._ran = ran
        self._observe(key, step=d.step + d.tile - 1)
        return tok, lp, lg if self.cfg.return_logits else None, tiled

    # ------------------------------------------------------------------ host side
    def collect(self, last: tuple[Any, ...], out: Outputs, on_finished: OnFinished | None
                ) -> None:
        """Read a dispatch's tokens back and mark rows that ended. ``last`` is (tokens,
        log-probs, logits or None, tiled): [steps, rows] when tiled, else [rows]."""
        *arrays, tiled = last
        # host copies with a leading step axis (added on the host: no device op, no compile)
        tok_h, lp_h, lg_h = (None if x is None else to_host(x) if tiled
                             else to_host(x)[None] for x in arrays)
        live = self.state.live()
        before = {int(s): len(out.toks[int(self.state.ids[s])]) for s in live}
        if self._tile and self._ran is not None:  # the steps the tile program ran
            self._tile = int(self._ran)
            self._dispatch = self._dispatch.ran(self._tile)
        finished = self._append(tok_h, lp_h, lg_h, out)
        now = len(self.state.live())
        if self._tile:  # a decode dispatch: each emitted token was one needed position
            self._book(out, before)
            self.at = self.at.ran(self._dispatch, ended=bool(finished), live=now)
        else:
            self.at = self.at.settle(now)
        if out.progress is not None:
            out.progress(sum(len(t) for t in out.toks))
        if finished and on_finished is not None:
            on_finished(finished, [np.asarray(out.toks[i], np.int32) for i in finished])

    def _append(self, tok_h: np.ndarray, lp_h: np.ndarray, lg_h: np.ndarray | None,
                out: Outputs) -> list[int]:
        """Append the ``self._tile or 1`` steps read back to each live row's outputs (a row
        ends at EOS or its limit; its later steps are overrun: :meth:`Outputs.append_steps`);
        returns the request rows that ended."""
        st, steps = self.state, self._tile or 1
        live = st.live()
        if not len(live):
            return []
        ids = st.ids[live]
        room = st.limits[live] - np.array([len(out.toks[i]) for i in ids.tolist()], np.int64)
        n, ended, finished = out.append_steps(
            ids, tok_h[:steps, live], lp_h[:steps, live],
            None if lg_h is None else lg_h[:steps, live], room, self.cfg.eos_ids)
        self.state = st.emitted(live, tok_h[n - 1, live], ended)
        return finished

    def _book(self, out: Outputs, before: dict[int, int]) -> None:
        """Book a decode dispatch's token positions by cause (:class:`WorkLog`), for the
        steps it ran."""
        d = self._dispatch
        emitted = {s: len(out.toks[int(self.state.ids[s])]) - n for s, n in before.items()}
        used = sum(emitted.values())
        filler = int((self.state.ids < 0).sum())
        self.work.computed += d.rows * d.tile
        self.work.needed += used
        self.work.add("row_bucket", filler * d.tile)
        self.work.add("finished_rows", (d.rows - filler - len(before)) * d.tile)
        self.work.add("tile_overrun", len(before) * d.tile - used)
        self._book_keys(d, emitted)

    def _book_keys(self, d: Dispatch, emitted: dict[int, int]) -> None:
        """Book a decode dispatch's key slots by cause (:class:`WorkLog`); ``emitted``: tokens
        each row live before it emitted in it. Stores of one kind and size count together."""
        sizes = Counter((isinstance(sp.kind, GrowingStore),
                         sp.kind.slots(sp, sp.kind.capacity(sp, d.capacity)))
                        for sp in self.plan.specs.values())
        per_step = sum(n * size for (_, size), n in sizes.items())
        filler = int((self.state.ids < 0).sum())
        self.work.add_keys("row_bucket", filler * d.tile * per_step)
        self.work.add_keys("finished_rows", (d.rows - filler - len(emitted)) * d.tile * per_step)
        pcap = self.shape.prompt_slots
        for slot, u in emitted.items():
            plen = len(self.prompts[int(self.state.ids[slot])])
            self.work.add_keys("tile_overrun", (d.tile - u) * per_step)
            for (aligned, size), n in sizes.items():
                pad = pcap - plen if aligned else 0
                need = capped_sum(size, plen + d.step, u)
                self.work.key_needed += n * need
                self.work.key_computed += n * need
                self.work.add_keys("prompt_alignment", n * pad * u)
                self.work.add_keys("capacity", n * (size * u - need - pad * u))

    @staticmethod
    def kept(live: np.ndarray, rows: int) -> tuple[np.ndarray, np.ndarray]:
        """The batch slots a compaction to ``rows`` keeps (live ones, then a live row repeated
        as filler) and which of the new slots are filler."""
        keep = np.concatenate([live, np.repeat(live[:1], rows - len(live))])
        return keep, np.arange(rows) >= len(live)

    def compact(self, live: np.ndarray, rows: int) -> None:
        """Keep the live rows in a bucket of ``rows`` (fillers repeat a live row, masked), one
        store per program. Why: a smaller copy cannot alias its input, so compacting every store
        in one program holds all old and all new stores at once — compiled for the H100 at
        Qwen2.5-0.5B's shape that was sym's generation peak; store by store the old copy of one
        store is all that is added (the numbers: ``bench/results/projection.md``)."""
        keep, filler = self.kept(live, rows)
        kept = jax.device_put(keep.astype(np.int32))
        self.state = self.state.take(keep, filler)
        for name in list(self.stores):  # one store per program (why: the docstring)
            if self._slot_from_host(name):
                continue
            key, build = compact_store_program(self.plan, self.stores[name], kept)
            self.stores[name] = self.cache.run(key, build, self.stores[name], kept)
            del build  # it holds the store's old rows: free them before the next store
        # the rows' device arrays come from the new state (on_device), no program: ``keep``
        # names live rows only, whose row id is their sample's (fillers repeat one, as stores do)
        self.at = dataclasses.replace(self.at, rows=rows)

    def _slot_from_host(self, name: str) -> bool:
        """Whether store ``name`` is a feedback edge of lag 1, now rebuilt from the host's copy
        of each kept row's last token (``fed``) instead of by a compaction program: the host
        reads every token anyway, and each compaction then compiles one program less."""
        sp = self.plan.builder.slots.get(int(name))
        if sp is None or sp.lag != 1:
            return False
        old = self.stores[name]["tok"]
        self.stores[name] = {"tok": jax.device_put(self.state.fed[:, None], old.sharding)}
        return True

    def grow(self, capacity: int) -> None:
        """Grow the growing stores to ``capacity`` in place, one store per program.

        Why one at a time: a padded copy cannot alias its input, so growing every layer in one
        program keeps all old and all new buffers live together: on an H100 that put sym's peak at
        about twice its final stores, above padded's; one store per program brought it to just above
        the stores (``bench/results/nvidia-h100-80gb-hbm3/README.md``). Each store is replaced in
        the dict as soon as its copy exists, so its old buffers are freed before the next one grows.
        Stores of equal shape share one compiled program.
        """
        for g in self.plan.growing:
            old_bytes = tree_bytes(self.stores[g])
            key, build = grow_program(self.plan, g, self.stores[g], self.rows, capacity)
            self.stores[g] = self.cache.run(key, build, self.stores[g])
            del build  # it holds the old store
            self.meter.observe(self.weights_bytes + tree_bytes(self.stores) + old_bytes,
                               self.cache.temp_bytes[key], step=self.steps_done)
        self.at = dataclasses.replace(self.at, capacity=capacity)

    def _observe(self, key: tuple, step: int) -> None:
        cached = self.feed.nbytes if self.refill is not None else 0
        self.meter.observe(self.weights_bytes + tree_bytes(self.stores) + cached,
                           self.cache.temp_bytes[key], step=step)
