"""``python -m bench project --workload decode``: a generation request's peak memory (a ledger of
named buffers, :mod:`jaxrl_sym.runtime.memory.ledger_generation`) and time, projected to a GPU from
XLA's own analyses of the programs each system runs — compiled on this machine, never run.

Why: the H100 decode measurements (``bench/results/nvidia-h100-80gb-hbm3``, README §3) are the
only GPU numbers for generation; a projection that reproduces them can be trusted where no GPU
is at hand, and where it misses, the term that is wrong says what a GPU pays that a CPU's
analysis does not show.

Each (system, model, attention) runs in its own process (:func:`run_child`), every length ``N``
of it with one compile cache (a program shared by two lengths compiles once). Time is a roofline
per program run — ``max(flops / peak flops, bytes / bandwidth)`` per step from ``cost_analysis``
(which counts a loop body once) times its steps, plus ``dispatch_s`` per dispatch — beside the
memory-bound floor (each decode step reads the weights and every live row's needed K/V once).
``--measure`` (the CPU presets) also runs each request here, a warm-up call then one with RSS
sampled (large buffers through ``mmap``, so RSS follows live bytes), and sets the ledger's transient
bytes (its peak minus the weights held before the call) beside the RSS rise, and the measured
seconds beside the floor at this machine's copy bandwidth. The ``gpu`` preset is the suite's
GPT-2-small decode (batch 64, prompts 8–24, window 512; ``bench/lib/suite/suite_jobs.py``) and on
``--device h100`` is set beside the committed measurements.
"""

from __future__ import annotations

import gc
import json
import re
import time
from argparse import Namespace
from pathlib import Path
from typing import Any

import numpy as np

from bench import presets
from bench.lib.child import ROOT
from bench.lib.projection import devices
from bench.lib.projection.projection_decode_report import render, write
from jaxrl_sym.systems import BASELINE, REFERENCE

_SUITE_SYSTEMS = {"padded": ("padded",), "sym": ("sym-xla", "sym-triton")}

PRESETS: dict[str, dict[str, Any]] = {
    "quick": {"runs": "decoder:full=256", "batch": 32, "prompt_len": (8, 24), "window": 64,
              "seed": 0, "systems": "sym,padded", "device": "h100", "measure": True,
              "out": str(Path(presets.quick_dir("project")) / "decode")},
    "full": {"runs": "decoder:full=512 decoder:window=512 zoo-gpt2:full=512", "batch": 32,
             "prompt_len": (8, 24), "window": 64, "seed": 0, "systems": "sym,padded",
             "device": "h100", "measure": True,
             "out": str(ROOT / "bench" / "results" / "projection" / "decode_full_cpu")},
    # the suite's gpu preset (GPT-2 small's shape, batch 64, window 512) at the measured lengths
    "gpu": {"runs": "gpt2-small:window=1024,4096,16384 gpt2-small:full=1024,4096", "batch": 64,
            "prompt_len": (8, 24), "window": 512, "seed": 0, "systems": "sym,padded",
            "device": "h100", "measure": False, "out": None},
}


def runs(text: str) -> list[tuple[str, str, list[int]]]:
    """``MODEL:ATTENTION=N,N MODEL:ATTENTION=N`` → [(model, attention, [N, …])]."""
    out = []
    for item in text.split():
        m = re.fullmatch(r"([\w.-]+):([\w+]+)=([\d,]+)", item)
        if m is None:
            raise ValueError(f"--runs {item!r}: write MODEL:ATTENTION=N[,N] (e.g. "
                             "decoder:full=256)")
        out.append((m[1], m[2], [int(n) for n in m[3].split(",")]))
    return out


def default_out(args: Namespace) -> str:
    """Where the gpu preset writes: beside the RL step's projection."""
    return str(ROOT / "bench" / "results" / "projection" / f"decode_{args.preset}_{args.device}")


# ------------------------------------------------------------------------------ the request


