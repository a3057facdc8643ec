"""The headline: sym vs Tunix vs padded on the realistic GRPO workload, generation alone and the
whole step, in one run.

Workload (``rlft_step``'s, :func:`jaxrl_sym.workloads.grpo_rollout`): 16 prompts × G = 8, prompts
uniform in [64, 512], responses log-normal (median 275, σ 0.6) capped at 1024, every length divided
by 8 on the ``full`` (CPU) preset, on the shrunk Qwen2.5 policy (``quick``: 4 × 2, / 16). Each row
ends at its sampled length (random weights never sample EOS; the length is the row's limit, as if
EOS were sampled there).

Three measurements, each in its own process so memory and compiles are its own:

1. generation alone — ``tunix_paired --workload rlft``: sym, padded and Tunix's
   ``Sampler`` warmed up, then called in rotating order; median of ``--reps``; tokens checked
   against padded (Tunix decodes every row to the longest row's length, then trims).
2. the whole GRPO step, sym and padded — ``rlft_step`` (generation, packing, reference,
   reward, advantage, update; median of the measured steps after a warm-up step).
3. the whole GRPO step, Tunix's own ``GRPOLearner`` — ``tunix_grpo`` at the same σ: it
   has one generation length per batch (its sampler stops a row only at EOS), so each row
   decodes to the longest sampled length, which is what Tunix computes when rows end at EOS at
   those lengths (its ``while_loop`` runs until the last row ends; its loss runs over the padded
   batch). Useful tokens are the same prompt + sampled-length tokens for every system.

Tunix's trainer stack is not in the light install; put it beside the venv (see
``python -m bench tunix_grpo --help``) and pass ``--tunix-path``. Without it the Tunix step row
says why. Each measurement runs at this run's preset.

    python -m bench headline --preset full --tunix-path /tmp/tunix_rl_deps
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from bench import presets
from bench.lib import child
from bench.lib.roles import REFERENCE, base_name
from bench.lib.suite.suite_jobs import device_dir

PRESETS: dict[str, dict[str, Any]] = {
    "quick": {"reps": 1, "steps": 1, "timeout": 1800, "out": presets.quick_dir("headline")},
    "full": {"reps": 5, "steps": 2, "timeout": 3600, "out": None},
    "gpu": {"reps": 5, "steps": 2, "timeout": 3600, "out": None},
}


def _run(name: str, args: list[str], out: Path, timeout: float,
         env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run one experiment in its own process; its JSON report, or why there is none."""
    res = child.run(child.experiment(name, *args, "--out", str(out)), timeout=timeout, env=env)
    if res.status == "timeout":
        return {"error": f"{name}: over {timeout:.0f} s"}
    if not res.ok or not out.exists():
        return {"error": f"{name} exited {res.returncode}: {res.tail()}"}
    return json.loads(out.read_text())


