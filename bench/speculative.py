"""Speculative decoding on the suite's realistic request: tokens/s with and without it.

The request is :func:`bench.waste.request`'s (CPU ``quick`` preset: 16 prompts of 16–128 tokens,
per-row response limits log-normal with median 69 capped at 256, the ``decode-cpu`` model with
full attention, greedy). Systems: the symbolic runtime plain (decode tiles of 8 steps) and with
speculation (n-gram prompt-lookup draft on device, tiles of 4 draft + verify steps; fixed K, K
with one verify per dispatch, and adaptive k up to K), and the padded baseline plain and with
the same speculation (host draft, one verify per dispatch). Each runs once cold (compiles) and
then warm; tokens/s is generated tokens over the warm call's run seconds, which include the
draft (on device for sym, on the host for padded: ``draft s``) and exclude compiles for every
system. Every system's tokens must equal plain sym's (greedy).

    python bench/speculative.py                   # writes bench/results/cpu/speculative.{json,md}
    python bench/speculative.py --ks 2,4 --out-dir /tmp/spec
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from suite import QUICK
from waste import request

from jaxrl_sym.baselines.padded import padded_generate
from jaxrl_sym.baselines.padded_speculative import padded_speculative_generate
from jaxrl_sym.runtime.engine import SymbolicLM
from jaxrl_sym.runtime.speculative import SpeculativeLM

WARM_RUNS = 3  # warm calls per system; the median's run seconds are reported (a loaded machine)


def systems(model: Any, ks: list[int], drafts: list[str] = (), tunix: bool = False
            ) -> dict[str, Any]:
    """name → generate(prompts, cfg); engines built here, so their compiles stay per engine.

    ``drafts``: draft models for K = max(ks) — a model preset (``decode_run.draft_model``:
    that shape, the target's vocabulary, other random weights) or ``self`` (the target drafting
    for itself: every greedy proposal accepted, at a draft as dear as the target — the bound
    on what acceptance alone buys). ``tunix``: Tunix's sampler, plain, as the peer row."""
    from jaxrl_sym.decode_run import check_vocab, draft_model

    out: dict[str, Any] = {"sym": SymbolicLM(model).generate}
    for k in ks:
        out[f"sym spec k={k}"] = SpeculativeLM(model, speculate=k).generate
    out[f"sym spec k={max(ks)} verify_tile=1"] = SpeculativeLM(model, speculate=max(ks),
                                                               verify_tile=1).generate
    out[f"sym spec adaptive<={max(ks)}"] = SpeculativeLM(model, speculate=max(ks),
                                                         adaptive=True).generate
    for d in drafts:
        dm = model if d == "self" else draft_model(d, check_vocab(model), 0)
        out[f"sym spec k={max(ks)} draft={d}"] = SpeculativeLM(model, speculate=max(ks),
                                                               draft=dm).generate
    out["padded"] = lambda p, c: padded_generate(model, p, c)
    for k in ks:
        out[f"padded spec k={k}"] = (
            lambda p, c, k=k: padded_speculative_generate(model, p, c, speculate=k))
    if tunix:
        from jaxrl_sym.systems import generator

        out["tunix"] = generator("tunix", model)
    return out


def _timed(gen: Any, prompts: Any, cfg: Any) -> Any:
    """A call, with ``run_seconds`` its wall time where the system does not report one."""
    t0 = time.perf_counter()
    res = gen(prompts, cfg)
    res.stats.setdefault("run_seconds", time.perf_counter() - t0)
    return res


