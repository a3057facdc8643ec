"""Where the symbolic runtime's token positions go on realistic RL lengths, from its own log.

Runs the suite's realistic request (:func:`bench.lib.requests.realistic_request`; preset ``full``:
16 prompts of 16–128 tokens, responses log-normal with median 69 capped at 256, on CPU; ``gpu``: 64
prompts of 64–512, median 275 capped at 1024; ``quick``: the suite's tiny request) through
``SymbolicLM`` with each prefill layout and grouping, and reports what the engine booked per cause
(``stats["waste_by_cause"]``, written by the decode groups while they run — not a replay), with
compiles, dispatches and seconds, cold and warm. Rows differ in grouping (``max_pad_fraction``) and
compaction threshold (``compact_at``); the last column is the padded baseline's first call on the
same request and weights, run once in this process first. The script never enables JAX's persistent
compilation cache, so every first call compiles everything (cold); every row's tokens must equal
padded's.

    python -m bench waste --preset full     # CPU
    python -m bench waste --preset gpu      # GPU-sized request
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

from bench import presets
from bench.experiments.suite import grid
from bench.lib.record import write_table
from bench.lib.requests import realistic_request as request
from jaxrl_sym import systems
from jaxrl_sym.runtime.options import EngineOptions

# (prefill, max_pad_fraction, compact_at); the default is ("packed", 1.0, 0.75)
CONFIGS = (("block", 0.1, 0.75), ("packed", 0.1, 0.75), ("packed", 1.0, 0.75),
           ("packed", 1.0, 0.5), ("packed", 1.0, 0.25))
PRESETS: dict[str, dict[str, Any]] = {
    "quick": {"configs": CONFIGS[1:3], "out": None},
    "full": {"configs": CONFIGS, "out": None},
    "gpu": {"configs": CONFIGS, "out": None},
}


def tokens_sha(tokens: list[np.ndarray]) -> int:
    return hash(tuple(np.asarray(t, np.int32).tobytes() for t in tokens)) & 0xFFFFFFFF


def padded_first_call(preset: dict) -> tuple[float, int, int]:
    """Seconds, XLA compiles and tokens of the padded baseline's first call on the request."""
    model, prompts, cfg = request(preset)
    padded = systems.get(systems.BASELINE).bind(model)
    t0 = time.perf_counter()
    res = padded.generate(prompts, cfg)
    return time.perf_counter() - t0, res.stats["xla_compiles"], tokens_sha(res.tokens)


def run(preset: dict, prefill: str, max_pad_fraction: float, compact_at: float) -> dict:
    r = preset["realistic"]
    model, prompts, cfg = request(preset)
    from jaxrl_sym.runtime.engine import SymbolicLM  # JAX only once the flags are read

    lm = SymbolicLM(model, EngineOptions(prefill=prefill, max_pad_fraction=max_pad_fraction,
                                         compact_at=compact_at))
    t0 = time.perf_counter()
    cold = lm.generate(prompts, cfg)
    first = time.perf_counter() - t0
    warm = lm.generate(prompts, cfg)
    s = cold.stats
    return {"prefill": prefill, "max_pad_fraction": max_pad_fraction, "compact_at": compact_at,
            "groups": s["groups"],
            "waste_fraction": s["waste_fraction"], **s["waste_by_cause"],
            "key_waste_fraction": s["key_waste_fraction"],
            **{f"key_{k}": v for k, v in s["key_waste_by_cause"].items()},
            "xla_compiles": s["xla_compiles"], "dispatches": s["dispatches"],
            "first_call_s": first, "warm_s": warm.stats["run_seconds"],
            "tokens_sha": tokens_sha(cold.tokens),
            "batch": r["batch"], "median": r["median"], "cap": r["cap"]}


def table(rows: list[dict]) -> str:
    from jaxrl_sym.runtime.metrics import WASTE_CAUSES

    head = ["prefill", "grouping", "compact at", "groups", "waste", *WASTE_CAUSES, "compiles",
            "dispatches", "first call s", "warm s", "padded first call s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["prefill"], f"pad ≤ {r['max_pad_fraction']:g}", f"{r['compact_at']:g}",
                 str(r["groups"]),
                 f"{100 * r['waste_fraction']:.1f}%",
                 *(f"{100 * r[c]:.1f}%" for c in WASTE_CAUSES), str(r["xla_compiles"]),
                 str(r["dispatches"]), f"{r['first_call_s']:.1f}", f"{r['warm_s']:.2f}",
                 f"{r['padded_first_call_s']:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def key_table(rows: list[dict]) -> str:
    """Decode key slots by cause (share of the key slots each row's decode read)."""
    from jaxrl_sym.runtime.metrics import KEY_CAUSES

    head = ["prefill", "grouping", "compact at", "key-slot waste", *KEY_CAUSES]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["prefill"], f"pad ≤ {r['max_pad_fraction']:g}", f"{r['compact_at']:g}",
                 f"{100 * r['key_waste_fraction']:.1f}%",
                 *(f"{100 * r['key_' + c]:.1f}%" for c in KEY_CAUSES)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, every setting of the chosen preset filled in."""
    p = presets.parser("waste", __doc__, PRESETS)
    p.add_argument("--out", default=None, help="directory for waste_realistic.{jsonl,md} "
                                               "(default: print only)")
    return presets.parse(p, PRESETS, argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    preset = grid(args.preset)
    padded_s, padded_compiles, padded_sha = padded_first_call(preset)
    rows = [{**run(preset, *c), "padded_first_call_s": padded_s,
             "padded_compiles": padded_compiles} for c in args.configs]
    if {r["tokens_sha"] for r in rows} != {padded_sha}:
        raise RuntimeError("a row's tokens differ from padded's")
    md = (f"`{presets.command('waste', argv)}`\n\nToken positions:\n\n{table(rows)}\n\n"
          f"Decode key slots:\n\n{key_table(rows)}")
    print(md)
    if args.out:
        write_table(args.out, "waste_realistic", rows, md)
    return 0
