"""The pieces of ``python -m bench project``: one system's ledger (in its child process), the
measured step beside it, the roofline per stage, the calibration against a committed GPU run
and the table. See :mod:`bench.experiments.project` for what is projected and why.

The room around it: the decode workload's projection (:mod:`.projection_decode`) and its page
(:mod:`.projection_decode_report`), compiling for an H100 on a machine without a GPU
(:mod:`.xla_gpu`), what XLA:GPU's thunk sequence launches (:mod:`.thunks`) and the dispatch
ledger of a generation request built on both (:mod:`.dispatch_ledger`). Importing any of them
runs this module first; its imports are light (numpy, :mod:`bench.lib.child`), never JAX."""

from __future__ import annotations

import dataclasses
import gc
import json
from argparse import Namespace
from typing import Any

import numpy as np

from bench.lib.child import ROOT

GB = 1e9
_STATE = ("weights", "optimizer", "reference")


def devices() -> dict[str, dict[str, Any]]:
    """Device constants by name (``bench/devices.json``; its ``_doc`` says where each is from)."""
    data = json.loads((ROOT / "bench" / "devices.json").read_text())
    return {k: v for k, v in data.items() if not k.startswith("_")}


def _workload(args: Namespace) -> tuple[list[np.ndarray], list[int], list[np.ndarray]]:
    from bench.experiments import rlft_step
    from bench.lib import models

    vocab = models.vocab_size(args.model, args.seed) if args.model in models.NAMES else None
    prompts, limits = rlft_step.workload(args, vocab)
    return prompts, limits, [p for p in prompts for _ in range(args.group)]


def _model(args: Namespace) -> Any:
    """The policy: the preset's Qwen2.5-shaped DecoderLM (``cpu``/``gpu``) or one of
    :mod:`bench.lib.models` (``--model zoo-gpt2``, ``zoo-gemmaish``, ``hf-llama``)."""
    from bench.experiments import rlft_step
    from bench.lib import models
    from jaxrl_sym.models.lm import init_model, preset

    if args.model in models.NAMES:
        return models.build(args.model, args.seed)
    return init_model(preset("small", **rlft_step.model_config(args)), args.seed)


def system_ledger(args: Namespace, name: str) -> dict[str, Any]:
    """``name``'s step ledger on the preset's workload (and the trainer, for a measurement)."""
    from bench.experiments import rlft_step
    from jaxrl_sym.generation import GenerationConfig
    from jaxrl_sym.rl import RLTrainer
    from jaxrl_sym.rl.step.ledger import step_ledger
    from jaxrl_sym.runtime.options import EngineOptions
    from jaxrl_sym.weights.lora_config import LoraConfig

    _, limits, expanded = _workload(args)
    model = _model(args)
    cfg = rlft_step.rl_config(args, limits)
    lora = None if not args.lora_rank else LoraConfig(rank=args.lora_rank)
    engine = EngineOptions(**json.loads(args.engine)) if args.engine else None
    trainer = RLTrainer(model, rlft_step.reward_fn, cfg, system=name, engine=engine,
                        precision=args.precision or "fp32", lora=lora)
    # generation reads the trainer's forward weights (a bf16 copy, LoRA merged): the model
    # the estimate and the decode bytes are taken of
    st = trainer.state
    model = trainer.view.compute_model(trainer.graphdef, trainer.treedef, st.params["lm"],
                                       st.frozen)
    bound = trainer.forwards.bound(trainer.system)  # the trainer's own generation options
    gcfg = GenerationConfig(max_new_tokens=max(limits))
    est = bound.estimate([len(p) for p in expanded], gcfg)
    compiler = None
    if getattr(args, "compile_for", None):
        from bench.lib.projection import xla_gpu

        compiler = xla_gpu.compiler(args.compile_for)
    # generation's peak: the system's own walk over the step's lengths, its programs compiled
    # (rows that end free their share), else its worst-case estimate (every row to the longest)
    walk = bound.ledger(expanded, GenerationConfig(max_new_tokens=tuple(int(n) for n in limits)),
                        compiler=compiler)
    generation = walk if walk is not None else est
    # projected for an accelerator, where the trainer scores the reference during generation
    sl = step_ledger(trainer, expanded, limits, overlap=args.preset == "gpu",
                     generation=generation, compiler=compiler)
    ledger = sl.ledger.to_dict()
    ledger["generation_from"] = ("walk: the system's own programs over the step's lengths"
                                 if walk is not None else "estimate: every row to the longest")
    # what a decode step reads: the forward's weights (the bf16 copy, LoRA merged), not every
    # weight the peak holds (at a generation peak also LoRA's frozen base, the master copy)
    from flax import nnx

    from jaxrl_sym.runtime.metrics import tree_bytes
    weights = tree_bytes(nnx.state(model, nnx.Param))
    return {"_trainer": trainer, "ledger": ledger, "layout_shape": sl.layout_shape,
            "programs": [{"stage": s, "count": c, **dataclasses.asdict(p)}
                         for s, c, p in sl.programs],
            "decode": decode_bytes(model, [len(p) for p in expanded], limits, weights),
            **largest_batches(bound, expanded, gcfg, ledger, est, walk,
                              compiler=compiler, limits=limits)}


