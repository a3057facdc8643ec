"""Refill: finished rows of a resident decode group take waiting samples (pure integer policy).

Why: a decode group runs until its longest row ends; the rows that finished before it are
computed for nothing (the realistic request's largest waste) unless they are compacted away. On
a CPU a decode step costs in proportion to its rows, so compaction pays there; on a GPU a decode
step reads the weights whatever the rows, so 64 rows cost nearly what 128 do and the right move
is to keep the batch full: a freed row takes the next waiting sample (continuous batching, as
vLLM, SGLang and EasyDeL's eSurge do — but at tile boundaries, into aligned rows, not with a
per-step gather).

How a refilled row fits the aligned group: the group's rows write their next token at one shared
slot ``w`` (the aligned write slot), so a sample refilled before decode step ``s`` has its prompt
placed at slots ``w - L .. w - 1`` (copied from the prompt cache,
:mod:`jaxrl_sym.runtime.prompt_cache`) and its first token (sampled from the cached logits) fed
back at ``w`` with everyone else's. Its earlier slots are reset to empty. Attention masks by the
positions the stores keep per slot, so where a row's keys sit does not change what it computes.

Where the slots come from — the two layouts this module prices (:class:`Layout`):

* ``lifetime``: the growing stores keep growing with ``w`` as today (live slots a prefix);
  a refilled row's dead slots before ``w - L`` stay in the store. Memory and key reads grow with
  the group's whole lifetime, i.e. with every refill wave.
* ``ring``: the growing stores become rings (slot ``t mod C``, as the window stores already are),
  and ``C`` only needs to cover the longest *live span* of any row (its prompt plus its tokens
  so far) — so memory is bounded by one sample's length, not by the waves. Growing a ring
  re-lays its slots out (``t mod C`` → ``t mod C'``) for the last ``C`` writes.

Everything here is plain integers: the decode group asks it, and :func:`replay` drives it with
row counters so a benchmark prices a request under every layout without running a model.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from jaxrl_sym.errors import InputError
from jaxrl_sym.runtime.packing import PackedPrompts
from jaxrl_sym.runtime.policy import (
    DEFAULT_MIN_CAPACITY,
    Compaction,
    Cursor,
    Dispatch,
    GroupShape,
    Tiling,
    grown_capacity,
    initial_capacity,
    length_bucket,
    microbatches,
    row_bucket,
)
from jaxrl_sym.runtime.prompt_cache import PromptCache, cache_budget, plan_chunks

Layout = Literal["lifetime", "ring"]

LAYOUTS: tuple[Layout, ...] = ("lifetime", "ring")


@dataclass(frozen=True)
class Refill:
    """When a resident group refills its free rows, and how its growing stores are laid out.

    min_free: refill once at least this many rows are free (or every waiting sample fits);
      each refill is one prefill dispatch, so waiting for a few free rows trades finished-row
      steps for fewer dispatches. layout: see the module docstring.
    """

    min_free: int = 1
    layout: Layout = "ring"

    def __post_init__(self) -> None:
        if self.min_free < 1:
            raise InputError(f"Refill.min_free must be >= 1, got {self.min_free}")
        if self.layout not in LAYOUTS:
            raise InputError(f"Refill.layout must be one of {LAYOUTS}, got {self.layout!r}")

    def take(self, free: int, waiting: int) -> int:
        """How many waiting samples to refill into the ``free`` rows now (0: not yet)."""
        n = min(free, waiting)
        return n if n > 0 and (free >= self.min_free or n == waiting) else 0

    def stop_live(self, rows: int, waiting: int) -> int:
        """The live rows at which a decode tile of a group of ``rows`` ends while ``waiting``
        samples wait: the step enough rows are free for :meth:`take`, so they are refilled
        then instead of idling to the tile's end (0: nothing waits, the tile runs on)."""
        return max(0, rows - min(self.min_free, waiting)) if waiting else 0