def build(args: Namespace, model_name: str, attention: str) -> Any:
    """The model: the suite's (``gpt2-small``, ``small`` as ``decoder``) or one of
    :mod:`bench.lib.models` (two zoo models without DecoderLM code, a Hugging Face checkpoint),
    whose attention is the model's own (``zoo-gemmaish:local+global=256``)."""
    from bench.lib import models
    from jaxrl_sym.decode_run import build_model

    if model_name in models.NAMES:
        return models.build(model_name, args.seed, attention)
    preset = "small" if model_name == "decoder" else model_name
    spec = {"preset": preset, "attention": attention, "window": args.window,
            "block": args.window, "seed": args.seed, "batch": 1, "prompt_len": [1, 1]}
    return build_model(spec)[0]


def request(args: Namespace, vocab: int, n: int) -> tuple[list[np.ndarray], Any]:
    """The suite's decode request: prompt lengths uniform in ``prompt_len`` (seeded as
    ``suite_jobs``), tokens as its child draws them, every row to ``n`` tokens."""
    from bench.lib.requests import prompt_tokens
    from jaxrl_sym.generation import GenerationConfig
    from jaxrl_sym.workloads import uniform

    lens = list(uniform(np.random.default_rng(args.seed), args.batch, *args.prompt_len))
    return prompt_tokens(args.seed, lens, vocab), GenerationConfig(max_new_tokens=n)


# ------------------------------------------------------------------------------ the child


def run_child(args: Namespace) -> dict[str, Any]:
    """``args.child`` = ``SYSTEM@MODEL:ATTENTION``: every length of that run, one process."""
    from jaxrl_sym.models.contract import check_model
    from jaxrl_sym.runtime.engine import SymbolicLM
    from jaxrl_sym.runtime.memory.ledger_generation import decode_floor

    system, _, what = args.child.partition("@")
    model_name, attention = what.split(":")
    lengths = next(ns for m, a, ns in runs(args.runs) if (m, a) == (model_name, attention))
    model = build(args, model_name, attention)
    vocab = check_model(model).vocab_size
    lm = SymbolicLM(model)  # sym's plan; padded reads its stores for the floor only
    weights = sum(int(x.nbytes) for x in lm.leaves)
    sizes: dict = {}
    rows, padded_programs = [], 0
    for n in lengths:
        prompts, cfg = request(args, vocab, n)
        t0 = time.perf_counter()
        gl = _ledger(system, lm, model, prompts, cfg, sizes)
        padded_programs += gl.compiled if system == BASELINE else 0
        row = {"model": model_name, "attention": attention, "tokens": n,
               "ledger_seconds": time.perf_counter() - t0, "ledger": gl.to_dict(),
               "dtype": _dtype(lm.leaves),
               "floor": decode_floor(lm.plan, weights, [len(p) for p in prompts],
                                     [n] * len(prompts))}
        if args.measure:
            row["measured"] = measure(system, lm, model, prompts, cfg)
        rows.append(row)
    return {"system": system, "rows": rows, "distinct_programs": len(sizes) + padded_programs}


def _ledger(system: str, lm: Any, model: Any, prompts: list[np.ndarray], cfg: Any,
            sizes: dict) -> Any:
    from jaxrl_sym.baselines.padded_ledger import padded_ledger
    from jaxrl_sym.runtime.memory.ledger_generation import sym_ledger

    if system == REFERENCE:
        return sym_ledger(lm.plan, lm.leaves, prompts, cfg, sizes=sizes)
    if system == BASELINE:
        return padded_ledger(model, prompts, cfg)
    raise ValueError(f"--systems {system}: the decode projection knows sym and padded")


def _dtype(leaves: list[Any]) -> str:
    """The dtype holding most weight bytes (which peak flops apply)."""
    by: dict[str, int] = {}
    for x in leaves:
        by[str(x.dtype)] = by.get(str(x.dtype), 0) + int(x.nbytes)
    return max(by, key=by.__getitem__)


def measure(system: str, lm: Any, model: Any, prompts: list[np.ndarray], cfg: Any
            ) -> dict[str, Any]:
    """A warm-up call (compiles, hoists), then one call with RSS sampled. Padded compiles its
    program on every call by design, so its program is compiled apart and only its run is
    sampled (the compiler's memory is not the generation's)."""
    from jaxrl_sym.runtime.metrics import RssSampler

    if system == REFERENCE:
        lm.generate(prompts, cfg)
        gc.collect()
        with RssSampler() as s:
            res = lm.generate(prompts, cfg)
        seconds = float(res.stats["run_seconds"])
        del res
    else:
        run = _padded_runner(model, prompts, cfg)
        run()
        gc.collect()
        with RssSampler() as s:
            t0 = time.perf_counter()
            run()
            seconds = time.perf_counter() - t0
    return {"rss_before": s.before, "rss_peak": s.peak, "rise": s.rise, "seconds": seconds}