def measure(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    preset = ["--preset", args.preset]
    gen = _run("tunix_paired", [*preset, "--workload", "rlft", "--systems",
                                "sym-xla,padded,tunix", "--reps", str(args.reps)],
               tmp / "gen.json", args.timeout)
    step = _run("rlft_step", [*preset, "--systems", "sym,padded", "--steps", str(args.steps)],
                tmp / "step.json", args.timeout)
    if args.tunix_path and Path(args.tunix_path).is_dir():
        path = os.pathsep.join([args.tunix_path, os.environ.get("PYTHONPATH", "")])
        tunix = _run("tunix_grpo", [*preset, "--sigma", "0.6", "--steps", str(args.steps + 1)],
                     tmp / "tunix.json", args.timeout, env={"PYTHONPATH": path})
    else:
        tunix = {"error": "Tunix's trainer stack not given (--tunix-path DIR; see "
                          "python -m bench tunix_grpo --help for the pip command)"}
    return {"generation": gen, "step": step, "tunix_step": tunix}


def _row(name: str, seconds: float | None, useful: int | None, first: float | None,
         compiles: Any = None) -> dict[str, Any]:
    tps = useful / seconds if seconds and useful else None
    return {"system": name, "seconds": seconds, "useful_tokens_per_s": tps,
            "first_call_seconds": first, "compiles": compiles}


def generation_rows(gen: dict[str, Any]) -> list[dict[str, Any]]:
    if "error" in gen:
        return []
    useful = gen["useful_tokens"]
    # prompts count as useful in the step's figure; here only generated tokens do
    return [_row(base_name(s), gen["median_seconds"][s], useful,
                 gen["first_call"][s]["seconds"], gen["first_call"][s]["xla_compiles"])
            for s in gen["median_seconds"]]


def step_rows(step: dict[str, Any], tunix: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for s, r in step.get("systems", {}).items():
        if "error" not in r:
            rows.append(_row(s, r["seconds"]["total"], r["useful_tokens"], r["warmup_seconds"],
                             r["warmup_compiles"]))
            useful = r["useful_tokens"]
    if "error" not in tunix and rows:
        lengths = step["response_lengths"]
        rows.append(_row("tunix", tunix["median_step_seconds"], useful,
                         tunix["first_step_seconds"]))
        rows[-1]["decoded_tokens_per_row"] = tunix["response_tokens_per_row"]
        rows[-1]["sampled_max"] = lengths["max"]
    return rows


def ratios(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Every other system's seconds over the reference's (> 1: the reference is faster)."""
    by = {r["system"]: r for r in rows}
    ref = by.get(REFERENCE)
    if ref is None or not ref["seconds"]:
        return {}
    return {f"sym_vs_{name}": r["seconds"] / ref["seconds"] for name, r in by.items()
            if name != REFERENCE and r["seconds"]}


def markdown(report: dict[str, Any]) -> str:
    lines = ["| stage | system | s | useful tokens/s | first call s | compiles |",
             "|---|---|---|---|---|---|"]
    fmt = lambda v, f: "–" if v is None else format(v, f)
    for stage in ("generation", "step"):
        for r in report[f"{stage}_rows"]:
            lines.append(f"| {stage} | {r['system']} | {fmt(r['seconds'], '.3g')} | "
                         f"{fmt(r['useful_tokens_per_s'], ',.0f')} | "
                         f"{fmt(r['first_call_seconds'], '.1f')} | {fmt(r['compiles'], 'd')} |")
    for stage in ("generation", "step"):
        rs = report[f"{stage}_ratios"]
        lines.append("")
        lines.append(f"{stage}: " + (", ".join(f"{k.replace('_', ' ')} {v:.2f}×"
                                              for k, v in rs.items()) or "no ratio"))
    lines.append("\nFirst call: generation — the first call of each system (compiles included, "
                 "persistent cache as configured); step — the warm-up step; for Tunix the time "
                 "to its first reward call (its first rollout).")
    for k in ("generation", "step", "tunix_step"):
        if "error" in report["raw"][k]:
            lines.append(f"\n{k} not measured: {report['raw'][k]['error']}")
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for ax, stage in zip(axes, ("generation", "step"), strict=True):
        rows = [r for r in report[f"{stage}_rows"] if r["useful_tokens_per_s"]]
        ax.bar([r["system"] for r in rows], [r["useful_tokens_per_s"] for r in rows],
               color=["tab:green" if r["system"] == REFERENCE else "tab:gray" for r in rows])
        ax.set_title(f"{'generation alone' if stage == 'generation' else 'whole GRPO step'}")
        ax.set_ylabel("useful tokens / s")
    cfg = report["raw"]["step"].get("config", {})
    fig.suptitle(f"Realistic GRPO workload ({cfg.get('prompts', '?')}×{cfg.get('group', '?')}, "
                 f"lengths log-normal / {cfg.get('scale', '?')})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, every setting of the chosen preset filled in."""
    p = presets.parser("headline", __doc__, PRESETS)
    p.add_argument("--tunix-path", default=None, metavar="DIR",
                   help="directory holding Tunix's trainer-stack packages (PYTHONPATH)")
    p.add_argument("--out", default=None, help="directory for headline.* (default: the "
                                               "preset's; full, gpu: bench/results/<device>)")
    return presets.parse(p, PRESETS, argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from jaxrl_sym.report import run_metadata

    with tempfile.TemporaryDirectory() as d:
        raw = measure(args, Path(d))
    report: dict[str, Any] = {"raw": raw, "generation_rows": generation_rows(raw["generation"]),
                              "step_rows": step_rows(raw["step"], raw["tunix_step"])}
    report["generation_ratios"] = ratios(report["generation_rows"])
    report["step_ratios"] = ratios(report["step_rows"])
    report.update(run_metadata(presets.command("headline", argv)))
    out = Path(args.out or child.ROOT / "bench" / "results" / device_dir(report["device"]))
    out.mkdir(parents=True, exist_ok=True)
    (out / "headline.json").write_text(json.dumps(report, indent=1))
    text = markdown(report)
    (out / "headline.md").write_text(text)
    plot(report, out / "headline.png")
    print(text)
    return 0