def ring_need(first_slots: Sequence[int], last_writes: Sequence[int]) -> int:
    """Slots a ring growing store needs so that no live row's span wraps onto itself: the longest
    span ``last - first + 1`` among live rows (``first``: where a row's prompt starts; ``last``:
    the last slot it writes that it still reads — a row that ends inside a decode tile writes on
    to the tile's end, but nothing reads those slots before a refill resets them)."""
    return max((t - f + 1 for f, t in zip(first_slots, last_writes, strict=True)), default=1)


def lifetime_need(last_write: int) -> int:
    """Slots a prefix growing store needs: every slot up to the last write."""
    return last_write + 1


def refill_shape(prompt_lens: Sequence[int], limits: Sequence[int], rows: int,
                 row_multiple: int = 1, max_len: int | None = None) -> GroupShape:
    """The geometry of a refilling group of ``rows`` resident rows over every sample it will
    run: the prompt block fits the longest prompt (a refilled prompt ends at the write slot,
    which is never before the block's end), and the growing stores are rings fixed at the
    longest span any sample needs — its prompt plus its limit — on the length grid, so they
    never grow however many waves the group runs (``total`` is never reached: no growth).
    ``max_len``: the user's cap on prompt + response, refused by row as without refill."""
    if max_len is not None:
        GroupShape.plan(prompt_lens, limits, min_capacity=1, max_len=max_len)
    pcap = length_bucket(max(prompt_lens))
    span = max(int(n) + int(m) for n, m in zip(prompt_lens, limits, strict=True))
    return GroupShape(row_bucket(rows, row_multiple), pcap, pcap + span, length_bucket(span))


# ------------------------------------------------------------------------------ replay


@dataclass
class RefillRun:
    """What a request costs under one schedule (row counters, no model): the benchmark's row."""

    decode_dispatches: int = 0
    decode_steps: int = 0  # decode steps over all dispatches (each reads the weights once)
    prefill_dispatches: int = 0  # packed prefills: a group's, or a prompt-cache chunk's
    refill_dispatches: int = 0  # refills from the prompt cache (no model run)
    refill_slots: int = 0  # store slots refills wrote from the cache (rows x prompt block each)
    computed: int = 0  # token positions computed (decode rows x steps + packed prefill slots)
    needed: int = 0  # positions the samples needed: prompt tokens + response tokens - 1 each
    waste: Counter = field(default_factory=Counter)  # computed - needed, by cause
    key_slots: int = 0  # key slots decode steps read: sum over steps of rows x store slots
    peak_slots: int = 0  # most store slots held at once (rows x capacity, + the prompt cache)
    programs: set = field(default_factory=set)  # distinct compiled-program keys

    def waste_share(self) -> float:
        return 1.0 - self.needed / self.computed if self.computed else 0.0

    def row(self) -> dict:
        return {"decode_dispatches": self.decode_dispatches, "decode_steps": self.decode_steps,
                "prefill_dispatches": self.prefill_dispatches,
                "refill_dispatches": self.refill_dispatches, "refill_slots": self.refill_slots,
                "programs": len(self.programs), "computed": self.computed,
                "needed": self.needed, "waste": round(self.waste_share(), 4),
                "waste_by_cause": {k: round(v / self.computed, 4)
                                   for k, v in sorted(self.waste.items())},
                "key_slots": self.key_slots, "peak_slots": self.peak_slots}


@dataclass
class _Rows:
    """The resident rows' counters: sample id (-1: free), first slot, tokens still to emit."""

    sample: list[int]
    first: list[int]
    left: list[int]

    def live(self) -> list[int]:
        return [r for r, x in enumerate(self.left) if x > 0]

    def free(self) -> list[int]:
        return [r for r, x in enumerate(self.left) if x <= 0]


REFILL, TILING, COMPACTION = Refill(), Tiling(), Compaction()  # the engine's defaults


