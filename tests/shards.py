"""Which heavy tests a CI run takes: the suite's rotation (issue 49).

Why: CI has 2 cores and a 20-minute budget; the suite compiles thousands of XLA programs that no
two tests share, and its ~290 tests of 10 s or more hold ~89% of its time
(``bench/results/cpu/suite_time.md``). ``make test`` (CI's gate) therefore runs every test under
10 s, every test of the pinned files (the transformers/PEFT oracles), every test the table does
not know yet (a new test runs every time until the table is refreshed), and **one of K shards** of
the heavy ones, the shard picked by the commit under test (its count of commits, modulo K), so
consecutive commits walk through all K. ``make test-all`` runs everything; sessions run it before
they land.

The heavy tests and their seconds are ``tests/heavy_tests.json``, written from a clean-clone run's
JUnit XML by ``scripts/heavy_tests.py``. The shards are balanced by those seconds (longest first,
each to the lightest shard), so every shard costs about the same. Nothing here imports pytest:
``tests/test_shards.py`` checks it against a naive loop.
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
    result depends only on the table."""
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

    def skipped(self, test_ids: Iterable[str], shard: Shard) -> set[str]:
        """The ids among ``test_ids`` that ``shard`` leaves out: heavy, not pinned, and in
        another shard."""
        if shard.count == 0:
            return set()
        mine = set(partition(self.seconds, shard.count)[shard.index])
        return {t for t in test_ids if t in self.seconds and t not in mine
                and t.split("::")[0] not in self.pinned}
