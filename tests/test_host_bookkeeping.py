"""The host's bookkeeping between two tiles, vectorised or in closed form, each against the loop
it replaces, written here. A tile's read-back appended per row (numpy finds each row's end)
against a step-by-step loop: the same tokens, log-probs and logits kept, the same rows ended,
and the finished rows in the order the loop meets them."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl_sym.runtime.group.outputs import Outputs


def _loop(tok: np.ndarray, lp: np.ndarray, lg: np.ndarray, ids: list[int], room: list[int],
          eos: tuple[int, ...], rows: int) -> tuple[Outputs, list[int], list[bool]]:
    """The per-token loop: every live row appends step j's token; it ends at EOS or once it
    holds ``room`` more tokens, and takes no later step."""
    out = Outputs([[] for _ in range(rows)], [[] for _ in range(rows)],
                  [[] for _ in range(rows)])
    live, held, finished = list(range(len(ids))), [0] * len(ids), []
    ended = [False] * len(ids)
    for j in range(tok.shape[0]):
        for c in list(live):
            i = ids[c]
            out.toks[i].append(int(tok[j, c]))
            out.lps[i].append(float(lp[j, c]))
            out.logits[i].append(lg[j, c])
            held[c] += 1
            if int(tok[j, c]) in eos or held[c] >= room[c]:
                ended[c] = True
                finished.append(i)
                live.remove(c)
    return out, finished, ended


@settings(max_examples=200, deadline=None)
@given(steps=st.integers(1, 9), data=st.data())
def test_append_steps_is_the_step_loop(steps: int, data: st.DataObject) -> None:
    cols = data.draw(st.integers(1, 6))
    rows = cols + data.draw(st.integers(0, 3))
    ids = data.draw(st.permutations(range(rows)))[:cols]
    room = data.draw(st.lists(st.integers(1, 12), min_size=cols, max_size=cols))
    eos = tuple(data.draw(st.sets(st.integers(0, 4), max_size=2)))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    tok = rng.integers(0, 6, size=(steps, cols)).astype(np.int32)
    lp = rng.normal(size=(steps, cols)).astype(np.float32)
    lg = rng.normal(size=(steps, cols, 3)).astype(np.float32)
    want, want_finished, want_ended = _loop(tok, lp, lg, ids, room, eos, rows)
    got = Outputs([[] for _ in range(rows)], [[] for _ in range(rows)],
                  [[] for _ in range(rows)])
    n, ended, finished = got.append_steps(np.asarray(ids, np.int64), tok, lp, lg,
                                          np.asarray(room, np.int64), eos)
    assert got.toks == want.toks and got.lps == want.lps
    for a, b in zip(got.logits, want.logits, strict=True):
        assert len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert finished == want_finished and ended.tolist() == want_ended
    assert n.tolist() == [len(want.toks[i]) for i in ids]
    assert got.finished.tolist() == [i in want_finished for i in range(rows)]


@settings(max_examples=300, deadline=None)
@given(cap=st.integers(0, 40), first=st.integers(0, 50), count=st.integers(-2, 40))
def test_capped_sum_is_the_loop(cap: int, first: int, count: int) -> None:
    """The work log's closed form against the sum it replaces."""
    from jaxrl_sym.runtime.metrics import capped_sum

    assert capped_sum(cap, first, count) == sum(min(cap, first + s) for s in range(count))


@settings(max_examples=300, deadline=None)
@given(share=st.floats(0.05, 1.0), min_rows=st.integers(1, 40), multiple=st.integers(1, 8),
       rows=st.integers(0, 400))
def test_stop_at_bisects_the_scan(share: float, min_rows: int, multiple: int, rows: int) -> None:
    """Early compaction's stop (the most live rows at which the group would compact), found by
    bisection, against the scan over every live count."""
    from jaxrl_sym.runtime.policy import Compaction

    rule = Compaction(share, min_rows, True)
    want = max((n for n in range(rows) if rule.target(rows, n, multiple) < rows), default=0)
    assert rule.stop_at(rows, multiple) == want