def replay(prompt_lens: Sequence[int], limits: Sequence[int], *, rows: int,
           refill: Refill | None = REFILL, tiling: Tiling = TILING,
           compaction: Compaction = COMPACTION,
           min_capacity: int = DEFAULT_MIN_CAPACITY,
           prompt_ids: Sequence[int] | None = None) -> RefillRun:
    """Samples (prompt length, response length) through one group of ``rows`` resident rows,
    each sample running to its limit (no EOS), taken in order. ``refill=None``: no refill — the
    group's rows are the first ``rows`` samples and the next group starts when it ends (today's
    microbatches of ``rows``, compaction as configured). ``prompt_ids``: which prompt each
    sample repeats (a GRPO request's G samples share one; default: all distinct)."""
    if len(prompt_lens) != len(limits) or not len(limits):
        raise InputError("replay: one limit per prompt length, at least one sample")
    ids = list(range(len(limits))) if prompt_ids is None else list(prompt_ids)
    prompts = [np.full((int(n),), i, np.int32) for n, i in zip(prompt_lens, ids, strict=True)]
    if refill is None or len(limits) <= rows:  # the engine's microbatches of ``rows``
        out = RefillRun()
        for g in microbatches(prompt_lens, limits, max_rows=rows, max_pad_fraction=1.0):
            _group([prompts[i] for i in g], [limits[i] for i in g], rows, None, tiling,
                   compaction, min_capacity, out)
        return out
    return _group(prompts, list(limits), rows, refill, tiling, compaction, min_capacity,
                  RefillRun())


def _group(prompts: list[np.ndarray], limits: Sequence[int], rows: int, refill: Refill | None,
           tiling: Tiling, compaction: Compaction, min_capacity: int, out: RefillRun
           ) -> RefillRun:
    """One group from its first prefill to its last row's end, at the geometry the engine
    gives it: :meth:`GroupShape.plan` without refill, else :func:`refill_shape` (a ring at a
    fixed capacity, or the ``lifetime`` layout growing) with every row filled from the prompt
    cache (:mod:`jaxrl_sym.runtime.prompt_cache`), the first ones too."""
    lens = [len(p) for p in prompts]
    shape, st, waiting, feed, capacity = _start(prompts, limits, rows, refill, min_capacity, out)
    pcap, b = shape.prompt_slots, shape.rows
    at = Cursor(b, capacity, tiling, 0, tiling.first())  # the engine's cursor, advanced alike
    while True:
        step = at.steps_done + 1
        w = pcap + step - 1  # the slot decode step ``step`` writes
        while waiting:  # as the engine: a refilled row may end at its token 0, freed again
            left = _refill(out, st, waiting, refill, w, lens, limits, feed)
            if len(left) == len(waiting):
                break
            waiting = left
        live = st.live()
        if not live:
            return out
        k = tiling.whole(min(at.tile, max(st.left[r] for r in live)))
        if waiting:  # the tile ends once enough rows are free to refill (Refill.stop_live)
            k = tiling.ran(k, [st.left[r] for r in live], refill.stop_live(b, len(waiting)))
        else:  # the tail: compaction as without refill, the tile ending at the next one
            st = _compact(out, st, compaction, capacity)  # (Compaction.stop_at: with early)
            live = st.live()
            k = tiling.ran(k, [st.left[r] for r in live], compaction.stop_at(len(st.sample)))
        if refill is not None and refill.layout == "ring":  # fixed: no live span may wrap
            need = ring_need([st.first[r] for r in live],
                             [w + min(k, st.left[r]) - 1 for r in live])
            if need > capacity:
                raise AssertionError(f"ring of {capacity} slots, a live span of {need}")
        else:  # a prefix: to the last slot a live row writes (unknown while samples wait)
            need = lifetime_need(w + k - 1)
            bound = (shape.total if refill is None else 2 * capacity if waiting
                     else w + max(st.left[r] for r in live))
            if need > capacity:
                capacity = grown_capacity(capacity, need, bound)
                out.programs.add(("grow", len(st.sample), capacity))
        _decode(out, st, k, capacity)
        ended = any(0 < st.left[r] <= k for r in live)
        st.left = [max(0, x - k) for x in st.left]
        at = at.ran(Dispatch(step, k, w, len(st.sample), capacity), ended=ended,
                    live=len(st.live()))


