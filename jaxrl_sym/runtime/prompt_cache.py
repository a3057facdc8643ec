"""The prompt cache of a refilling group: each distinct prompt runs through the model once; the
rows that take its samples get its keys and values copied in.

Why: a refill used to run a packed prefill of the prompts it refilled. Its packed shape changed
with every refill, and each shape was a compiled program: on the CPU RL step's request that
was many programs, and packing tail and finished rows waiting for a tile's end were a share of
all token positions (the numbers: ``bench/results/cpu/design_notes.md``). And a GRPO prompt
whose 8 samples were refilled at different moments was computed once per refill.

How: the group's samples are cut, in the order the group takes them, into chunks whose
distinct prompts fit a budget of cached tokens (:func:`plan_chunks`); a chunk is one packed
prefill (:func:`~jaxrl_sym.runtime.prefill.cache_prompts`, on the prefill's 16-per-octave
grid) that keeps what every attention node would write — keys, values, positions per packed
token — and each prompt's last-token logits. Filling rows (the first wave and every refill)
is one program per group and chunk shape
(:func:`~jaxrl_sym.runtime.prefill.refill_from_cache`): each store kind's own ``reset`` and
``fill`` write the cached entries at the row's slots, and token 0 is sampled from the cached
logits under the sample's own key.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxrl_sym.runtime.packing import PackedPrompts

CACHE_SHARE = 4
"""The cache holds at most 1/CACHE_SHARE of the group's store slots in tokens (and always one
whole prompt): distinct prompts beyond that are cached chunk by chunk as the group reaches
them. Why: a GRPO step's few distinct prompts fit at once (one chunk, one program), while a
request of hundreds of distinct long prompts does not add more than a quarter to the stores'
memory."""


def cache_budget(prompt_slots: int, rows: int, capacity: int) -> int:
    """Tokens a group's prompt cache may hold (:data:`CACHE_SHARE`): the engine, its replay and
    the generation ledger cut chunks by this one rule."""
    return max(prompt_slots, rows * capacity // CACHE_SHARE)


@dataclass(frozen=True)
class CacheChunk:
    """One packed prefill of distinct prompts, for the consecutive samples it serves.

    samples: the request rows it serves, in the group's order; entry: each one's prompt's batch
    entry in ``packed`` (samples of one prompt share it); packed: the distinct prompts packed.
    """

    samples: tuple[int, ...]
    entry: dict[int, int]
    packed: PackedPrompts
    lens: tuple[int, ...]  # prompt length per entry

    def start(self, sample: int) -> int:
        """Flat index (packed rows x length) of ``sample``'s first prompt token."""
        e = self.entry[sample]
        return int(self.packed.last[e]) - self.lens[e] + 1


def plan_chunks(order: Sequence[int], prompts: Sequence[np.ndarray], budget: int, *,
                vocab: int, logits_bytes: int) -> list[CacheChunk]:
    """Cut the samples ``order`` (request rows) into cache chunks: consecutive samples whose
    distinct prompts total at most ``budget`` tokens (a longer prompt: a chunk of its own).
    A prompt that comes back after its chunk is cached again in the later one."""
    chunks: list[CacheChunk] = []
    i = 0
    while i < len(order):
        seen: dict[bytes, int] = {}
        distinct: list[np.ndarray] = []
        entry: dict[int, int] = {}
        total = 0
        while i < len(order):
            p = np.asarray(prompts[order[i]], np.int32)
            key = p.tobytes()
            if key not in seen:
                if distinct and total + len(p) > budget:
                    break
                seen[key] = len(distinct)
                distinct.append(p)
                total += len(p)
            entry[order[i]] = seen[key]
            i += 1
        pk = PackedPrompts.build(distinct, max(map(len, distinct)), vocab=vocab,
                                 logits_bytes=logits_bytes)
        chunks.append(CacheChunk(tuple(entry), entry, pk, tuple(map(len, distinct))))
    return chunks


class PromptCache:
    """Which chunk is loaded and which samples one refill can take, and the device side: the
    loaded chunk's cached entries, built on demand, and the host arrays a refill program
    takes (see the module docstring). The replay drives the same object without arrays."""

    def __init__(self, chunks: list[CacheChunk]) -> None:
        self.chunks = chunks
        self.at = -1  # the loaded chunk (-1: none yet)
        self.kv: dict[str, Any] | None = None
        self.logits: Any = None
        self.chunk_of = {s: c for c, ch in enumerate(chunks) for s in ch.samples}

    def servable(self, samples: Sequence[int]) -> int:
        """How many of ``samples`` (the next waiting, in order) one refill can take: those in
        the chunk of the first one."""
        c = self.chunk_of[samples[0]]
        return next((n for n, s in enumerate(samples) if self.chunk_of[s] != c), len(samples))

    def needs_load(self, sample: int) -> int | None:
        """The chunk to build before ``sample`` can be refilled (None: it is loaded)."""
        c = self.chunk_of[sample]
        return None if c == self.at else c

    def loaded(self, chunk: int, kv: dict[str, Any], logits: Any) -> None:
        """Chunk ``chunk``'s entries are on device (the previous chunk's are dropped)."""
        self.at, self.kv, self.logits = chunk, kv, logits

    def rows_args(self, rows: int, slots: np.ndarray, samples: Sequence[int]
                  ) -> tuple[np.ndarray, ...]:
        """(start, lens, entry, refilled) per group row for refilling ``slots`` with
        ``samples`` (all in the loaded chunk)."""
        ch = self.chunks[self.at]
        start, lens, entry = (np.zeros((rows,), np.int32) for _ in range(3))
        mask = np.zeros((rows,), bool)
        for r, s in zip(slots, samples, strict=True):
            e = ch.entry[s]
            start[r], lens[r], entry[r], mask[r] = ch.start(s), ch.lens[e], e, True
        return start, lens, entry, mask

    @property
    def nbytes(self) -> int:
        """Device bytes the loaded chunk holds (what the memory meter adds to the stores)."""
        if self.kv is None:
            return 0
        return int(sum(a.nbytes for c in self.kv.values() for a in c.values())
                   + self.logits.nbytes)
