"""Counting what costs: XLA compiles, dispatches, and bytes held — the same accounting for every
system (symbolic runtime, padded baseline, per-shape baseline)."""

from __future__ import annotations

import ctypes
import functools
import os
import resource
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.monitoring as monitoring

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"


class CompileCounter:
    """Counts XLA backend compiles (every one: jitted programs and eager ops alike) while active,
    and programs loaded from the persistent compilation cache instead (``cache_hits``: no
    backend compile happens for them, see :mod:`jaxrl_sym.compile_cache`).

    Uses JAX's public monitoring listener API; the listeners are removed on exit.
    """

    def __init__(self) -> None:
        self.requests = 0  # backend compile requests, cache hits included (JAX times both)
        self.seconds = 0.0
        self.cache_hits = 0

    @property
    def count(self) -> int:
        """Programs XLA actually compiled (requests not served from the persistent cache)."""
        return self.requests - self.cache_hits

    def _listener(self, event: str, duration: float, **_: object) -> None:
        if event == _COMPILE_EVENT:
            self.requests += 1
            self.seconds += duration

    def _hits(self, event: str, **_: object) -> None:
        if event == _CACHE_HIT_EVENT:
            self.cache_hits += 1

    def __enter__(self) -> CompileCounter:
        monitoring.register_event_duration_secs_listener(self._listener)
        monitoring.register_event_listener(self._hits)
        return self

    def __exit__(self, *exc: object) -> None:
        monitoring.unregister_event_duration_listener(self._listener)
        monitoring.unregister_event_listener(self._hits)


def tree_bytes(tree: object) -> int:
    """Bytes of all arrays in a pytree."""
    return sum(int(x.nbytes) for x in jax.tree_util.tree_leaves(tree) if hasattr(x, "nbytes"))


def executable_temp_bytes(compiled: object) -> int:
    """XLA's own temporaries for a compiled executable (0 if the backend does not report)."""
    try:
        ma = compiled.memory_analysis()  # type: ignore[attr-defined]
        return int(ma.temp_size_in_bytes) if ma is not None else 0
    except Exception:  # pragma: no cover - some backends do not implement it
        return 0


@dataclass
class MemoryMeter:
    """Peak of (bytes held in buffers + the running executable's temporaries) over a run.

    On GPU, :func:`device_peak_bytes` (the allocator's own peak) is reported instead when present.
    """

    peak: int = 0
    samples: list[tuple[int, int]] = field(default_factory=list)

    def observe(self, held: int | Iterable[object], temp: int = 0, *, step: int = -1) -> None:
        held_b = held if isinstance(held, int) else sum(tree_bytes(h) for h in held)
        total = held_b + temp
        self.samples.append((step, total))
        self.peak = max(self.peak, total)


def device_memory_limit() -> int | None:
    """The device's memory limit in bytes where the backend reports one (GPU), else None."""
    try:
        stats = jax.devices()[0].memory_stats() or {}
    except Exception:
        return None
    return int(stats["bytes_limit"]) if "bytes_limit" in stats else None


def device_peak_bytes() -> int | None:
    """The device allocator's peak bytes (GPU), or None where the backend keeps no statistics."""
    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:
        return None
    if not stats or "peak_bytes_in_use" not in stats:
        return None
    return int(stats["peak_bytes_in_use"])


def peak_rss_bytes() -> int:
    """This process's peak resident set size (Linux reports KiB)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def rss_bytes() -> int:
    """This process's resident set size now (``/proc/self/statm``; 0 where there is none)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


@functools.cache
def _libc() -> Any:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (macOS, musl): nothing to trim
        return None


