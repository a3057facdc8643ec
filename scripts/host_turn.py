"""The host's turn between decode tiles, on this machine: seconds a generation spends in its
groups' read-back bookkeeping (``DecodeGroup.collect`` less the read-back itself) and in
asking the policy, from ``cProfile`` over one warm ``generate`` call.

Why a script: on a GPU the device waits while the host books a tile's tokens (nothing is
dispatched until the next tile is decided), so this is time the projection's fit cannot see.
The request is 128 rows of a small zoo model (the host's work does not depend on the model),
responses log-normal (median ~120, capped at 200), no EOS, checks of 8 steps as on a GPU.

    PYTHONPATH=. .venv/bin/python scripts/host_turn.py [--early | --late] [--repeat N]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def _seconds(stats: pstats.Stats, suffix: str) -> float:
    """Cumulative seconds of the profiled functions whose location ends with ``suffix``."""
    return sum(v[3] for k, v in stats.stats.items() if f"{k[0]}:{k[2]}".endswith(suffix))


def main(argv: list[str] | None = None) -> None:
    from zoo import zoo

    from jaxrl_sym import EngineOptions, GenerationConfig, SymbolicLM

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--late", action="store_true", help="compaction at tile ends (tiles shrink)")
    p.add_argument("--repeat", type=int, default=3, help="warm calls to profile")
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 61, int(rng.integers(8, 40))).astype(np.int32) for _ in range(128)]
    limits = tuple(int(x) for x in np.minimum(
        np.exp(rng.normal(np.log(120), 0.6, 128)).astype(int) + 1, 200))
    lm = SymbolicLM(zoo(0)["gpt2"], EngineOptions(
        decode_check=8, compact_early=not args.late, min_capacity=16, compact_at=0.5,
        compact_min_rows=16))
    cfg = GenerationConfig(max_new_tokens=limits, temperature=1.0)
    lm.generate(prompts, cfg)  # compiles
    for _ in range(args.repeat):
        prof = cProfile.Profile()
        prof.enable()
        res = lm.generate(prompts, cfg)
        prof.disable()
        st = pstats.Stats(prof)
        book = _seconds(st, "loop.py:collect") - _seconds(st, "sharding.py:to_host")
        ask = _seconds(st, "loop.py:next_dispatch")
        print(f"tokens {res.stats['generated_tokens']}, dispatches {res.stats['dispatches']}: "
              f"bookkeeping {book * 1e3:.1f} ms, policy {ask * 1e3:.1f} ms "
              f"({(book + ask) / res.stats['generated_tokens'] * 1e6:.2f} µs a token, "
              "under cProfile)")


if __name__ == "__main__":
    main()
