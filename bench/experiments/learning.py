"""Multi-seed learning benchmark: does RL fine-tuning learn across seeds and algorithms?

One run per (algorithm, task, seed) with the library's defaults (``jaxrl_sym.rl.run.train.train``
and its task recipe), each in its own process, ``--jobs`` at a time. Reported per (algorithm,
task): the final *greedy* exact match on held-out prompts (mean, min, max over seeds; greedy, so
it depends on the parameters only), how many seeds cleared ``--pass-level``, and wall time. The
learning curves (sampled exact match and policy entropy per step, mean of 10) are plotted.

    python -m bench learning --preset full     # 3 algos x {reverse, copy} x 5 seeds
    python -m bench learning                   # quick: the CI-sized version (see tests)
    # with vs without partial rollouts, same seeds, both in one invocation (--jobs 2: side by
    # side, so both runs see the same machine load)
    python -m bench learning --preset full --algos grpo --tasks reverse --seeds 0 \
        --partial off --partial '{"fraction": 0.75, "segment": 4, "max_carry": 1}' \
        --config '{"max_new_tokens": 16}' --out bench/results/cpu/partial_rollouts

Writes ``<out>.jsonl`` (one line per run: the summary plus its per-step curves, downsampled),
``<out>.md`` (the table) and ``<out>.png`` (the curves). Finished runs already in ``<out>.jsonl``
are kept and not re-run (so an interrupted benchmark continues); ``--force`` re-runs them.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any

import numpy as np

from bench import presets
from bench.lib import child
from bench.lib.record import git_commit
from jaxrl_sym.rl.tasks.token_tasks import TASK_NAMES  # JAX-free

ALGOS = ("grpo", "rloo", "ppo")
SEEDS = (0, 1, 2, 3, 11)
CURVE_KEYS = ("reward", "exact_match", "entropy", "zero_var_frac")
CURVE_EVERY = 5  # steps per stored curve point (a 400-step run keeps 80 points per key)
# --config keys that are train()'s run arguments rather than RLConfig knobs
RUN_KEYS = ("speculate", "speculate_adaptive", "precision", "system")


_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "jaxrl_sym_learning_xla")
_FULL: dict[str, Any] = {
    "algos": ",".join(ALGOS), "tasks": "reverse,copy", "seeds": ",".join(map(str, SEEDS)),
    "steps": 400, "task_steps": "",  # per-task step counts overriding steps, e.g. copy=200
    "prompts": 32, "max_digits": 3, "eval_prompts": 256,
    "model": "",  # JSON of LMConfig overrides (default: TASK_MODEL)
    "jobs": 2,  # runs at a time (one process each)
    "pass_level": 0.3,  # final greedy exact match a seed must reach to count as learned
    # JAX persistent compilation cache shared by the runs ('': off)
    "compile_cache": _CACHE, "out": os.path.join(child.ROOT, "bench/results/cpu/learning")}
PRESETS: dict[str, dict[str, Any]] = {
    # CI size: GRPO on reverse, seed 11 (it stalled before the recipe of issue 12), 100 steps
    "quick": {**_FULL, "algos": "grpo", "tasks": "reverse", "seeds": "11", "steps": 100,
              "eval_prompts": 128, "out": os.path.join(presets.quick_dir("learning"),
                                                        "learning")},
    "full": _FULL,
    "gpu": _FULL,
}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = presets.parser("learning", __doc__, PRESETS)
    p.add_argument("--algos", default=None, type=presets.names(ALGOS, "algorithm"),
                   help="comma-separated: " + ", ".join(ALGOS))
    p.add_argument("--tasks", default=None, type=presets.names(TASK_NAMES, "task"),
                   help="comma-separated: " + ", ".join(TASK_NAMES))
    p.add_argument("--seeds", default=None, type=presets.ints(0), help="comma-separated seeds")
    p.add_argument("--steps", type=presets.at_least(1), default=None)
    p.add_argument("--jobs", type=presets.at_least(1), default=None,
                   help="runs at a time (one process each)")
    p.add_argument("--out", default=None, help="OUT.jsonl, OUT.md and OUT.png")
    p.add_argument("--force", action="store_true", help="re-run finished runs")
    p.add_argument("--partial", action="append", default=None, metavar="off|JSON",
                   help="partial rollouts per run: 'off' or PartialConfig fields as JSON; "
                        "repeat to compare (default: off)")
    p.add_argument("--config", action="append", default=None, metavar="JSON",
                   help="JSON of RLConfig overrides (plus the run's speculate / "
                        "speculate_adaptive / precision / system); repeat to compare arms side "
                        "by side "
                        "(e.g. '{}' and '{\"speculate\": 4}'; default: none)"
                        ". --jobs 2 runs two arms at once, so they see the same load")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = presets.parse(p, PRESETS, argv)
    for name in ("steps", "prompts", "jobs", "max_digits"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def task_steps(args: argparse.Namespace) -> dict[str, int]:
    out = {}
    for item in filter(None, args.task_steps.split(",")):
        name, _, n = item.partition("=")
        out[name] = int(n)
    return out


def specs(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One spec per run, in the order they are started (seeds innermost: a partial benchmark
    has whole (algorithm, task) rows)."""
    per_task = task_steps(args)
    model = json.loads(args.model) if args.model else None
    configs = [json.loads(c) or None for c in (args.config or ["{}"])]
    partials = [None if v == "off" else json.loads(v) for v in (args.partial or ["off"])]
    return [dict(algo=a, task=t, seed=int(s), steps=per_task.get(t, args.steps),
                 prompts=args.prompts, max_digits=args.max_digits,
                 eval_prompts=args.eval_prompts, model=model, config=c, partial=pr)
            for t in args.tasks.split(",") for a in args.algos.split(",")
            for c in configs for pr in partials for s in args.seeds.split(",")]