def run(ks: list[int], drafts: list[str], tunix: bool) -> list[dict[str, Any]]:
    """Every system cold, then warm; one row each (printed as it finishes)."""
    model, prompts, cfg = request(QUICK)
    rows, ref = [], None
    for name, gen in systems(model, ks, drafts, tunix).items():
        t0 = time.perf_counter()
        cold = _timed(gen, prompts, cfg)
        first = time.perf_counter() - t0
        warms = [_timed(gen, prompts, cfg) for _ in range(WARM_RUNS)]
        warm = sorted(warms, key=lambda w: w.stats["run_seconds"])[WARM_RUNS // 2]  # median
        s = warm.stats
        ref = ref or cold.tokens
        same = all(np.array_equal(a, b) for w in (cold, *warms)
                   for a, b in zip(ref, w.tokens, strict=True))
        per_row = s.get("acceptance_per_row")
        row = {"system": name, "tokens": s["generated_tokens"] if "generated_tokens" in s
               else int(sum(len(t) for t in warm.tokens)),
               "run_s": s["run_seconds"], "first_call_s": first,
               "warm_runs_s": [w.stats["run_seconds"] for w in warms],
               "xla_compiles_cold": cold.stats.get("xla_compiles"),
               "xla_compiles_warm": sum(w.stats.get("xla_compiles") or 0 for w in warms),
               "acceptance_rate": s.get("acceptance_rate"),
               "acceptance_per_row": per_row, "draft_s": s.get("draft_seconds"),
               "verify_steps": s.get("verify_steps"), "tokens_equal_sym": same}
        row["tokens_per_s"] = row["tokens"] / row["run_s"]
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "acceptance_per_row"}),
              flush=True)
    return rows


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    base = {r["system"].split()[0]: r["tokens_per_s"] for r in rows if " " not in r["system"]}
    lines = [f"# Speculative decoding, CPU realistic request (git {meta['git']})", "",
             f"Command: `{meta['command']}`. {meta['request']}", "",
             "| system | tokens | warm run s | tokens/s | vs plain same system | acceptance | "
             "draft s | verify steps | compiles cold | tokens = sym |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        rel = r["tokens_per_s"] / base[r["system"].split()[0]]
        acc = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.3f}"
        draft = "-" if r["draft_s"] is None else f"{r['draft_s']:.2f}"
        lines.append(f"| {r['system']} | {r['tokens']} | {r['run_s']:.2f} | "
                     f"{r['tokens_per_s']:.1f} | {rel:.2f}x | {acc} | {draft} | "
                     f"{r['verify_steps'] or '-'} | {r['xla_compiles_cold']} | "
                     f"{r['tokens_equal_sym']} |")
    lines += ["", "Acceptance rate per row (accepted / drafted tokens), request order:", ""]
    for r in rows:
        if r["acceptance_per_row"]:
            vals = " ".join("-" if a is None else f"{a:.2f}" for a in r["acceptance_per_row"])
            lines.append(f"- {r['system']}: {vals}")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ks", default="2,4", help="comma-separated K values (fixed speculation)")
    ap.add_argument("--drafts", default="", help="comma-separated draft models for K = max: "
                    "model presets (tiny, small, ...) or 'self' (the target as its own draft)")
    ap.add_argument("--tunix", action="store_true", help="add Tunix's sampler (plain) as a row")
    ap.add_argument("--out-dir", default=str(Path(__file__).parent / "results" / "cpu"))
    args = ap.parse_args()
    ks = sorted({int(x) for x in args.ks.split(",")})
    drafts = [d.strip() for d in args.drafts.split(",") if d.strip()]
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                         text=True).stdout.strip()  # before the run: the code it measures
    rows = run(ks, drafts, args.tunix)
    r = QUICK["realistic"]
    meta = {"git": git, "command": "python bench/speculative.py " + " ".join(sys.argv[1:]),
            "request": f"{r['batch']} prompts of {r['prompt'][0]}-{r['prompt'][1]} tokens, "
                       f"response limits log-normal median {r['median']} (sigma {r['sigma']}) "
                       f"capped at {r['cap']}, decode-cpu model, full attention, greedy; tokens/s "
                       "= generated tokens / median of 3 warm runs' seconds (drafting included, "
                       "compiles not)."}
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "speculative.json").write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    (out / "speculative.md").write_text(markdown(rows, meta))
    print(markdown(rows, meta))


if __name__ == "__main__":
    main()