def trim_host_heap() -> None:
    """Give freed heap memory back to the OS (glibc's ``malloc_trim``; a no-op elsewhere).

    Why: on CPU the device's buffers are host allocations, and glibc keeps freed ones that sit
    between live ones as part of RSS. Loading a checkpoint and building a trainer frees a model's
    worth of buffers; generation frees its stores; without a trim those pages stay resident under
    the update's own peak. XLA's compiler leaves its working memory the same way; at SmolLM2-135M's
    shape either is a sizeable share of the step's RSS (``bench/results/cpu/pretrained_memory.md``).
    The training loop trims after it builds the trainer and before each update, and
    :class:`~jaxrl_sym.runtime.programs.ProgramCache` after each compile — each call takes
    milliseconds, a compile seconds."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


class RssSampler:
    """The highest RSS seen while the ``with`` block runs, sampled on a thread every
    ``interval`` seconds (and once at each end).

    Why a sampler and not ``ru_maxrss``: the process's all-time peak includes compiles and earlier
    steps; a step's own peak is the highest RSS *during* it. On CPU the device's buffers live in
    host memory, so with large allocations forced to ``mmap`` (``MALLOC_MMAP_THRESHOLD_=65536``:
    a freed buffer leaves RSS at once) the rise over ``before`` follows the live bytes.
    """

    def __init__(self, interval: float = 0.002) -> None:
        self.interval, self.before, self.peak = interval, 0, 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            self._stop.wait(self.interval)

    def __enter__(self) -> RssSampler:
        self.before = self.peak = rss_bytes()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.peak = max(self.peak, rss_bytes())

    @property
    def rise(self) -> int:
        """Peak RSS during the block minus RSS when it began."""
        return self.peak - self.before


WASTE_CAUSES = ("prompt_alignment", "packing", "row_bucket", "finished_rows", "tile_overrun")
KEY_CAUSES = ("prompt_alignment", "capacity", "row_bucket", "finished_rows", "tile_overrun")


def capped_sum(cap: int, first: int, count: int) -> int:
    """``sum(min(cap, first + s) for s in range(count))`` in closed form: the key slots a row's
    ``count`` decode steps read from a store of ``cap`` slots, starting at ``first`` live
    entries. Why: the work log books this per row and store kind after every tile, and the
    loop over steps ran in the host's turn between tiles."""
    if count <= 0:
        return 0
    last = first + count - 1
    if last <= cap:
        return (first + last) * count // 2
    if first >= cap:
        return cap * count
    m = cap - first + 1  # the terms first .. cap, then cap for the rest
    return (first + cap) * m // 2 + cap * (count - m)


def _zeros(causes: tuple[str, ...]) -> dict[str, int]:
    return dict.fromkeys(causes, 0)


@dataclass
class WorkLog:
    """Token positions and decode key slots the decode groups pushed through the model, and why
    each wasted one was.

    Written by the engine while it runs (:class:`jaxrl_sym.runtime.group.loop.DecodeGroup`), not
    replayed: one entry per prefill and per decode dispatch. A token position is one
    (row slot, position) of a program's batch. Needed: each row's prompt tokens and every token
    it emitted after the first (each was fed back once). Every other position is wasted, by cause:

    - ``prompt_alignment``: left padding of a real row in the right-aligned prompt block;
    - ``packing``: the packed prefill's unused tail of its packed rows;
    - ``row_bucket``: filler slots of the row bucket (no request row), prefill and decode;
    - ``finished_rows``: rows that ended but still sit in the bucket until compaction;
    - ``tile_overrun``: steps a row computed inside a decode tile after it ended.

    Key slots: per decode step, row and store, the slots attention runs over
    (``StoreKind.slots``); needed are the keys the row has there (``min(slots, prompt + step)``:
    exact for growing and ring stores, an upper bound inside a block store). Wasted by the same
    causes, with ``prompt_alignment`` the block's left padding a growing store keeps for a
    shorter prompt and ``capacity`` the slots past the last write (a store's headroom, or a
    ring not yet full). Why both: a token position costs a row's whole MLP, a key slot one
    attention read — prompt padding costs the packed prefill nothing but every decode step
    reads it.
    """

    needed: int = 0
    computed: int = 0
    wasted: dict[str, int] = field(default_factory=lambda: _zeros(WASTE_CAUSES))
    key_needed: int = 0
    key_computed: int = 0
    key_wasted: dict[str, int] = field(default_factory=lambda: _zeros(KEY_CAUSES))

    def add(self, cause: str, n: int) -> None:
        self.wasted[cause] += int(n)

    def add_keys(self, cause: str, n: int) -> None:
        self.key_computed += int(n)
        self.key_wasted[cause] += int(n)

    def merge(self, other: WorkLog) -> None:
        self.needed += other.needed
        self.computed += other.computed
        self.key_needed += other.key_needed
        self.key_computed += other.key_computed
        for k, v in other.wasted.items():
            self.wasted[k] += v
        for k, v in other.key_wasted.items():
            self.key_wasted[k] += v

    def report(self) -> dict[str, object]:
        """Fractions of computed positions (and key slots): total waste and per cause (they
        sum to the total)."""
        c, kc = max(1, self.computed), max(1, self.key_computed)
        return {"token_positions": self.computed, "needed_positions": self.needed,
                "waste_fraction": 1.0 - self.needed / c if self.computed else 0.0,
                "waste_by_cause": {k: v / c for k, v in self.wasted.items()},
                "key_slots": self.key_computed, "needed_key_slots": self.key_needed,
                "key_waste_fraction": 1.0 - self.key_needed / kc if self.key_computed else 0.0,
                "key_waste_by_cause": {k: v / kc for k, v in self.key_wasted.items()}}