def key(spec: dict[str, Any]) -> tuple:
    return (spec["algo"], spec["task"], spec["seed"], spec["steps"], spec["prompts"],
            spec["max_digits"], json.dumps(spec.get("config"), sort_keys=True),
            json.dumps(spec.get("partial"), sort_keys=True))


def enable_compile_cache(directory: str) -> None:
    """Share XLA executables between runs through JAX's persistent cache: every run of the
    benchmark compiles the same programs (same model, same shape buckets), and on a loaded
    2-core CPU compiling is most of a short run. Results do not depend on it (same programs);
    ``compile_seconds`` of later runs then counts cache loads."""
    import jax

    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def run_child(spec: dict[str, Any], cache_dir: str | None = None) -> dict[str, Any]:
    """One training run in this process (``--child``): the summary plus downsampled curves."""
    from jaxrl_sym.rl.run.train import TASK_RECIPE, TASK_REWARD, train

    if cache_dir:
        enable_compile_cache(cache_dir)

    t0 = time.perf_counter()
    # speculation, precision and system are the run's (train's arguments), not RLConfig's
    config = dict(spec.get("config") or {})
    run = {k: config.pop(k) for k in RUN_KEYS if k in config}
    out = train(spec["algo"], spec["task"], steps=spec["steps"], seed=spec["seed"],
                prompts_per_step=spec["prompts"], max_digits=spec["max_digits"],
                eval_prompts=spec["eval_prompts"], model=spec["model"], progress=False,
                config=config or None, partial=spec.get("partial"), **run)
    hist = out.pop("history")
    curves = {k: [round(float(np.mean([m[k] for m in hist[i:i + CURVE_EVERY]])), 4)
                  for i in range(0, len(hist), CURVE_EVERY)] for k in CURVE_KEYS}
    flagged = [(m["step"], m["health"]) for m in hist if m.get("health")]
    return {**spec, "final_exact_match": out["final_exact_match"],
            "first20_exact_match": float(np.mean([m["exact_match"] for m in hist[:20]])),
            "last20_exact_match": float(np.mean([m["exact_match"] for m in hist[-20:]])),
            "last20_reward": float(np.mean([m["reward"] for m in hist[-20:]])),
            "last20_entropy": float(np.mean([m["entropy"] for m in hist[-20:]])),
            "first_health_flag": flagged[0] if flagged else None,
            "compile_seconds": float(sum(m["compile_seconds"] for m in hist)),
            "train_seconds": out["seconds"], "wall_seconds": time.perf_counter() - t0,
            "generation_seconds": float(sum(m["seconds"]["generation"] for m in hist)),
            "partial_stats": _partial_stats(hist, out.get("partial_left_rows", 0)),
            "acceptance_rate": _acceptance(hist),
            "params_sha256": out["params_sha256"], "recipe": {**TASK_RECIPE, **TASK_REWARD},
            "git": _git_head(), "curve_every": CURVE_EVERY, "curves": curves}


