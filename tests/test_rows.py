"""A decode group's state as values: :class:`RowState` and :class:`Cursor` against naive loops.

The oracle for each change of the rows is a per-slot Python loop over plain lists, written here
from the rules the engine documents (a filler is done, has no request row, a dead position and
no offset, and repeats the kept row's limit, token and row id); the cursor's against the tiling
rule spelled out by hand. The engine's own use of both is checked by
``tests/test_policy.py::test_engine_dispatches_what_the_policy_replays`` (dispatches equal to
the replay's) and the token oracles of the runtime tests.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from jaxrl_sym.runtime.group.rows import RowState
from jaxrl_sym.runtime.policy import Cursor, Dispatch, GroupShape, Tiling
from jaxrl_sym.runtime.programs import DEAD_POSITION


@st.composite
def seated(draw: st.DrawFn) -> tuple[RowState, list[dict]]:
    """A RowState with some slots seated and some ended, and the same rows as plain dicts."""
    b = draw(st.integers(1, 9))
    slots = draw(st.lists(st.integers(0, b - 1), unique=True, max_size=b))
    rows = [dict(ids=-1, limits=0, done=True, fed=0, pos0=DEAD_POSITION, off=0, row_id=0)
            for _ in range(b)]
    samples = draw(st.lists(st.integers(0, 50), min_size=len(slots), max_size=len(slots),
                            unique=True))
    limits = draw(st.lists(st.integers(1, 30), min_size=len(slots), max_size=len(slots)))
    pos0 = draw(st.lists(st.integers(1, 20), min_size=len(slots), max_size=len(slots)))
    off = draw(st.integers(0, 5))
    state = RowState.empty(b).seat(slots, samples, limits, pos0, off)
    for s, i, n, p in zip(slots, samples, limits, pos0, strict=True):
        rows[s].update(ids=i, limits=n, done=False, pos0=p, off=off, row_id=i)
    toks = draw(st.lists(st.integers(0, 99), min_size=len(slots), max_size=len(slots)))
    ended = draw(st.lists(st.booleans(), min_size=len(slots), max_size=len(slots)))
    state = state.emitted(slots, toks, ended)
    for s, t, e in zip(slots, toks, ended, strict=True):
        rows[s]["fed"] = t
        rows[s]["done"] = rows[s]["done"] or e
    return state, rows


def as_rows(state: RowState) -> list[dict]:
    names = ("ids", "limits", "done", "fed", "pos0", "off", "row_id")
    return [{k: getattr(state, k)[s].item() for k in names} for s in range(len(state))]


@given(seated())
def test_seat_and_emitted_match_a_per_slot_loop(case: tuple[RowState, list[dict]]) -> None:
    state, rows = case
    assert as_rows(state) == rows
    assert list(state.live()) == [s for s, r in enumerate(rows) if not r["done"]]
    assert list(state.last_steps()) == [-1 if r["done"] else r["off"] + r["limits"] - 1
                                        for r in rows]


@given(seated(), st.data())
def test_take_keeps_live_rows_and_fills_like_the_engine(case: tuple[RowState, list[dict]],
                                                        data: st.DataObject) -> None:
    state, rows = case
    live = [s for s, r in enumerate(rows) if not r["done"]]
    if not live:
        return
    bucket = data.draw(st.integers(len(live), len(live) + 4))
    keep = np.array(live + [live[0]] * (bucket - len(live)))
    filler = np.arange(bucket) >= len(live)
    want = []
    for j, s in enumerate(keep):
        r = dict(rows[s])
        if filler[j]:  # the filler rules, by hand
            r.update(ids=-1, done=True, pos0=DEAD_POSITION, off=0)
        want.append(r)
    assert as_rows(state.take(keep, filler)) == want


@given(seated())
def test_rows_are_values_a_change_in_place_fails(case: tuple[RowState, list[dict]]) -> None:
    state, rows = case
    for name in ("ids", "done", "fed", "pos0"):
        with pytest.raises(ValueError):
            getattr(state, name)[0] = 1
    state.end([0])
    assert as_rows(state) == rows  # end returned a new value; this one did not change


def test_rows_refuse_arrays_of_different_lengths() -> None:
    with pytest.raises(ValueError, match=r"RowState\.limits"):
        RowState(ids=[1, 2], limits=[3], done=[0, 0], fed=[0, 0], pos0=[1, 1], off=[0, 0],
                 row_id=[1, 2])


@given(st.integers(1, 8), st.integers(1, 4), st.lists(st.booleans(), min_size=1, max_size=12))
def test_cursor_tiles_double_until_a_row_ends(base: int, doublings: int,
                                              ended: list[bool]) -> None:
    """The cursor's next tile after each dispatch, against the rule by hand: back to the base
    after a dispatch in which a row ended, else twice the last up to the maximum."""
    tiling = Tiling(base, base << doublings, 1)
    at = Cursor.start(GroupShape(4, 8, 200, 16), tiling)
    tile, step = base, 1
    for e in ended:
        assert at.tile == tile
        d = Dispatch(step, tile, 8 + step - 1, 4, 16)
        at = at.ran(d, ended=e, live=3)
        step += tile
        assert at.steps_done == step - 1
        tile = base if e else min(base << doublings, 2 * tile)


def test_cursor_past_its_stop_live_bound_keeps_tiles_at_the_base() -> None:
    at = Cursor(4, 16, Tiling(2, 16, 1), tile=2, stop_live=2)
    at = at.ran(Dispatch(1, 2, 8, 4, 16), ended=False, live=3)  # 3 live: above the bound
    assert (at.tile, at.stop_live) == (4, 2)
    at = at.ran(Dispatch(3, 4, 10, 4, 16), ended=False, live=2)  # at the bound
    assert (at.tile, at.stop_live, at.tiling.max) == (2, 0, 2)
