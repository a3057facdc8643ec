"""A decode group's per-row host state as one immutable value.

Why one value: the group's rows carry seven facts each (which request row sits in the slot,
its token limit, whether it ended, the token it feeds back next, its first position, the group
steps before its sample began, the id its sampling draws with). Kept as separate arrays, every
change of the rows — a compaction, a refill, the tokens a tile emitted — rebuilt them one by one
and repeated the filler rules at each site. Here a compaction is one :meth:`RowState.take`, a
refill one :meth:`RowState.seat`, a read-back one :meth:`RowState.emitted`, each returning a new
value; the arrays are read-only, so a change made in place fails instead of drifting.

Plain NumPy: the device copies the decode programs take (:class:`~jaxrl_sym.runtime.programs.
DecodeRows`: first positions, row ids, offsets, last steps) are made from it by
:meth:`RowState.decode_rows`, and put on the device by the group
(:mod:`jaxrl_sym.runtime.group.loop`) once per state value.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from jaxrl_sym.runtime.programs import DEAD_POSITION, DecodeRows


@dataclass(frozen=True)
class RowState:
    """Each batch slot of a decode group, one entry per slot.

    ids: the request row in the slot (-1: a filler or a free row); limits: its most tokens;
    done: it ended (a filler or free row is done); fed: its last sampled token (its next input);
    pos0: the position of its response's token 0 (:data:`DEAD_POSITION` for a filler); off: the
    group's decode steps before its sample began (a refilled row starts late); row_id: the id its
    sampling draws with (a filler repeats the row it copies, as the stores do).
    """

    ids: np.ndarray
    limits: np.ndarray
    done: np.ndarray
    fed: np.ndarray
    pos0: np.ndarray
    off: np.ndarray
    row_id: np.ndarray

    DTYPES: ClassVar[dict[str, type]] = {
        "ids": np.int64, "limits": np.int64, "done": np.bool_, "fed": np.int32,
        "pos0": np.int32, "off": np.int32, "row_id": np.int32}
    # what a filler slot holds after a compaction; limits, fed and row_id: the repeated row's
    FILLER: ClassVar[dict[str, int | bool]] = {"ids": -1, "done": True, "pos0": DEAD_POSITION,
                                               "off": 0}

    def __post_init__(self) -> None:
        n = None
        for f in dataclasses.fields(self):
            a = getattr(self, f.name)
            kept = isinstance(a, np.ndarray) and a.dtype == self.DTYPES[f.name] \
                and not a.flags.writeable  # another RowState's array: shared, never copied
            if not kept:
                a = np.array(a, self.DTYPES[f.name])  # a copy: never a view of the caller's
                a.setflags(write=False)
            if a.ndim != 1 or (n is not None and len(a) != n):
                raise ValueError(f"RowState.{f.name}: one entry per slot, got shape {a.shape}")
            n = len(a)
            object.__setattr__(self, f.name, a)

    @classmethod
    def empty(cls, rows: int) -> RowState:
        """``rows`` free slots (every one done, none seated)."""
        return cls(ids=np.full((rows,), -1), limits=np.zeros((rows,)), done=np.ones((rows,)),
                   fed=np.zeros((rows,)), pos0=np.full((rows,), DEAD_POSITION),
                   off=np.zeros((rows,)), row_id=np.zeros((rows,)))

    def __len__(self) -> int:
        return len(self.ids)

    def _with(self, **arrays: np.ndarray) -> RowState:
        """A new value with ``arrays`` (fresh arrays this class made, frozen here so the new
        value keeps them instead of copying them again)."""
        for a in arrays.values():
            a.setflags(write=False)
        return dataclasses.replace(self, **arrays)

    def seat(self, slots: Sequence[int] | np.ndarray, samples: Sequence[int],
             limits: Sequence[int], pos0: Sequence[int], off: int) -> RowState:
        """Request rows ``samples`` seated in ``slots``, live, with their ``limits`` and first
        positions, starting after ``off`` group steps (0 at the prefill; a refill's step)."""
        slots = np.asarray(slots, np.int64)
        new = {f.name: getattr(self, f.name).copy() for f in dataclasses.fields(self)}
        new["ids"][slots], new["limits"][slots] = samples, limits
        new["done"][slots], new["pos0"][slots], new["off"][slots] = False, pos0, off
        new["row_id"][slots] = samples
        return self._with(**new)

    def emitted(self, slots: Sequence[int] | np.ndarray, tokens: Sequence[int],
                ended: Sequence[bool]) -> RowState:
        """Rows ``slots`` sampled ``tokens`` (their next inputs); those ``ended`` are done."""
        slots = np.asarray(slots, np.int64)
        fed, done = self.fed.copy(), self.done.copy()
        fed[slots] = tokens
        done[slots] |= np.asarray(ended, bool)
        return self._with(fed=fed, done=done)

    def end(self, slots: Sequence[int] | np.ndarray) -> RowState:
        """Rows ``slots`` ended (their tokens were kept elsewhere: a verify tile's)."""
        done = self.done.copy()
        done[np.asarray(slots, np.int64)] = True
        return self._with(done=done)

    def take(self, keep: np.ndarray, filler: np.ndarray) -> RowState:
        """The slots ``keep`` names, in its order (a compaction); slots marked ``filler`` take
        the filler values (:data:`FILLER`), the rest is the kept row's."""
        out = {}
        for f in dataclasses.fields(self):
            a = getattr(self, f.name)[keep]
            out[f.name] = np.where(filler, self.FILLER[f.name], a) if f.name in self.FILLER else a
        return self._with(**out)

    def live(self) -> np.ndarray:
        """The slots whose rows have not ended."""
        return np.nonzero(~self.done)[0]

    def last_steps(self) -> np.ndarray:
        """Each row's last group step (its last response index + ``off``); -1: ended or a
        filler (the tile program's per-row stop)."""
        return np.where(self.done, -1, self.off + self.limits - 1).astype(np.int32)

    def decode_rows(self) -> DecodeRows:
        """What the decode programs take of this state (host arrays; the group puts them on
        its device once per state value)."""
        return DecodeRows(self.pos0, self.row_id, self.off, self.last_steps())
