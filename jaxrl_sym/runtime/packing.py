"""Packing a group's prompts into rows: host integer code, no JAX (the policy's replay and the
benchmarks price packings with it; :mod:`jaxrl_sym.runtime.prefill` runs them).

Prompts are packed first-fit-decreasing into rows of the longest prompt's bucketed length
(:data:`PACK_ROW`), about ``total / longest`` of them, as the training forward packs sequences;
each token keeps its store slot, right-aligned so that the prompt's last token sits just before
the slot the group's next decode step writes (``end``). A prompt that repeats (RL samples G
responses per prompt) is packed once and its rows copied into the repeats' store rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from jaxrl_sym.runtime.policy import length_bucket

PACK_ROW: int | None = None
"""Target packed row length; None: the longest prompt's (on the length grid). Why that short:
attention inside the prefill is the masked primitive over each packed row, ``L^2`` scores per
row, so a request's attention work is about ``total * L`` — rows of 1,024 made the prefill of
``bench/experiments/rlft_step.py``'s rollout (short prompts, CPU preset) slower than the whole
padded generation; rows of the longest prompt made that request's generation several times
faster (the numbers: ``bench/results/cpu/design_notes.md``). Short prompts still share rows
(first-fit-decreasing). (The scores' memory is bounded apart from the work: a row longer than
:data:`~jaxrl_sym.runtime.prefill.SCORES_BYTES` allows attends in blocks of queries.)"""

PACK_PER_OCTAVE = 16
"""Packed row lengths lie on a geometric grid of 16 steps per octave (tail ≤ 1/16 of a row).
Why this grid: the prefill program is compiled per (rows, length), so the grid bounds the
programs an RL run meets as prompt totals drift (about 16 per doubling of the total), while 4
per octave left a visible share of the suite's realistic request's positions as packing tail
(``bench/results/waste.md``)."""

PACK_MIN = 32
"""Shortest packed row; with the default rows, a request whose prompts total at most this many
tokens packs into one row of it, so such requests share one program instead of compiling one
per total or per row count (both grids are 1 apart there; ``tests/test_policy.py``'s RL steps
with drifting lengths). Above it, the row length follows
the total on the 16-per-octave grid: an RL run whose prompt totals drift meets a bounded set of
prefill programs, about 16 per doubling of the total, each compiled once."""

PACK_TRIES = 4
"""Grid steps a row may lengthen so the prompts fit ``ceil(total / row)`` rows before
one more row is taken: first-fit-decreasing needs some slack, and an extra row left most of a
row empty (the old packing wasted up to half a prefill that way;
``bench/results/cpu/design_notes.md``)."""


def _ffd(order: Sequence[int], size: Sequence[int], length: int
         ) -> tuple[dict[int, tuple[int, int]], list[int]]:
    """First-fit-decreasing of items ``order`` (longest first) into rows of ``length``."""
    fill: list[int] = []
    place: dict[int, tuple[int, int]] = {}
    for i in order:
        n = size[i]
        r = next((r for r, used in enumerate(fill) if used + n <= length), len(fill))
        if r == len(fill):
            fill.append(0)
        place[i] = (r, fill[r])
        fill[r] += n
    return place, fill


def _pack(order: Sequence[int], size: Sequence[int], lens: Sequence[int], pack_row: int,
          per_octave: int = PACK_PER_OCTAVE
          ) -> tuple[int, dict[int, tuple[int, int]], list[int]]:
    """Row length and placement: the shortest grid length (within :data:`PACK_TRIES` steps of
    an even split) at which the prompts fit ``ceil(total / pack_row)`` rows; else more rows."""
    n_rows = -(-sum(lens) // pack_row)
    floor = min(PACK_MIN, pack_row)
    first = length = length_bucket(max(max(lens), -(-sum(lens) // n_rows)),
                                   per_octave=per_octave, minimum=floor)
    for _ in range(PACK_TRIES):
        place, fill = _ffd(order, size, length)
        if len(fill) <= n_rows:
            return length, place, fill
        length = length_bucket(length + 1, per_octave=per_octave, minimum=floor)
    place, fill = _ffd(order, size, first)
    return first, place, fill


@dataclass(frozen=True)
class PackedPrompts:
    """Host arrays of one group's packed prompts (rows a multiple of the chunk's rows).

    tokens/positions ``[Rp, L]``; ``rows`` ``[Rp, L]``: the batch slot each token belongs to
    (-1 = packing tail); ``slots``: its right-aligned store slot ``pcap - len + j``; ``last``
    ``[R]``: flat index (into ``Rp * L``) of each batch slot's last prompt token (0 for filler
    slots, whose sample is never read); ``source`` ``[R]``: the batch slot whose prompt each
    slot repeats (itself unless its prompt repeats an earlier slot's); :attr:`copies` the
    other way round, the slots each packed prompt is written to.
    """

    tokens: np.ndarray
    positions: np.ndarray
    rows: np.ndarray
    slots: np.ndarray
    last: np.ndarray
    source: np.ndarray
    chunk_rows: int  # packed rows per chunk (divides the row count)

    @property
    def positions_computed(self) -> int:
        return int(self.tokens.size)

    @property
    def shared(self) -> bool:
        """Some slot's prompt repeats another's, so its store row is copied, not computed."""
        return bool((self.source != np.arange(len(self.source))).any())

    @property
    def copies(self) -> np.ndarray:
        """``[R, M]`` int32: the batch slots slot ``r``'s packed prompt is written to — ``r``
        and every slot repeating it — padded with ``R`` (out of range: dropped); M is the most
        slots sharing one prompt (1 when none repeats). Why written to every copy rather than
        copied after: a gather of the filled stores' rows is a second copy of every store
        while it runs (compiled for the H100 at Qwen2.5-0.5B's shape it was the prefill's
        whole temporary size: ``bench/results/projection.md``)."""
        r = len(self.source)
        groups = [np.flatnonzero(self.source == i) for i in range(r)]
        out = np.full((r, max(len(g) for g in groups)), r, np.int32)
        for i, g in enumerate(groups):
            out[i, :len(g)] = g
        return out

    @property
    def prompt_tokens(self) -> int:
        """Tokens the model must compute: each distinct prompt once."""
        return int((self.rows >= 0).sum())

    @staticmethod
    def build(prompts: Sequence[np.ndarray | None], pcap: int, *, vocab: int,
              logits_bytes: int, pack_row: int | None = PACK_ROW,
              per_octave: int = PACK_PER_OCTAVE) -> PackedPrompts:
        """Pack the prompts of batch slots ``0..R-1`` (None: a filler slot); chunks of packed
        rows keep their fp32 logits under ``logits_bytes``. Row length and count are rounded up
        on a grid of ``per_octave`` steps per octave (empty rows are packing tail), so requests
        whose prompt totals drift share prefill programs. ``pcap``: the slot each prompt ends
        just before (the prompt block's width, or a refill's write slot).

        Identical prompts (a GRPO group's G samples of one prompt) are packed once: the copies'
        ``source`` names the first slot holding that prompt, their ``last`` its last token, so
        they sample from the same logits with their own row's random stream."""
        source = _first_copies(prompts)
        prompts = [p if source[i] == i else None for i, p in enumerate(prompts)]
        lens = [len(p) for p in prompts if p is not None]
        order = sorted((i for i, p in enumerate(prompts) if p is not None),
                       key=lambda i: -len(prompts[i]))
        # default rows: the longest prompt's; a request of at most PACK_MIN tokens: one row
        row = pack_row or (PACK_MIN if sum(lens) <= PACK_MIN else max(lens))
        length, place, fill = _pack(order, [len(p) if p is not None else 0 for p in prompts],
                                    lens, row, per_octave)
        used = length_bucket(len(fill), per_octave=per_octave, minimum=1)
        g = max(1, min(logits_bytes // (4 * length * vocab), used))
        n_rows = -(-used // g) * g
        tokens = np.zeros((n_rows, length), np.int32)
        positions = np.full((n_rows, length), -1, np.int32)
        rows = np.full((n_rows, length), -1, np.int32)
        slots = np.full((n_rows, length), -1, np.int32)
        last = np.zeros((len(prompts),), np.int32)
        for i, (r, s) in place.items():
            p = prompts[i]
            n = len(p)
            tokens[r, s:s + n] = p
            positions[r, s:s + n] = np.arange(n)
            rows[r, s:s + n] = i
            slots[r, s:s + n] = pcap - n + np.arange(n)
            last[i] = r * length + s + n - 1
        last = last[source]
        return PackedPrompts(tokens, positions, rows, slots, last, source, g)


def _first_copies(prompts: Sequence[np.ndarray | None]) -> np.ndarray:
    """For each slot, the first slot whose prompt has the same tokens (itself if none; filler
    slots are their own)."""
    first: dict[bytes, int] = {}
    source = np.arange(len(prompts), dtype=np.int32)
    for i, p in enumerate(prompts):
        if p is not None:
            source[i] = first.setdefault(np.asarray(p, np.int32).tobytes(), i)
    return source
