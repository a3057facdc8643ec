"""CI's rotation through the heavy tests (``tests/shards.py``), against loops written here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import shards
from hypothesis import given
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parent.parent

ids = st.lists(st.from_regex(r"tests/test_[a-c]\.py::t_[a-z]{1,3}", fullmatch=True),
               unique=True, max_size=40)


@given(ids.flatmap(lambda ts: st.tuples(
    st.just(ts), st.lists(st.floats(10, 300), min_size=len(ts), max_size=len(ts)))),
    st.integers(1, 9))
def test_shards_cover_every_test_once_and_are_balanced(table, count: int) -> None:
    tests, secs = table
    seconds = dict(zip(tests, secs, strict=True))
    parts = shards.partition(seconds, count)
    assert len(parts) == count
    seen = [t for part in parts for t in part]
    assert sorted(seen) == sorted(tests)  # each test in exactly one shard
    loads = [sum(seconds[t] for t in part) for part in parts]
    if tests:  # longest first to the lightest shard: no shard is a whole test above another
        assert max(loads) - min(loads) <= max(secs) + 1e-9
    assert parts == shards.partition(dict(reversed(list(seconds.items()))), count)  # table order


@given(ids, st.sets(st.sampled_from(["tests/test_a.py", "tests/test_b.py"])), st.integers(1, 6),
       st.lists(st.from_regex(r"tests/test_[a-d]\.py::u_[a-z]{1,3}", fullmatch=True),
                unique=True, max_size=10))
def test_every_light_pinned_or_new_test_runs_and_each_heavy_one_in_one_shard(
        heavy, pinned, count: int, light) -> None:
    table = shards.Table({t: 30.0 for t in heavy}, tuple(pinned))
    collected = heavy + light
    runs = {t: 0 for t in collected}
    for i in range(count):
        left_out = table.skipped(collected, shards.Shard(i, count))
        for t in collected:
            runs[t] += t not in left_out
    for t in collected:
        always = t not in table.seconds or t.split("::")[0] in pinned
        assert runs[t] == (count if always else 1), t
    assert table.skipped(collected, shards.Shard.parse("all")) == set()


def _components(tests: list[str], groups: list[list[str]]) -> list[set[str]]:
    """Connected groups by merging sets until none overlap (not union-find)."""
    comps = [{t} for t in tests]
    for g in groups:
        if g:
            comps.append(set(g))
    merged = True
    while merged:
        merged = False
        for i in range(len(comps)):
            for j in range(i + 1, len(comps)):
                if comps[i] & comps[j]:
                    comps[i] |= comps.pop(j)
                    merged = True
                    break
            if merged:
                break
    return comps


@given(ids, st.data(), st.integers(1, 5))
def test_tests_sharing_a_module_fixture_rotate_as_one_unit(tests, data, count: int) -> None:
    heavy = data.draw(st.sets(st.sampled_from(tests))) if tests else set()
    groups = data.draw(st.lists(st.lists(st.sampled_from(tests), max_size=4), max_size=4)
                       ) if tests else []
    table = shards.Table({t: 20.0 for t in heavy}, ())
    runs_in = {t: set() for t in tests}
    for i in range(count):
        left_out = table.skipped(tests, shards.Shard(i, count), groups)
        for t in tests:
            if t not in left_out:
                runs_in[t].add(i)
    for comp in _components(tests, groups):
        shard_sets = {frozenset(runs_in[t]) for t in comp}
        assert len(shard_sets) == 1, comp  # a unit runs together
        (where,) = shard_sets
        assert len(where) == (1 if comp & heavy else count), comp


def test_the_shard_variable_is_checked() -> None:
    assert shards.Shard.parse(" 3/8 ") == shards.Shard(3, 8)
    assert shards.Shard.parse(None) == shards.Shard.parse("") == shards.Shard(0, 0)
    for bad in ("8/8", "3", "-1/8", "a/b", "1/0"):
        with pytest.raises(ValueError, match=re.escape(shards.ENV)):
            shards.Shard.parse(bad)


def test_the_table_names_tests_that_exist() -> None:
    """A renamed or deleted test would silently stay in the table: every entry's file must exist
    and define its function, and every pinned file must exist."""
    table = shards.Table.load()
    assert table.seconds and all(s >= 10 for s in table.seconds.values())
    for test in table.seconds:
        path, name = test.split("::")[0], test.split("::")[-1].split("[")[0]
        source = (ROOT / path).read_text()
        assert re.search(rf"^def {re.escape(name)}\(", source, re.M), test
    for path in table.pinned:
        assert (ROOT / path).is_file(), path
