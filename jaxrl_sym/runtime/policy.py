"""The host loop's decisions, as pure functions of integers: one copy, run and replayed.

What a generation request costs on the symbolic runtime is decided here — how rows are grouped
into aligned microbatches, each group's row bucket and prompt block, the initial capacity of its
growing stores, and before every dispatch: how many decode steps it tiles, which slot it writes,
whether finished rows are compacted away and whether the growing stores grow. The engine's
decode group (:mod:`jaxrl_sym.runtime.group.loop`) executes these decisions on device arrays;
``bench/lib/suite/suite_padding.py`` replays the very same functions on lengths alone to count
the work each request costs. Keeping one copy is the point: a benchmark that re-implements a
policy drifts from it (it did, when decode tiles changed growth look-ahead).

No sympy and no JAX here: the growing stores' live-slot count arrives as a plain callable
compiled once by the planner (:func:`jaxrl_sym.passes.storage.live_count_fn`).
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from jaxrl_sym.errors import InputError

# The engine's defaults, read by ``SymbolicLM``'s signature and by :func:`replay` alike.
DEFAULT_DECODE_TILE = 8  # decode steps per dispatch, after any dispatch in which a row ended
DEFAULT_MAX_DECODE_TILE = 64  # the most a tile grows to while no row ends (see Tiling)
DEFAULT_MIN_CAPACITY = 128  # initial slots of a growing store
DEFAULT_MAX_PAD_FRACTION = 1.0
"""Prompt padding a microbatch may add, as a share of its work; 1.0: one group (up to
``microbatch_rows``). Why one group: the packed prefill computes no prompt padding, so padding
costs only decode key slots, while every extra group costs its own set of compiled programs and
decodes after the previous one at a smaller batch: on the suite's realistic request, groups
at 0.1 compiled more than twice the programs of one group, and an equal-length GRPO step
generated faster as one group (``bench/experiments/waste.py``; the numbers:
``bench/results/cpu/design_notes.md``). The block prefill computes the padding: pass 0.1 with
``prefill='block'``."""


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def capacity_grid(n: int) -> int:
    """The smallest growing-store capacity holding ``n`` slots: a power of two or three
    quarters of one (…, 512, 768, 1024, 1536, …), so a store is at most 1.5x (not 2x) what it
    holds. Why not powers of two: at the GPU preset (Qwen2.5-0.5B, 128 rows, prompts up to 451 in
    a 512-slot block) the stores started at 1,024 slots for every row, half of them unused until
    step 512, and were half of sym's generation peak projected for the H100
    (``bench/results/projection.md``); at 768 they are 0.75x. Each extra capacity is one more
    decode program per row bucket that reaches it (one at that preset). It is the length grid at
    two steps per octave."""
    return length_bucket(n, per_octave=2, minimum=1)


def initial_capacity(prompt_slots: int, min_capacity: int, total: int) -> int:
    """A group's growing stores at its prefill: the grid's capacity just above the prompt
    block (at least ``min_capacity``, at most ``total``)."""
    return min(max(min_capacity, capacity_grid(prompt_slots + 1)), total)


def grown_capacity(capacity: int, need: int, bound: int) -> int:
    """The capacity after a growth that must hold ``need`` slots: the grid's next capacity (or
    the one holding ``need``, if larger), never past ``bound`` unless ``need`` is."""
    return min(max(capacity_grid(capacity + 1), capacity_grid(need)), max(bound, need))


def length_bucket(n: int, *, per_octave: int = 4, minimum: int = 8) -> int:
    """Round up to a geometric grid with ``per_octave`` steps (≤ 1/per_octave waste)."""
    if n <= minimum:
        return minimum
    top = next_pow2(n)
    step = max(1, top // (2 * per_octave))
    return -(-n // step) * step


FINE_ROW_FROM = 4096
"""Packed training rows longer than this use a finer grid (:func:`packed_row_len`)."""

FINE_ROW_PER_OCTAVE = 16
"""Steps per octave of the packed-row grid above :data:`FINE_ROW_FROM` (1,024 slots at 16k-32k)."""


def packed_row_len(n: int) -> int:
    """Slots of a packed training row (the update's and the overlapped reference's) holding a
    sequence of ``n`` tokens: at least 64 and ``n``, on :func:`length_bucket`'s grid — four
    steps per octave up to :data:`FINE_ROW_FROM`, :data:`FINE_ROW_PER_OCTAVE` above it.

    Why finer above 4k: the update's peak grows with its row (at reasoning lengths, more than
    linearly), and a quarter octave there is thousands of slots. At cap 16,384 the longest
    sample (16,826 tokens) got a 20,480-slot row; padded's row is the exact 16,826, and sym's
    update peak was 1.4x padded's (``bench/results/projection/reasoning/README.md``); now the
    row is 17,408. At cap 4,096 the one 4,606-token sample got 5,120 slots, and sym's update
    rose above padded's by the square of 5,120 / 4,606 (``bench/results/cpu/reasoning_measured``);
    now 4,608. Why not finer everywhere: every distinct row length is one more
    update and reference program to compile, and at the 1k workloads (rows ≤ 4k) nothing
    changes. A run compiles at most 4 row lengths per octave up to 4k and 16 per octave above —
    in practice one or two at a cap, where the longest row is the longest prompt plus the cap."""
    n = max(int(n), 64)
    if n <= FINE_ROW_FROM:
        return length_bucket(n)
    return length_bucket(n, per_octave=FINE_ROW_PER_OCTAVE)


def row_bucket(n: int, multiple: int = 1) -> int:
    """Rows a group's programs run at for ``n`` rows: exact up to 8, then a geometric grid with
    four steps per octave (9-16 by 2, 17-32 by 4, …, 65-128 by 16), so filler rows stay under
    1/8 of a bucket. Powers of two left up to half the bucket as filler: on the suite's
    realistic lengths, a large share of the runtime's token positions (the engine's own log;
    ``bench/results/waste.md``).

    ``multiple``: on a device mesh, the devices the data axes split rows over — the bucket is
    rounded up to a multiple of them (the extra rows are fillers, as for any bucket), so a
    group's stores split evenly instead of running replicated."""
    b = length_bucket(n, per_octave=4, minimum=1)
    return -(-b // multiple) * multiple


COMPACT_AT = 0.75
"""Compact finished rows away once the live rows fit a bucket at most this share of the current
one: each compaction costs a program (and a new decode program per bucket), so it must pay.
Lower (``SymbolicLM(model, EngineOptions(compact_at=0.5))``, ``0.25``) compiles fewer programs
and computes more finished rows: on the suite's realistic request, 0.75 / 0.5 / 0.25 trade
compiles against waste (table in ``bench/results/waste.md``, ``python -m bench waste``)."""

COMPACT_MIN_ROWS = 8
"""No compaction goes below this many rows. Why: below it a decode step costs about the same
whatever the rows, while every bucket is one more decode program to compile. On the CPU step
model a decode step below 8 rows cost little more than at one row and an order of magnitude
less than at 128, and the first GRPO generation compiled three more buckets below 8 rows, whose
compiles cost far more than the decode time they saved (the numbers:
``bench/results/cpu/design_notes.md``). On a GPU decode is bound by reading the weights and
the flat range is wider: :data:`GPU_COMPACTION` raises it there.
(``SymbolicLM(model, EngineOptions(compact_min_rows=...))``)."""

GPU_COMPACTION = (0.5, 16, True)
"""``(share, min_rows, early)`` of compaction on a GPU (``EngineOptions`` left at None). Why
early there: a tile tests its rows once per ``check`` steps on a GPU (each test a host
round-trip), and a tile that ends itself at the compaction's step keeps tiles long while rows
end (:attr:`Tiling.shrink`): the RL step's generation at the H100 shape runs 19 tiles, not 74,
at the same buckets and row-steps (share 0.5 visits each power-of-two bucket either way). Why
coarser: a decode step's time on the H100 is its ~400-500 kernels at ~5.5 µs each, nearly the
same at 128 rows as at 16, so dropping finished rows saves little, while every bucket is a
decode program and a compaction program to compile (~8 s each on the H100). The dispatch
ledger, compiled for the H100 at the RL step's request (pallas backend): 21 programs at
(0.75, 8), 9 at (0.5, 16), for 1.8% more projected generation
(``bench/results/projection/dispatch/README.md``)."""

CPU_COMPACTION = (COMPACT_AT, COMPACT_MIN_ROWS, False)
"""``(share, min_rows, early)`` of compaction elsewhere (see :class:`Compaction` for ``early``)."""


@dataclass(frozen=True)
class Tiling:
    """How many decode steps the next dispatch of a group runs (one device→host sync each).

    ``base`` steps after a dispatch in which some row ended (and for the first); twice the
    previous tile, up to ``max``, after one in which none did. Why: a row that ends inside a
    tile computes its remaining steps for nothing (tile overrun), so while rows are ending the
    tile stays short; when none end — no EOS in the request, or a long tail of live rows — the
    host sync per tile is pure cost, and the tile grows. On the CPU window decode
    (``bench/experiments/tunix_window.py``, 8 rows, no EOS) a tile-8 generation spent a sixth of
    its time per token on the host's syncs, and tile 32 ran at the device's own step time (the
    numbers: ``bench/results/tunix.md``). One decode program serves every tile length up to
    ``max`` (its step count is a run-time argument), so growing costs no compile.

    ``check``: steps between the tile program's tests of its live rows (a tile runs whole
    checks). On a GPU a loop test XLA cannot count is a device→host round-trip, so the engine
    tests once per ``base`` steps there; elsewhere (XLA:CPU runs the loop test on the host
    thread that drives the loop, a TPU on the device) a test costs nothing, and testing every
    step runs no step past a row's end (:meth:`~jaxrl_sym.runtime.options.EngineOptions.tiling`).

    ``shrink``: after a tile in which a row ended, the next is ``base`` steps. Off where the
    tile program itself ends at the step the host has work — compaction with ``early``
    (:meth:`Compaction.stop_at`), refill's free rows, a ``stop_when`` bound: there a short tile
    would only add host round-trips and dispatches, and rows ended inside a long one run at the
    bucket they would have run at anyway. What it costs: finished rows reach ``on_finished``
    and the progress callback at the tile's end, up to ``max`` steps later.
    """

    base: int = DEFAULT_DECODE_TILE
    max: int = DEFAULT_MAX_DECODE_TILE
    check: int = 1
    shrink: bool = True

    def first(self) -> int:
        return self.base

    def after(self, previous: int, ended: bool) -> int:
        """The tile that follows a dispatch of ``previous`` steps in which a row ``ended``."""
        if ended and self.shrink:
            return self.base
        return min(self.max, max(self.base, 2 * previous))

    def whole(self, steps: int) -> int:
        """The steps a tile asked for ``steps`` runs: whole checks of ``check`` steps.

        Why: the tile program tests whether its rows are still live once per ``check`` steps,
        between inner loops of ``check`` steps with a static trip count
        (``StepBuilder.decode_tile``). On a GPU a loop test XLA cannot count is a device→host
        round-trip (``xla/backends/gpu/runtime/while_thunk.cc``), so a per-step test cost one
        host sync per generated token; a static inner loop costs none. Steps past a row's end
        are discarded by the host and counted as ``tile_overrun``."""
        return -(-max(1, steps) // self.check) * self.check

    def ran(self, steps: int, left: Sequence[int], stop: int) -> int:
        """The steps a tile of ``steps`` (whole checks) runs when its live rows have ``left``
        tokens still to emit: it ends at the first check where at most ``stop`` of them are
        live (the device's early stop, tested every ``check`` steps), else after ``steps``."""
        return next(j for j in range(self.check, steps + self.check, self.check)
                    if j >= steps or sum(x > j for x in left) <= stop)


@dataclass(frozen=True)
class Compaction:
    """When a decode group drops its finished rows (the engine's and the replay's one rule).

    share: compact once the live rows fit a bucket at most this share of the current one
      (:data:`COMPACT_AT`); min_rows: never to a bucket below this (:data:`COMPACT_MIN_ROWS`);
      early: end a decode tile at the step the live rows fall to the share (:meth:`stop_at`),
      so the compaction runs then rather than at the tile's end.

    Why ``early`` is off by default on the CPU (on a GPU it is on: :data:`GPU_COMPACTION`):
    compacting at the threshold step lands on every bucket the share allows, where a tile's
    end usually jumps past some. On the CPU step's generation it
    cut the token-position waste by about a third and a call's time a little, but compiled
    more programs, seconds more on the first call of a process with a cold cache (the
    numbers: ``bench/results/waste.md``).
    Long RL runs with a warm persistent cache want it on; a first call against the clock not.
    """

    share: float = COMPACT_AT
    min_rows: int = COMPACT_MIN_ROWS

    @classmethod
    def default(cls, platform: str, share: float | None = None, min_rows: int | None = None,
                early: bool | None = None) -> Compaction:
        """The rule on ``platform`` (``jax.Device.platform``), each knob given or (None) the
        platform's: :data:`GPU_COMPACTION` on a GPU, :data:`CPU_COMPACTION` elsewhere."""
        base = GPU_COMPACTION if platform == "gpu" else CPU_COMPACTION
        return cls(*(b if v is None else v for b, v in zip(base, (share, min_rows, early),
                                                          strict=True)))
    early: bool = False

    def stop_at(self, rows: int, multiple: int = 1) -> int:
        """The most live rows at which a group at ``rows`` would compact (0: it never does).
        With ``early``, a decode tile ends once its live rows fall to this, so the compaction
        runs at the step it starts to pay instead of at the tile's end (the rows that ended
        meanwhile would be computed for nothing). 0 unless ``early``."""
        if not self.early:
            return 0
        # compacting pays for the fewest live rows first, then never again (the bucket only
        # grows with them): bisect for the first count where it does not
        first_not = bisect.bisect_left(range(rows), True,
                                       key=lambda n: self.target(rows, n, multiple) >= rows)
        return max(first_not - 1, 0)

    def target(self, rows: int, live: int, multiple: int = 1) -> int:
        """The row bucket a group at ``rows`` runs at next with ``live`` unfinished rows
        (``rows`` itself when compacting does not pay)."""
        new = max(row_bucket(live, multiple), row_bucket(self.min_rows, multiple))
        return new if rows > 1 and new <= self.share * rows else rows


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


@dataclass(frozen=True)
class GroupShape:
    """The static geometry of one microbatch.

    rows: row bucket (:func:`row_bucket` of the group's rows; compaction only lowers it).
    prompt_slots: width of the right-aligned prompt block (bucketed longest prompt).
    total: slots the group can ever need (prompt block + the longest row limit).
    capacity: initial capacity of its growing stores.
    """

    rows: int
    prompt_slots: int
    total: int
    capacity: int

    @staticmethod
    def plan(prompt_lens: Sequence[int], limits: Sequence[int], *, min_capacity: int,
             max_len: int | None = None, row_multiple: int = 1) -> GroupShape:
        """Geometry of a group with these prompt lengths and response limits.

        The growing stores start at the grid's capacity above the prompt block
        (:func:`initial_capacity`). With a user ``max_len`` (prompt + response of
        every row), stores are fixed at ``max_len`` plus the largest left padding — the
        shortest prompt's, whose row starts furthest left — so no row's slots run past them.
        """
        plen = max(prompt_lens)
        pcap = length_bucket(plen)
        total = pcap + int(max(limits))
        cap = initial_capacity(pcap, min_capacity, total)
        if max_len is not None:
            over = [i for i, (n, m) in enumerate(zip(prompt_lens, limits, strict=True))
                    if n + int(m) > max_len]
            if over:
                i = over[0]
                raise InputError(
                    f"max_len={max_len}: row {i} needs {prompt_lens[i]} prompt + {int(limits[i])} "
                    f"new tokens = {prompt_lens[i] + int(limits[i])} slots ({len(over)} rows "
                    "exceed it); raise EngineOptions.max_len or lower max_new_tokens")
            cap = max_len + (pcap - min(prompt_lens))
        return GroupShape(row_bucket(len(prompt_lens), row_multiple), pcap, total, cap)


@dataclass(frozen=True)
class Dispatch:
    """One decode dispatch as the policy decided it.

    step: the first decode step it runs (1-based; the prefill produced token 0).
    tile: decode steps in this dispatch (one program, one device→host sync); the steps it ran,
      once it has (the program ends early when its live rows fall to ``stop``).
    write: slot of the token fed back at ``step``.
    rows: the row bucket it runs at (after any compaction).
    capacity: the growing stores' capacity it runs at (after any growth).
    stop: the tile ends once at most this many of its rows are live (0: when all have
      ended; :meth:`Compaction.stop_at`).
    """

    step: int
    tile: int
    write: int
    rows: int
    capacity: int
    stop: int = 0

    def ran(self, steps: int) -> Dispatch:
        """This dispatch as it ran: ``steps`` steps."""
        return dataclasses.replace(self, tile=steps)


def next_dispatch(shape: GroupShape, *, steps_done: int, rows: int, capacity: int, live: int,
                  remaining: int, tile: int, need: Callable[[int], int] | None,
                  row_multiple: int = 1, compaction: Compaction = Compaction(),
                  grow_with_compaction: bool = True, check: int = 1) -> Dispatch:
    """Decide the next decode dispatch of a group.

    steps_done: decode steps dispatched so far; rows / capacity: the current row bucket and
    growing capacity; live: rows not finished; remaining: the most tokens any live row may still
    emit; tile: the steps :class:`Tiling` asks for; need(t): live slots of the growing stores
    after writing slot t (None when the model has no growing store); row_multiple: row buckets
    are multiples of this (see :func:`row_bucket`); compaction: when finished rows are dropped.

    The dispatch runs ``min(tile, remaining)`` steps rounded up to whole checks of ``check``
    steps (:meth:`Tiling.whole`); the stores hold every write of a row still within its limit,
    and none of those lies past ``total`` (steps past every live row's limit write only rows
    whose tokens are discarded). Finished rows are dropped once the live rows fit a
    bucket of at most ``compaction.share`` of the current one and no smaller than
    ``compaction.min_rows`` (the bucket shrinks to it). Growing stores double — or jump to what
    the tile's last write needs — when that write would not fit, capped at ``total``.

    A compaction compiles a decode program for the new bucket anyway, so the growing stores
    grow to ``total`` with it when that holds no more slots than the stores did before it:
    a later growth would compile one more decode program, for the same rows
    (``grow_with_compaction=False``: not; the speculative group's stores grow only as its
    verify tiles need, as they were measured — ``bench/experiments/speculative.py``).

    Speculative verify tiles ask in the same terms: ``steps_done`` is the longest live row's
    last response index, ``tile`` (= ``remaining``) the slots a tile may write past it.
    """
    step = steps_done + 1
    write = shape.prompt_slots + step - 1
    asked = max(1, min(tile, remaining))
    k = -(-asked // check) * check
    new = compaction.target(rows, live, row_multiple)
    if new < rows:
        if grow_with_compaction and need is not None and capacity < shape.total \
                and new * shape.total <= rows * capacity:
            capacity = shape.total
        rows = new
    if need is not None:
        n = need(write + min(k, remaining) - 1)
        if n > capacity:
            capacity = min(grown_capacity(capacity, n, shape.total), shape.total)
    return Dispatch(step, k, write, rows, capacity, compaction.stop_at(rows, row_multiple))


@dataclass(frozen=True)
class Cursor:
    """Where a decode group stands between dispatches, advanced by the same two functions in
    the engine (:class:`~jaxrl_sym.runtime.group.loop.DecodeGroup`) and in :func:`replay_group`.

    rows / capacity: the row bucket and growing capacity it runs at; tiling: how its tiles
    grow; steps_done: decode steps run so far; tile: the steps :class:`Tiling` asks for next;
    stop_live: > 0 while its tiles end on device once the live rows fall to it (a ``stop_when``
    rule's bound: until then tiles grow as usual, after it they stay at the base).
    """

    rows: int
    capacity: int
    tiling: Tiling
    steps_done: int = 0
    tile: int = 0
    stop_live: int = 0

    @classmethod
    def start(cls, shape: GroupShape, tiling: Tiling) -> Cursor:
        return cls(shape.rows, shape.capacity, tiling, 0, tiling.first())

    def ask(self, shape: GroupShape, *, live: int, remaining: int,
            need: Callable[[int], int] | None, row_multiple: int = 1,
            compaction: Compaction = Compaction(), **over: int | bool) -> Dispatch:
        """The next dispatch from here (:func:`next_dispatch`); ``over``: its other keywords
        (``grow_with_compaction``, and ``steps_done``/``tile``/``check`` where a speculative
        group asks in its own terms)."""
        at = {"steps_done": self.steps_done, "tile": self.tile, "check": self.tiling.check}
        return next_dispatch(shape, rows=self.rows, capacity=self.capacity, live=live,
                             remaining=remaining, need=need, row_multiple=row_multiple,
                             compaction=compaction, **(at | over))

    def bounded(self, stop_live: int | None) -> Cursor:
        """Under a ``stop_when`` rule: with its ``stop_live`` bound, tiles grow as usual and
        end on device once the live rows fall to it (0: the rule cannot hold before the group
        ends); without one (None), tiles stay at the base, so the rule is asked every base
        tile."""
        if stop_live is None:
            return dataclasses.replace(self, stop_live=0, tiling=dataclasses.replace(
                self.tiling, max=self.tiling.base))
        return dataclasses.replace(self, stop_live=int(stop_live))

    def settle(self, live: int) -> Cursor:
        """Past a ``stop_live`` bound (``live`` rows left, at most it): tiles stay at the base."""
        if not self.stop_live or live > self.stop_live:
            return self
        return self.bounded(None)

    def ran(self, d: Dispatch, *, ended: bool, live: int) -> Cursor:
        """After ``d`` ran (``d.tile``: the steps it ran), ``ended``: a row ended in it,
        ``live``: rows left."""
        at = dataclasses.replace(self.settle(live), rows=d.rows, capacity=d.capacity,
                                 steps_done=d.step + d.tile - 1)
        return dataclasses.replace(at, tile=at.tiling.after(d.tile, ended))


def replay(prompt_lens: Sequence[int], limits: Sequence[int], *,
           min_capacity: int = DEFAULT_MIN_CAPACITY,
           max_pad_fraction: float = DEFAULT_MAX_PAD_FRACTION, tiling: Tiling = Tiling(),
           need: Callable[[int], int] | None = lambda t: t + 1,
           microbatch_rows: int | None = None, compaction: Compaction = Compaction(),
           ) -> list[tuple[GroupShape, list[Dispatch]]]:
    """The dispatches a request costs when every row runs to its limit (no EOS), per group
    (:func:`replay_group` for each of its aligned microbatches)."""
    out = []
    for group in microbatches(prompt_lens, limits, max_rows=microbatch_rows,
                              max_pad_fraction=max_pad_fraction):
        shape = GroupShape.plan([prompt_lens[i] for i in group], [limits[i] for i in group],
                                min_capacity=min_capacity)
        out.append((shape, replay_group(shape, [limits[i] for i in group], tiling=tiling,
                                        need=need, compaction=compaction)))
    return out


def replay_group(shape: GroupShape, limits: Sequence[int], *, tiling: Tiling = Tiling(),
                 need: Callable[[int], int] | None = lambda t: t + 1, row_multiple: int = 1,
                 compaction: Compaction = Compaction()) -> list[Dispatch]:
    """The dispatches one group of ``shape`` costs when each row runs to its limit (no EOS).

    The same functions the engine calls, driven by row counters instead of device outputs: a row
    that has emitted ``e`` of its ``limit`` tokens emits ``min(tile, limit - e)`` more per
    dispatch. ``need`` defaults to the growing store's live count (t + 1). The engine reads it
    too, to compile a call's decode programs ahead (``EngineOptions.compile_threads``)."""
    left = [int(n) - 1 for n in limits]  # tokens still to emit after the prefill's
    at, ds = Cursor.start(shape, tiling), []
    while any(x > 0 for x in left):
        live = [x for x in left if x > 0]
        d = at.ask(shape, live=len(live), remaining=max(live), need=need,
                   row_multiple=row_multiple, compaction=compaction)
        d = d.ran(tiling.ran(d.tile, live, d.stop))  # the device's early stop
        ds.append(d)
        left = [max(0, x - d.tile) for x in left]
        now = sum(x > 0 for x in left)
        at = at.ran(d, ended=now < len(live), live=now)
    return ds
