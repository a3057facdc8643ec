"""Which heavy tests a CI run takes: the suite's rotation (issue 49).

Why: CI has 2 cores and a 20-minute budget; the suite compiles thousands of XLA programs that no
two tests share, and its ~290 tests of 10 s or more hold ~89% of its time
(``bench/results/cpu/suite_time.md``). ``make test`` (CI's gate) therefore runs every test under
10 s, every test of the pinned files (the transformers/PEFT oracles), every test the table does
not know yet (a new test runs every time until the table is refreshed), and **one of K shards** of
the heavy ones, the shard picked by the commit under test (``scripts/test_shard.sh``: its count
of commits modulo K), so consecutive commits walk through all K. ``make test-all`` runs
everything; sessions run it before they land.

The heavy tests and their seconds are ``tests/heavy_tests.json``, written from a clean-clone run's
JUnit XML by ``scripts/heavy_tests.py``. Tests that share a module fixture rotate as one unit (the
fixture runs wherever one of them does). The shards are balanced by the units' seconds (longest
first, each to the lightest shard), so every shard costs about the same. Nothing here imports
pytest: ``tests/test_shards.py`` checks it against naive loops.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

TABLE = Path(__file__).with_name("heavy_tests.json")

ENV = "JAXRL_SYM_TEST_SHARD"
"""``i/K`` (0 ≤ i < K): run shard i of K of the heavy tests; unset, empty or ``all``: run all."""


@dataclass(frozen=True)
class Shard:
    """Shard ``index`` of ``count`` (``count == 0``: every test)."""

    index: int
    count: int

    @staticmethod
    def parse(text: str | None) -> Shard:
        """``i/K`` from the environment, with an error that names the variable."""
        if text is None or text.strip() in ("", "all"):
            return Shard(0, 0)
        m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
        if m is None or not 0 <= int(m[1]) < int(m[2]):
            raise ValueError(f"{ENV}={text!r}: give i/K with 0 <= i < K (e.g. 3/8), or 'all'")
        return Shard(int(m[1]), int(m[2]))

    def describe(self) -> str:
        if self.count == 0:
            return "every heavy test (no shard)"
        return f"heavy-test shard {self.index}/{self.count} ({ENV}; `make test-all` runs all)"


def partition(seconds: Mapping[str, float], count: int) -> list[list[str]]:
    """``count`` shards of the test ids, balanced by their seconds: longest first, each to the
    shard with the fewest seconds so far (ties: the lower shard; equal seconds: by id), so the
    result depends only on its input."""
    shards: list[list[str]] = [[] for _ in range(count)]
    load = [0.0] * count
    for test in sorted(seconds, key=lambda t: (-seconds[t], t)):
        i = min(range(count), key=lambda j: (load[j], j))
        shards[i].append(test)
        load[i] += seconds[test]
    return shards


@dataclass(frozen=True)
class Table:
    """The heavy tests' seconds and the files whose tests always run."""

    seconds: Mapping[str, float]
    pinned: tuple[str, ...]

    @staticmethod
    def load(path: Path = TABLE) -> Table:
        data = json.loads(path.read_text())
        return Table(data["seconds"], tuple(data["pinned_files"]))

    def skipped(self, test_ids: Iterable[str], shard: Shard,
                together: Iterable[Iterable[str]] = ()) -> set[str]:
        """The ids among ``test_ids`` that ``shard`` leaves out: not pinned, and in a unit of
        another shard. A unit is the tests ``together`` links (they share a module fixture,
        whose cost the table charged to whichever of them ran first: the 8-device child of
        ``tests/test_sharding.py`` is ~220 s), or a test alone; a unit with no heavy test in it
        always runs."""
        if shard.count == 0:
            return set()
        ids = [t for t in test_ids if t.split("::")[0] not in self.pinned]
        unit = units(ids, together)
        cost: dict[str, float] = {}
        for t in ids:
            if t in self.seconds:
                cost[unit[t]] = cost.get(unit[t], 0.0) + self.seconds[t]
        mine = set(partition(cost, shard.count)[shard.index])
        return {t for t in ids if unit[t] in cost and unit[t] not in mine}


def units(test_ids: Iterable[str], together: Iterable[Iterable[str]]) -> dict[str, str]:
    """Each test's unit: the smallest id among the tests ``together``'s groups link to it,
    directly or through others (union-find); a test in no group is its own unit."""
    parent = {t: t for t in test_ids}

    def find(t: str) -> str:
        while parent[t] != t:
            parent[t] = parent[parent[t]]
            t = parent[t]
        return t

    for group in together:
        members = [t for t in group if t in parent]
        for t in members[1:]:
            a, b = find(t), find(members[0])
            if a != b:
                parent[max(a, b)] = min(a, b)
    return {t: find(t) for t in parent}