def _acceptance(hist: list[dict[str, Any]]) -> float | None:
    """Drafts accepted / drafted over the run (None without speculation)."""
    drafted = sum(m.get("drafted_tokens", 0) for m in hist)
    return sum(m.get("accepted_tokens", 0) for m in hist) / drafted if drafted else None


def _partial_stats(hist: list[dict[str, Any]], left: int) -> dict[str, Any] | None:
    """Totals of the steps' partial-rollout stats (None when the run had them off)."""
    parts = [m["partial"] for m in hist if "partial" in m]
    if not parts:
        return None
    return {"trained_rows": sum(p["trained_rows"] for p in parts),
            "trained_carried_rows": sum(p["trained_carried_rows"] for p in parts),
            "mean_carried_rows": float(np.mean([p["carried_rows"] for p in parts])),
            "mean_segments": float(np.mean([p["segments"] for p in parts])),
            "max_staleness": max(p["max_staleness"] for p in parts), "left_untrained": left}


def _git_head() -> str | None:
    """The commit the library was loaded from (``JAXRL_SYM_GIT`` for a ``git archive``
    snapshot without .git), for the record."""
    return os.environ.get("JAXRL_SYM_GIT") or git_commit() or None


def launch(spec: dict[str, Any], cache_dir: str) -> dict[str, Any]:
    """Run one spec in a child process (its own JAX runtime and threads) and parse its line."""
    t0 = time.perf_counter()
    res = child.run(child.experiment("learning", "--child",
                                     json.dumps({**spec, "compile_cache": cache_dir})))
    if not res.ok:
        return {**spec, "error": res.stderr.strip().splitlines()[-5:],
                "wall_seconds": time.perf_counter() - t0}
    row = json.loads(res.stdout.strip().splitlines()[-1])
    row["process_seconds"] = time.perf_counter() - t0
    return row