def _padded_runner(model: Any, prompts: list[np.ndarray], cfg: Any) -> Any:
    """padded_generate's program, compiled once, run as it runs it (outputs read back)."""
    import jax
    from flax import nnx

    from jaxrl_sym.baselines.padded import left_pad_prompts, padded_program

    batch = left_pad_prompts(model, prompts, cfg)
    _, state = nnx.split(model)
    inputs = jax.device_put((batch.tokens, batch.positions, batch.prompt_lens, batch.limits))
    compiled = padded_program(model, batch, cfg).lower(state, *inputs).compile()

    def run() -> None:
        caches, out = compiled(state, *inputs)
        host = {k: np.asarray(v) for k, v in jax.block_until_ready(out).items()}
        del caches, out, host

    return run


def copy_bandwidth(nbytes: int = 1 << 28, repeats: int = 5) -> float:
    """This machine's copy bandwidth, bytes read + written per second (best of ``repeats``
    copies of ``nbytes``), as the H100's 2.76 TB/s was measured."""
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best


# ------------------------------------------------------------------------------ projection


def roofline(row: dict[str, Any], dev: dict[str, Any]) -> dict[str, Any]:
    """Projected seconds per kind of program run, the floor's seconds, and the peak against the
    device's limit.

    ``seconds``: the roofline with ``cost_analysis``'s bytes (as this machine's compiler
    schedules the program: its layout copies and unfused intermediates included).
    ``seconds_once``: the same with each distinct buffer of the program — its arguments and
    fresh outputs, ``memory_analysis`` — touched once per step: what a decode step that streams
    its weights and stores/caches once costs, whatever this machine's compiler does."""
    peak_flops = dev["flops"].get(row["dtype"], dev["flops"]["float32"])
    bw, stages, once = dev["bandwidth"], {}, 0.0
    for r in row["ledger"]["runs"]:
        launch = r["calls"] * dev["dispatch_s"]
        t = max(r["flops"] / peak_flops, r["bytes_accessed"] / bw) * r["steps"]
        stages[r["stage"]] = stages.get(r["stage"], 0.0) + t + launch
        touched = r["args"] + r["out"] - r["alias"]
        once += max(r["flops"] / peak_flops, touched / bw) * r["steps"] + launch
    f = row["floor"]
    peak = row["ledger"]["peak"]["total"]
    limit = dev["memory"] * dev["jax_fraction"]
    return {"seconds": sum(stages.values()), "stages": stages, "seconds_once": once,
            "peak": peak, "limit": limit, "fits": peak <= limit,
            "floor_seconds": (f["weights_bytes"] + f["kv_bytes"]) / bw}


def measured_rows(dev: dict[str, Any]) -> list[dict[str, Any]]:
    """The committed suite rows of this device (``bench/results/<device>/suite``)."""
    path = ROOT / "bench" / "results" / (dev.get("results") or "-") / "suite" / "results.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def calibration(report: dict[str, Any], dev: dict[str, Any]) -> list[dict[str, Any]]:
    """Projected vs measured per (run, measured system): the latest row of each (a re-run
    replaces an earlier one; the earlier stays listed in the results' README)."""
    got = {}
    for r in sorted(measured_rows(dev), key=lambda r: r.get("date", "")):
        if r.get("scenario") == "decode" and r.get("batch") == report["batch"]:
            got[(r["preset"], r["attention"], r["tokens"], r["system"])] = r
    out = []
    for system, rows in report["systems"].items():
        for row in rows.get("rows", []):
            for name in _SUITE_SYSTEMS.get(system, ()):
                m = got.get((row["model"], row["attention"], row["tokens"], name))
                if m is not None:
                    out.append(_calibrated(system, name, row, m))
    return out