def _start(prompts: list[np.ndarray], limits: Sequence[int], rows: int, refill: Refill | None,
           min_capacity: int, out: RefillRun
           ) -> tuple[GroupShape, _Rows, list[int], _Feed | None, int]:
    """A group's geometry and first rows: without refill its samples prefilled (packed), with
    refill every row free, every sample waiting and the prompt cache planned. Returns (shape,
    rows, waiting, cache or None, store capacity)."""
    lens = [len(p) for p in prompts]
    ring = refill is not None and refill.layout == "ring"
    if refill is None:
        shape = GroupShape.plan(lens, limits, min_capacity=min_capacity)
        first, waiting = list(range(len(limits))), []
    else:
        shape = refill_shape(lens, limits, rows)
        first, waiting = [], list(range(len(limits)))
    pcap, b = shape.prompt_slots, shape.rows
    capacity = (shape.capacity if refill is None or ring
                else initial_capacity(pcap, min_capacity, shape.total))
    st = _Rows([*first, *[-1] * (b - len(first))],
               [pcap - lens[i] for i in first] + [pcap] * (b - len(first)),
               [int(limits[i]) - 1 for i in first] + [0] * (b - len(first)))
    feed = None
    if refill is None:
        _prefill(out, {r: prompts[i] for r, i in enumerate(first)}, b, pcap, capacity)
    else:
        feed = _Feed(prompts, waiting, cache_budget(pcap, b, capacity), b, capacity, pcap)
    # the stores exist from the first fill on, even if every sample ends at its token 0
    out.peak_slots = max(out.peak_slots, b * capacity)
    return shape, st, waiting, feed, capacity


class _Feed:
    """The replay's prompt cache: the engine's :class:`PromptCache` over the same chunks
    (:func:`plan_chunks`), without arrays, and what its programs cost."""

    def __init__(self, prompts: list[np.ndarray], order: list[int], budget: int, rows: int,
                 capacity: int, pcap: int) -> None:
        self.cache = PromptCache(plan_chunks(order, prompts, budget, vocab=1,
                                             logits_bytes=1 << 62))
        self.rows, self.capacity, self.pcap = rows, capacity, pcap

    def fill(self, out: RefillRun, samples: list[int]) -> int:
        """One refill program for the leading ``samples`` in one chunk (built first if it is
        not loaded: a packed prefill's positions); how many it took."""
        c = self.cache.needs_load(samples[0])
        if c is not None:
            pk = self.cache.chunks[c].packed
            out.prefill_dispatches += 1
            out.computed += pk.positions_computed
            out.needed += pk.prompt_tokens
            out.waste["packing"] += pk.positions_computed - pk.prompt_tokens
            out.programs.add(("prompt_cache", pk.tokens.shape))
            self.cache.loaded(c, None, None)  # beside the stores: a token each, like a slot
            out.peak_slots = max(out.peak_slots, self.rows * self.capacity + pk.tokens.size)
        out.refill_dispatches += 1
        out.refill_slots += self.rows * self.pcap
        out.programs.add(("refill", self.rows, self.capacity,
                          self.cache.chunks[self.cache.at].packed.tokens.shape))
        return self.cache.servable(samples)