def decode_bytes(model: Any, prompt_lens: list[int], limits: list[int],
                 weights: int) -> dict[str, int]:
    """What generation must read at least: the weights once per decode step (rows decode in
    lockstep until the longest ends) and each live row's K/V once per step it decodes."""
    from jaxrl_sym.runtime.memory.estimate import attend_calls

    calls, _ = attend_calls(model)
    size = lambda dt: np.dtype(dt).itemsize
    per_token = sum(c.hkv * (c.d * size(c.k_dtype) + c.dv * size(c.v_dtype)) for c in calls)
    kv = sum(n * p + n * (n - 1) // 2 for p, n in zip(prompt_lens, limits, strict=True))
    steps = max(limits)
    return {"steps": steps, "weights_bytes": steps * weights, "kv_bytes": kv * per_token,
            "kv_bytes_per_token": per_token}


def largest_batches(bound: Any, expanded: list[np.ndarray], gcfg: Any, ledger: dict[str, Any],
                    est: Any, walk: Any, *, compiler: Any, limits: list[int]) -> dict[str, Any]:
    """Samples that fit each device: generation's stores grow with the batch, the reference and
    update programs do not (``update_tokens`` fixes their micro-batch), so the largest batch is
    where generation's moment reaches the limit. Generation's bytes beyond the weights are taken
    at B and 2B samples (the same prompts and limits twice) and extended linearly: from the
    system's own walk where it has one (the moment the step's ledger holds), else from its
    estimate (sym's: every row decodes to the longest). ``largest_batch_from`` says which, with
    both growths per sample. None: generation holds no more at 2B than at B (refill, or groups
    that run one after another), so no batch size is refused by generation."""
    others = max((m["total"] for s, m in ledger["stages"].items() if s != "generation"),
                 default=0)
    gen = ledger["stages"].get("generation")
    b = len(expanded)
    e2 = bound.estimate([len(p) for p in expanded] * 2, gcfg)
    grown = {"estimate": ((est.total - est.weights), (e2.total - e2.weights))}
    if walk is not None:
        w2 = bound.ledger(list(expanded) * 2, dataclasses.replace(
            gcfg, max_new_tokens=tuple(int(n) for n in limits) * 2), compiler=compiler)
        if w2 is not None:
            grown["walk"] = (_beyond_weights(walk), _beyond_weights(w2))
    used = "walk" if "walk" in grown else "estimate"
    per = {k: (two - one) / b for k, (one, two) in grown.items()}
    per_sample = per[used]
    fixed = (gen["total"] if gen else 0) - per_sample * b  # state, the rest of generation
    out: dict[str, int | None] = {}
    for name, d in devices().items():
        limit = d["memory"] * d["jax_fraction"]
        if others > limit or fixed > limit:  # not even one sample fits (the batch at hand
            out[name] = 0  # may not, where a smaller one does)
        elif per_sample < 1024:  # generation holds no more at 2B: no bound from it
            out[name] = None
        else:
            out[name] = max(0, int((limit - fixed) // per_sample))
    return {"largest_batch": out, "largest_batch_from": {
        "used": used, "per_sample_bytes": {k: round(v) for k, v in per.items()},
        "generation_bytes_at_b_2b": {k: list(v) for k, v in grown.items()},
        "fixed_bytes": round(fixed), "samples": b}}


def _beyond_weights(walk: Any) -> int:
    """A generation walk's largest moment without the weights it was given."""
    return max(m.total for m, _ in walk.beyond_weights())


def measure_step(args: Namespace, trainer: Any) -> dict[str, Any]:
    """A warm-up step (compiles), then one step with RSS sampled (see ``RssSampler``)."""
    from jaxrl_sym.runtime.metrics import RssSampler, trim_host_heap

    prompts, limits, _ = _workload(args)
    trainer.step(prompts, seed=1, limits=limits)
    gc.collect()
    trim_host_heap()  # as the step itself does before its update: the baseline holds the state
    with RssSampler() as s:
        m = trainer.step(prompts, seed=2, limits=limits)
    return {"rss_before": s.before, "rss_peak": s.peak, "rise": s.rise,
            "seconds": m["seconds"], "compiles": m["compiles"],
            "layout_shape": m["layout_shape"], "responses_sha256": m["responses_sha256"]}


def roofline(row: dict[str, Any], dev: dict[str, Any]) -> dict[str, Any]:
    """Projected seconds per stage and the peak against the device's limit."""
    flops = dev["flops"]["float32"]
    stages: dict[str, float] = {}
    for p in row["programs"]:
        t = max(p["flops"] / flops, p["bytes_accessed"] / dev["bandwidth"]) + dev["dispatch_s"]
        stages[p["stage"]] = stages.get(p["stage"], 0.0) + p["count"] * t
    d = row["decode"]
    stages["generation floor"] = (d["weights_bytes"] + d["kv_bytes"]) / dev["bandwidth"]
    peak = row["ledger"]["peak"]["total"]
    limit = dev["memory"] * dev["jax_fraction"]
    return {"seconds": stages, "peak": peak, "limit": limit, "fits": peak <= limit}


def calibration(report: dict[str, Any], dev: dict[str, Any]) -> list[dict[str, Any]]:
    """Projected vs the newest committed run on this device of the same configuration
    (precision, LoRA rank, update tokens, preset): :func:`measured_runs`. A configuration never
    run on the device gets no rows, not another configuration's."""
    want = run_config(report["config"])
    rows = []
    for name, r in report["systems"].items():
        runs = [m for m in measured_runs(dev) if name in m["systems"]
                and run_config(m["config"]) == want]
        if "error" in r or not runs:
            continue
        run = max(runs, key=lambda m: m["date"])
        got = run["systems"][name]
        proj = r["projection"]
        pairs = {"peak GB": (proj["peak"] / GB, got["peak_bytes"] / GB),
                 "update s": (proj["seconds"].get("update", 0.0), got["seconds"]["update"]),
                 "generation s (floor)": (proj["seconds"]["generation floor"],
                                          got["seconds"]["generation"])}
        for what, (p, m) in pairs.items():
            rows.append({"system": name, "what": what, "projected": p, "measured": m,
                         "miss": p / m - 1 if m else None, "source": run["source"]})
    return rows


def run_config(cfg: dict[str, Any]) -> tuple[Any, ...]:
    """What must agree between a projection and a run for one to calibrate the other (the
    first H100 run's reports predate ``precision`` and ``lora_rank``: fp32, no LoRA; every run
    before ``ExecutionConfig.remat`` kept the activations: remat off)."""
    return (cfg.get("preset"), cfg.get("cap"), cfg.get("precision") or "fp32",
            cfg.get("lora_rank") or 0,
            bool(cfg.get("remat", False)), cfg.get("overlap_reference"),
            cfg.get("update_tokens"), cfg.get("logprob_chunk"),
            json.dumps(json.loads(cfg["engine"]), sort_keys=True) if cfg.get("engine") else None)


def measured_runs(dev: dict[str, Any]) -> list[dict[str, Any]]:
    """Every committed RL-step run on ``dev``: the first run's ``rlft_step_<system>.json`` and
    the GPU plan's ``rl_step*`` rows (``<date>/plan.jsonl``) run with the default XLA flags, each
    with its config and date."""
    base = ROOT / "bench" / "results" / dev["results"]
    runs = []
    for path in sorted(base.glob("rlft_step_*.json")):
        rep = json.loads(path.read_text())
        runs.append({**rep, "source": str(path.relative_to(ROOT))})
    for path in sorted(base.glob("*/plan.jsonl")):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            # a row run under its own XLA flags (autotuner off, command buffers) is a variant,
            # not the configuration's measurement
            if (row["item"].startswith("rl_step") and row["status"] == "ok" and row["result"]
                    and not row.get("env")):
                tree = f", tree {row['commit'][:7]}" if row.get("commit") else ""
                runs.append({**row["result"],
                             "source": f"{path.relative_to(ROOT)} ({row['item']}{tree})"})
    return runs


def render(report: dict[str, Any]) -> str:
    """The report as markdown: peaks, their buffers, times, and the calibration."""
    dev = report["device"]
    lines = [f"# RL step projected to {dev['name']} ({report['preset']} preset)", "",
             f"`{report['command']}`", "", "| system | stage | moment | GB | by kind (GB) |",
             "|---|---|---|---:|---|"]
    for name, r in report["systems"].items():
        if "error" in r:
            lines.append(f"| {name} | error | {r['error']} | | |")
            continue
        for stage, m in r["ledger"]["stages"].items():
            kinds = ", ".join(f"{k} {v / GB:.2f}" for k, v in m["by_kind"].items())
            lines.append(f"| {name} | {stage} | {m['what']} | {m['total'] / GB:.2f} | {kinds} |")
    lines += ["", "| system | layout | peak GB | fits | " + " | ".join(
        ("update s", "reference s", "generation floor s")) + " | largest batch |",
        "|---|---|---:|---|---:|---:|---:|---|"]
    for name, r in report["systems"].items():
        if "error" in r:
            continue
        p, s = r["projection"], r["projection"]["seconds"]
        fit = ", ".join(f"{k} {'any (rows resident fixed)' if v is None else v}"
                        for k, v in r["largest_batch"].items())
        lines.append(f"| {name} | {r['layout_shape'][0]}×{r['layout_shape'][1]} | "
                     f"{p['peak'] / GB:.2f} | {'yes' if p['fits'] else 'NO'} | "
                     f"{s.get('update', 0):.2f} | {s.get('reference', 0):.2f} | "
                     f"{s['generation floor']:.2f} | {fit} |")
    lines += _peak_buffers(report) + _measured(report) + _calibrated(report)
    return "\n".join(lines)


def _peak_buffers(report: dict[str, Any]) -> list[str]:
    out = ["", "Buffers at each system's peak:", ""]
    for name, r in report["systems"].items():
        if "error" in r:
            continue
        pk, src = r["ledger"]["peak"], r["ledger"].get("generation_from")
        if src:
            out.append(f"- {name}'s generation moment from the {src}")
        out.append(f"- **{name}** ({pk['stage']}, {pk['what']}, {pk['total'] / GB:.2f} GB): "
                   + "; ".join(f"{b['name']} {b['bytes'] / GB:.3f}" for b in pk["buffers"]
                               if b["bytes"] >= pk["total"] / 200))
    return out


def _measured(report: dict[str, Any]) -> list[str]:
    rows = [(n, r) for n, r in report["systems"].items() if "measured" in r]
    if not rows:
        return []
    out = ["", "Ledger vs this machine (RSS rise during the measured step vs the ledger's peak "
                "minus the state held before it):", "",
           "| system | ledger transient GB | measured rise GB | ledger ÷ measured "
           "| RSS peak GB | step s | responses sha256 |",
           "|---|---:|---:|---:|---:|---:|---|"]
    for name, r in rows:
        pk, m = r["ledger"]["peak"], r["measured"]
        transient = pk["total"] - sum(pk["by_kind"].get(k, 0) for k in _STATE)
        rise = m["rise"]
        out.append(f"| {name} | {transient / GB:.3f} | {rise / GB:.3f} | "
                   f"{transient / rise if rise else float('nan'):.2f} | "
                   f"{m['rss_peak'] / GB:.3f} | {m['seconds']['total']:.1f} | "
                   f"{m.get('responses_sha256', '-')[:12]} |")
    digests = {r["measured"].get("responses_sha256") for _, r in rows}
    if len(rows) > 1 and None not in digests:
        out += ["", "Same tokens on every system (same prompts and seed): "
                + ("**yes**" if len(digests) == 1 else
                   "**no** (a sampling near-tie tips one token and its sample's continuation; "
                   "compare the samples to tell it from a bug)")]
    return out


def _calibrated(report: dict[str, Any]) -> list[str]:
    rows = report.get("calibration") or []
    if not rows:
        return []
    out = ["", "Projected vs measured on the device:", "",
           "| system | what | projected | measured | miss | measured in |",
           "|---|---|---:|---:|---:|---|"]
    for c in rows:
        miss = "-" if c["miss"] is None else f"{c['miss']:+.0%}"
        out.append(f"| {c['system']} | {c['what']} | {c['projected']:.2f} | {c['measured']:.2f} "
                   f"| {miss} | {c['source']} |")
    return out
