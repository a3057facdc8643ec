"""Speculative decoding on the suite's realistic request: tokens/s with and without it.

The request is :func:`bench.lib.requests.realistic_request`'s at the suite's preset of the same name
(``full``: 16 prompts of 16–128 tokens, per-row response limits log-normal with median 69 capped at
256, the ``decode-cpu`` model with full attention, greedy; ``quick``: the tiny request). Systems:
the symbolic runtime plain (decode tiles of 8 steps) and with speculation (n-gram prompt-lookup
draft on device, tiles of 4 draft + verify steps; fixed K, K with one verify per dispatch, and
adaptive k up to K), and the padded baseline plain and with the same speculation (host draft, one
verify per dispatch). Each runs once cold (compiles) and then warm; tokens/s is generated tokens
over the warm call's run seconds, which include the draft (on device for sym, on the host for
padded: ``draft s``) and exclude compiles for every system. Every system's tokens must equal plain
sym's (greedy).

    python -m bench speculative --preset full     # writes bench/results/cpu/speculative.*
    python -m bench speculative --preset full --ks 2,4 --out /tmp/spec
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench import presets
from bench.experiments.suite import grid
from bench.lib.child import ROOT
from bench.lib.record import git_commit
from bench.lib.requests import realistic_request
from jaxrl_sym.cli import PRESETS as MODEL_PRESETS  # JAX-free: checked before JAX
from jaxrl_sym.runtime.options import Speculation

PRESETS: dict[str, dict[str, Any]] = {
    # warm_runs: warm calls per system; the median's run seconds are reported (a loaded machine)
    "quick": {"ks": "2", "drafts": "", "warm_runs": 1, "out": presets.quick_dir("speculative")},
    "full": {"ks": "2,4", "drafts": "", "warm_runs": 3, "out": str(ROOT / "bench/results/cpu")},
    "gpu": {"ks": "2,4", "drafts": "", "warm_runs": 3, "out": None},
}


def systems(model: Any, ks: list[int], drafts: list[str] = (), tunix: bool = False
            ) -> dict[str, Any]:
    """name → generate(prompts, cfg); engines built here, so their compiles stay per engine.

    ``drafts``: draft models for K = max(ks) — a model preset (``decode_run.draft_model``:
    that shape, the target's vocabulary, other random weights) or ``self`` (the target drafting
    for itself: every greedy proposal accepted, at a draft as dear as the target — the bound
    on what acceptance alone buys). ``tunix``: Tunix's sampler, plain, as the peer row."""
    from jaxrl_sym import systems as registry
    from jaxrl_sym.decode_run import check_vocab, draft_model
    from jaxrl_sym.runtime.speculative.lm import SpeculativeLM

    def bound(name: str, **options: Any) -> Any:
        return registry.get(name).bind(model, registry.BindOptions(**options)).generate

    sym, padded, top = registry.REFERENCE, registry.BASELINE, max(ks)
    out: dict[str, Any] = {sym: bound(sym)}
    for k in ks:
        out[f"{sym} spec k={k}"] = bound(sym, speculate=k)
    # runtime knobs the registry's options do not carry: the speculative runtime itself
    out[f"{sym} spec k={top} verify_tile=1"] = SpeculativeLM(
        model, speculation=Speculation(top, verify_tile=1)).generate
    out[f"{sym} spec adaptive<={top}"] = SpeculativeLM(
        model, speculation=Speculation(top, adaptive=True)).generate
    for d in drafts:
        dm = model if d == "self" else draft_model(d, check_vocab(model), 0)
        out[f"{sym} spec k={top} draft={d}"] = bound(sym, speculate=top, draft=dm)
    out[padded] = bound(padded)
    for k in ks:
        out[f"{padded} spec k={k}"] = bound(padded, speculate=k)
    if tunix:
        out["tunix"] = bound("tunix")
    return out


def _timed(gen: Any, prompts: Any, cfg: Any) -> Any:
    """A call, with ``run_seconds`` its wall time where the system does not report one."""
    t0 = time.perf_counter()
    res = gen(prompts, cfg)
    res.stats.setdefault("run_seconds", time.perf_counter() - t0)
    return res


def run(ks: list[int], drafts: list[str], tunix: bool, preset: str = "full",
        warm_runs: int = 3) -> list[dict[str, Any]]:
    """Every system cold, then warm; one row each (printed as it finishes)."""
    model, prompts, cfg = realistic_request(grid(preset))
    rows, ref = [], None
    for name, gen in systems(model, ks, drafts, tunix).items():
        t0 = time.perf_counter()
        cold = _timed(gen, prompts, cfg)
        first = time.perf_counter() - t0
        warms = [_timed(gen, prompts, cfg) for _ in range(warm_runs)]
        warm = sorted(warms, key=lambda w: w.stats["run_seconds"])[warm_runs // 2]  # median
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
    lines = [f"# Speculative decoding, realistic request (git {meta['git']})", "",
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, every setting of the chosen preset filled in."""
    p = presets.parser("speculative", __doc__, PRESETS)
    p.add_argument("--ks", default=None, type=presets.ints(1),
                   help="comma-separated K values (fixed speculation)")
    p.add_argument("--drafts", default=None,
                   type=presets.names(("self", *MODEL_PRESETS), "draft model", empty=True),
                   help="comma-separated draft models for K = max: "
                   "model presets (tiny, small, ...) or 'self' (the target as its own draft)")
    p.add_argument("--tunix", action="store_true", help="add Tunix's sampler (plain) as a row")
    p.add_argument("--out", default=None, help="directory for speculative.{json,md} (default: "
                                               "the preset's; gpu: bench/results/<device>)")
    return presets.parse(p, PRESETS, argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ks = sorted(set(presets.csv(args.ks, int)))
    git = git_commit()  # before the run: the code it measures
    rows = run(ks, presets.csv(args.drafts), args.tunix, args.preset, args.warm_runs)
    r = grid(args.preset)["realistic"]
    meta = {"git": git, "command": presets.command("speculative", argv),
            "request": f"{r['batch']} prompts of {r['prompt'][0]}-{r['prompt'][1]} tokens, "
                       f"response limits log-normal median {r['median']} (sigma {r['sigma']}) "
                       f"capped at {r['cap']}, {grid(args.preset)['preset']} model, full "
                       f"attention, greedy; tokens/s = generated tokens / median of "
                       f"{args.warm_runs} warm runs' seconds (drafting included, compiles not)."}
    out = Path(args.out) if args.out else _device_dir()
    out.mkdir(parents=True, exist_ok=True)
    (out / "speculative.json").write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    (out / "speculative.md").write_text(markdown(rows, meta))
    print(markdown(rows, meta))
    return 0


def _device_dir() -> Path:
    import jax

    from bench.lib.suite.suite_jobs import device_dir

    return ROOT / "bench" / "results" / device_dir(str(jax.devices()[0].device_kind))