def _refill(out: RefillRun, st: _Rows, waiting: list[int], refill: Refill, w: int,
            lens: Sequence[int], limits: Sequence[int], feed: _Feed) -> list[int]:
    """Refill free rows as the policy says (every free row when none is live), from the prompt
    cache; the samples still waiting after it."""
    free = len(st.free())
    take = refill.take(free, len(waiting)) if st.live() else min(free, len(waiting))
    if not take:
        return waiting
    take = feed.fill(out, waiting[:take])
    for r, i in zip(st.free(), waiting[:take], strict=False):
        st.sample[r], st.first[r], st.left[r] = i, w - lens[i], int(limits[i]) - 1
    return waiting[take:]


def _compact(out: RefillRun, st: _Rows, compaction: Compaction, capacity: int) -> _Rows:
    """The rows after the compaction the rule asks for (themselves when it does not pay)."""
    live = st.live()
    new_rows = compaction.target(len(st.sample), len(live))
    if new_rows >= len(st.sample):
        return st
    out.programs.add(("compact", len(st.sample), new_rows, capacity))
    keep = live + [live[0]] * (new_rows - len(live))
    return _Rows([st.sample[r] if j < len(live) else -1 for j, r in enumerate(keep)],
                 [st.first[r] for r in keep],
                 [st.left[r] if j < len(live) else 0 for j, r in enumerate(keep)])


def _prefill(out: RefillRun, prompts: dict[int, np.ndarray], rows: int, end: int,
             capacity: int) -> None:
    """The packed prefill of a group without refill (:class:`PackedPrompts`, as the engine
    packs) of ``prompts`` by resident row, ending at slot ``end``; it samples each prompt's
    token 0 from its last position, so no extra position is computed for it."""
    slots: list[np.ndarray | None] = [None] * rows
    for r, p in prompts.items():
        slots[r] = p
    pk = PackedPrompts.build(slots, end, vocab=1, logits_bytes=1 << 62)
    out.prefill_dispatches += 1
    out.computed += pk.positions_computed
    out.needed += pk.prompt_tokens
    out.waste["packing"] += pk.positions_computed - pk.prompt_tokens
    out.programs.add(("prefill", pk.tokens.shape, rows, capacity))


def _decode(out: RefillRun, st: _Rows, k: int, capacity: int) -> None:
    """A decode tile of ``k`` steps at the group's rows and capacity."""
    b = len(st.sample)
    live = st.live()
    emitted = sum(min(k, st.left[r]) for r in live)
    out.decode_dispatches += 1
    out.decode_steps += k
    out.computed += b * k
    out.needed += emitted
    out.waste["tile_overrun"] += len(live) * k - emitted
    out.waste["idle_rows"] += (b - len(live)) * k  # finished, not refilled, or bucket filler
    out.key_slots += b * capacity * k
    out.peak_slots = max(out.peak_slots, b * capacity)
    out.programs.add(("decode", b, capacity))


def padded_groups(prompt_lens: Sequence[int], limits: Sequence[int], *, rows: int) -> RefillRun:
    """The padded baseline at groups of ``rows``: every row padded to the request's longest
    prompt, stores of that plus the longest response (MAX_LEN), each group decoding to its own
    longest row."""
    out = RefillRun()
    p, n = max(prompt_lens), max(map(int, limits))
    for i in range(0, len(limits), rows):
        lens, lims = prompt_lens[i:i + rows], [int(x) for x in limits[i:i + rows]]
        steps = max(lims) - 1
        out.prefill_dispatches += 1
        out.decode_dispatches += steps
        out.decode_steps += steps
        out.computed += rows * p + rows * steps
        out.needed += sum(lens) + sum(x - 1 for x in lims)
        out.waste["prompt_padding"] += len(lims) * p - sum(lens)
        out.waste["idle_rows"] += sum(steps - (x - 1) for x in lims)
        out.waste["row_bucket"] += (rows - len(lims)) * (p + steps)
        out.key_slots += rows * (p + n) * steps
        out.peak_slots = max(out.peak_slots, rows * (p + n))
    out.programs |= {("prefill", rows), ("decode", rows)}
    return out