def _calibrated(system: str, name: str, row: dict[str, Any], m: dict[str, Any]
                ) -> dict[str, Any]:
    p = row["projection"]
    ok = m.get("status") == "ok"
    s, peak = (m["seconds"], m["peak_bytes"]) if ok else (None, None)
    miss = lambda a, b: None if not b else a / b - 1
    return {"system": system, "measured_system": name, "attention": row["attention"],
            "tokens": row["tokens"], "status": m.get("status"), "date": m.get("date"),
            "projected_s": p["seconds"], "measured_s": s, "time_miss": miss(p["seconds"], s),
            "once_s": p["seconds_once"], "once_miss": miss(p["seconds_once"], s),
            "residual_ms_per_step": None if s is None else
            1e3 * (s - p["seconds_once"]) / max(1, row["tokens"] - 1),
            "floor_s": p["floor_seconds"],
            "measured_over_floor": None if s is None else s / p["floor_seconds"],
            "projected_peak": p["peak"], "measured_peak": peak,
            "memory_miss": miss(p["peak"], peak), "fits": p["fits"],
            "dispatches": {"projected": row["ledger"]["dispatches"],
                           "measured": m.get("dispatches")}}


# ------------------------------------------------------------------------------ command line


def parse_args(argv: list[str] | None) -> Namespace:
    import argparse

    p = presets.parser("project", __doc__, PRESETS)
    p.add_argument("--workload", choices=("decode",), default="decode", help=argparse.SUPPRESS)
    p.add_argument("--runs", default=None,
                   help="MODEL:ATTENTION=N[,N] … (models: decoder, zoo-gpt2, gpt2-small; "
                        "attention: full, window)")
    p.add_argument("--batch", type=int, default=None, help="rows per request")
    p.add_argument("--device", default=None, help=f"one of {', '.join(devices())}")
    p.add_argument("--systems", default=None, help="comma-separated: sym, padded")
    p.add_argument("--measure", type=lambda s: s.lower() in ("1", "true", "yes"), default=None,
                   help="also run each request here and compare the ledger with the RSS rise")
    p.add_argument("--out", default=None, help="OUT.json and OUT.md")
    p.add_argument("--render", action="store_true",
                   help="re-project and re-render OUT.json (device constants, calibration) "
                        "without compiling")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = presets.parse(p, PRESETS, argv)
    if args.device not in devices():
        p.error(f"--device {args.device}: choose one of {', '.join(devices())}")
    try:
        runs(args.runs)
    except ValueError as e:
        p.error(str(e))
    args.out = args.out or default_out(args)
    return args


def main(argv: list[str] | None = None) -> int:
    """Every (system, run) in its own process, then the projection, calibration and pages."""
    args = parse_args(argv)
    if args.child:
        print(json.dumps(run_child(args)))
        return 0
    dev = devices()[args.device]
    report = (json.loads(Path(args.out).with_suffix(".json").read_text()) if args.render
              else _run_children(args, argv))
    report["device"] = dev
    for out in report["systems"].values():
        for row in out["rows"]:
            row["projection"] = roofline(row, dev)
    report["calibration"] = calibration(report, dev)
    text = render(report)
    print(text)
    write(Path(args.out), report, text)
    return 0 if not any(s["errors"] for s in report["systems"].values()) else 1


def _run_children(args: Namespace, argv: list[str] | None) -> dict[str, Any]:
    from bench.lib import child

    report: dict[str, Any] = {"command": presets.command("project", argv), "preset": args.preset,
                              "batch": args.batch, "systems": {}}
    if args.measure:
        report["cpu_copy_bandwidth"] = copy_bandwidth()
    t0 = time.perf_counter()
    env = {"MALLOC_MMAP_THRESHOLD_": "65536", "JAX_PLATFORMS": "cpu"}
    for system in presets.csv(args.systems):
        out: dict[str, Any] = {"rows": [], "distinct_programs": 0, "errors": []}
        for model_name, attention, _ in runs(args.runs):
            res = child.run(child.experiment("project", *(argv or []), "--child",
                                             f"{system}@{model_name}:{attention}"), env=env)
            if not res.ok:
                out["errors"].append(f"{model_name}:{attention}: {res.status}: {res.tail()}")
                continue
            got = json.loads(res.stdout.strip().splitlines()[-1])
            out["rows"] += got["rows"]
            out["distinct_programs"] += got["distinct_programs"]
        report["systems"][system] = out
    report["seconds"] = time.perf_counter() - t0
    return report
