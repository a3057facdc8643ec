"""Decode cost against live rows: seconds per decode step of the RL task model at a row count.

Why: partial rollouts (issue 16) stop a step when most rows finished and decode the unfinished
tail beside the next step's new rows. That saves time only where a decode step costs about the
same for few rows as for many — a memory-bound accelerator, where each step reads the weights
once whatever the batch. Where a step's cost grows with its rows, decoding the tail beside new
rows costs what decoding it alone did, and the re-prefill of carried rows comes on top. This
measures which of the two a machine is.

    python -m bench row_cost --preset full    # rows 8..256 -> bench/results/<platform>/row_cost.*
    python -m bench row_cost --preset full --rows 8,256 --steps 32

Each row count runs the runtime's own ``SymbolicLM.generate`` (warm: a first call compiles),
every row to ``--steps`` tokens with no EOS, best of the preset's ``repeats`` calls; prefill is
included, so it is an upper bound on the decode step.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

from bench import presets
from bench.lib.child import ROOT

PRESETS: dict[str, dict[str, Any]] = {
    "quick": {"rows": "8,32", "steps": 8, "repeats": 1,
              "out": os.path.join(presets.quick_dir("row_cost"), "row_cost")},
    "full": {"rows": "8,16,32,64,128,256", "steps": 64, "repeats": 3, "out": None},
    "gpu": {"rows": "8,16,32,64,128,256", "steps": 64, "repeats": 3, "out": None},
}


def measure(rows: int, steps: int, repeats: int) -> dict[str, Any]:
    import numpy as np

    from jaxrl_sym.generation import GenerationConfig
    from jaxrl_sym.models.lm import init_model, preset
    from jaxrl_sym.rl.run.train import TASK_MODEL
    from jaxrl_sym.rl.tasks.token_tasks import VOCAB_SIZE
    from jaxrl_sym.runtime.engine import SymbolicLM

    model = init_model(preset("tiny", **TASK_MODEL), 0)
    lm = SymbolicLM(model)
    prompts = [np.arange(1, 9, dtype=np.int32) % VOCAB_SIZE for _ in range(rows)]
    gen = GenerationConfig(max_new_tokens=steps, temperature=1.0, seed=0, eos_id=None)
    lm.generate(prompts, gen)  # compiles
    best = min(_timed(lambda: lm.generate(prompts, gen)) for _ in range(repeats))
    return {"rows": rows, "steps": steps, "seconds_per_step": best / steps,
            "seconds_per_row_step": best / steps / rows}


def _timed(fn: Any) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, every setting of the chosen preset filled in."""
    p = presets.parser("row_cost", __doc__, PRESETS)
    p.add_argument("--rows", default=None, type=presets.ints(1), help="comma-separated row counts")
    p.add_argument("--steps", type=presets.at_least(1), default=None, help="tokens per row")
    p.add_argument("--out", default=None, help="OUT.jsonl and OUT.md (default: "
                                               "bench/results/<platform>/row_cost)")
    return presets.parse(p, PRESETS, argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    import jax

    rows = [measure(n, a.steps, a.repeats) for n in presets.csv(a.rows, int)]
    out = a.out or os.path.join(ROOT, "bench", "results", jax.devices()[0].platform, "row_cost")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out + ".jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    base = rows[0]
    with open(out + ".md", "w") as f:
        f.write(f"| rows | ms per step | us per row-step | step cost vs {base['rows']} rows |\n"
                "|---|---|---|---|\n")
        for r in rows:
            f.write(f"| {r['rows']} | {r['seconds_per_step'] * 1e3:.3f} | "
                    f"{r['seconds_per_row_step'] * 1e6:.1f} | "
                    f"{r['seconds_per_step'] / base['seconds_per_step']:.1f}x |\n")
    with open(out + ".md") as f:
        print(f.read())
    return 0
