"""The learning benchmark at CI size: GRPO with the library's training recipe must learn digit
reversal on seed 11, the seed that stalled before issue 12 (``python -m bench learning``, its
quick preset, with 16 prompts a step instead of 32).

This is the test that fails when a change breaks learning: the old recipe (group-std advantages,
token-mean loss, no entropy bonus, full partial credit) ends this run (100 steps of 16 prompts x
8) at greedy exact match 0.047 with the entropy collapsed, far below the bar below; the recipe
reaches 0.273 (measured with XLA's default CPU flags and with the suite's, tests/conftest.py;
at 32 prompts a step: 0.336, for ~1.7x the CPU time, most of it compiling). Runs are seeded and
greedy evaluation depends on the parameters only, so on one machine the outcome is
deterministic, not a coin flip. ``--preset full`` runs five seeds at 32 prompts.
"""

from __future__ import annotations

from bench.experiments import learning

# Greedy exact match on 128 held-out prompts after 100 steps; a random policy scores ~0.
LEVEL = 0.2


def test_grpo_learns_reverse_on_the_seed_that_stalled() -> None:
    args = learning.parse_args(["--preset", "quick"])
    args.prompts = 16  # half the quick preset's: still separates the recipes (docstring)
    specs = learning.specs(args)
    assert [(s["algo"], s["task"], s["seed"], s["prompts"]) for s in specs] == [
        ("grpo", "reverse", 11, 16)]
    rows = [learning.run_child(s) for s in specs]
    for r in rows:
        curve = r["curves"]["exact_match"]
        # learned beyond where it started, on the held-out greedy metric and while sampling
        assert r["final_exact_match"] >= LEVEL, (r["seed"], r["final_exact_match"], curve)
        assert r["final_exact_match"] > r["first20_exact_match"] + 0.1, (r["seed"], curve)
        assert r["last20_exact_match"] > r["first20_exact_match"], (r["seed"], curve)
        assert r["last20_entropy"] > 0.05, r  # not the collapsed policy of the old recipe
    summary = learning.summarise([{**r, "process_seconds": r["wall_seconds"]} for r in rows],
                                 LEVEL)
    assert summary[0]["passed"] == 1
    assert "| grpo | reverse | 100 | 1 |" in learning.table(summary, LEVEL)