def load(path: str) -> list[dict[str, Any]]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def summarise(rows: list[dict[str, Any]], pass_level: float) -> list[dict[str, Any]]:
    """One entry per (algorithm, task, steps): final greedy exact match over its seeds."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        if "error" not in r:
            pk = json.dumps(r.get("partial"), sort_keys=True)
            ck = json.dumps(r.get("config"), sort_keys=True)
            groups.setdefault((r["algo"], r["task"], r["steps"], pk, ck), []).append(r)
    out = []
    for (algo, task, steps, pk, ck), rs in groups.items():
        acc = [r["acceptance_rate"] for r in rs if r.get("acceptance_rate") is not None]
        rs = sorted(rs, key=lambda r: r["seed"])
        fin = [r["final_exact_match"] for r in rs]
        out.append(dict(
            algo=algo, task=task, steps=steps, seeds=[r["seed"] for r in rs],
            partial=json.loads(pk), config=json.loads(ck),
            acceptance=float(np.mean(acc)) if acc else None,
            generation_mean=float(np.mean([r.get("generation_seconds", np.nan) for r in rs])),
            finals=fin, mean=float(np.mean(fin)), min=float(np.min(fin)),
            max=float(np.max(fin)), passed=sum(f >= pass_level for f in fin),
            initial=float(np.mean([r["first20_exact_match"] for r in rs])),
            wall_mean=float(np.mean([r["process_seconds"] for r in rs])),
            wall_total=float(np.sum([r["process_seconds"] for r in rs]))))
    return out


def table(summary: list[dict[str, Any]], pass_level: float) -> str:
    lines = ["| algo | task | steps | seeds | final greedy exact match: mean | min | max | "
             f"seeds >= {pass_level} | per seed | sampled exact match, first 20 steps | "
             "wall s per run (mean) | generation s (mean) | partial rollouts | config | "
             "draft acceptance |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in summary:
        per = ", ".join(f"{seed}: {f:.3f}" for seed, f in zip(s["seeds"], s["finals"],
                                                              strict=True))
        part = "off" if s["partial"] is None else json.dumps(s["partial"]).replace("|", "/")
        conf = "-" if s["config"] is None else json.dumps(s["config"]).replace("|", "/")
        acc = "-" if s["acceptance"] is None else f"{s['acceptance']:.3f}"
        lines.append(f"| {s['algo']} | {s['task']} | {s['steps']} | {len(s['seeds'])} | "
                     f"{s['mean']:.3f} | {s['min']:.3f} | {s['max']:.3f} | "
                     f"{s['passed']}/{len(s['seeds'])} | {per} | {s['initial']:.3f} | "
                     f"{s['wall_mean']:.0f} | {s['generation_mean']:.0f} | {part} | {conf} | "
                     f"{acc} |")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], out_png: str) -> None:
    """Sampled exact match and entropy per step, one panel pair per task, a line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if "error" not in r]
    tasks = sorted({r["task"] for r in rows})
    fig, axes = plt.subplots(2, len(tasks), figsize=(6.5 * len(tasks), 7.5), squeeze=False)
    colors = {"grpo": "tab:blue", "rloo": "tab:orange", "ppo": "tab:green"}
    for j, task in enumerate(tasks):
        for r in (r for r in rows if r["task"] == task):
            x = np.arange(len(r["curves"]["exact_match"])) * r["curve_every"] + r["curve_every"]
            kw = dict(color=colors.get(r["algo"], "gray"), lw=1, alpha=0.7)
            label = r["algo"] if r["seed"] == min(q["seed"] for q in rows
                                                  if q["algo"] == r["algo"]) else None
            axes[0, j].plot(x, r["curves"]["exact_match"], label=label, **kw)
            axes[1, j].plot(x, r["curves"]["entropy"], **kw)
        axes[0, j].set(title=f"{task}: sampled exact match (a line per seed)", xlabel="step",
                       ylim=(0, 1))
        axes[1, j].set(title=f"{task}: policy entropy (nats/token)", xlabel="step",
                       yscale="log")
        axes[0, j].legend(fontsize=8)
        for ax in axes[:, j]:
            ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child is not None:
        spec = json.loads(args.child)
        cache = spec.pop("compile_cache", "")
        print(json.dumps(run_child(spec, cache or None)))
        return 0
    path = args.out + ".jsonl"
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    done = [] if args.force else [r for r in load(path) if "error" not in r]
    have = {key(r) for r in done}
    todo = [s for s in specs(args) if key(s) not in have]
    wanted = {key(s) for s in specs(args)}
    rows = [r for r in done if key(r) in wanted]
    print(f"{len(todo)} runs to do, {len(rows)} already done; {args.jobs} at a time",
          file=sys.stderr)
    t0 = time.perf_counter()
    with open(path, "w" if args.force else "a") as f, ThreadPoolExecutor(args.jobs) as pool:
        futures = [pool.submit(launch, s, args.compile_cache) for s in todo]
        for fut in as_completed(futures):  # written as each finishes: an interruption keeps it
            row = fut.result()
            row["date"] = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
            f.write(json.dumps(row) + "\n")
            f.flush()
            rows.append(row)
            msg = row.get("error") or f"final greedy exact match {row['final_exact_match']:.3f}"
            print(f"[{time.perf_counter() - t0:6.0f}s] {row['algo']} {row['task']} seed "
                  f"{row['seed']}: {msg}", file=sys.stderr)
    summary = summarise(rows, args.pass_level)
    md = table(summary, args.pass_level)
    with open(args.out + ".md", "w") as f:
        f.write(md + "\n")
    if rows:
        plot(rows, args.out + ".png")
    print(md)
    print(json.dumps({"summary": summary}))
    return 0
