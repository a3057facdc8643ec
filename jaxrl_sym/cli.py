"""``jaxrl-sym``: side-by-side padding-vs-symbolic decoding on the same model and weights.

Every system runs in its own process (so peak RSS is its own), twice: a cold run (compiles
included, logits kept for the check) and a warm run (steady-state seconds per token). The parent
compares sym's tokens and logits against padded's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

from jaxrl_sym.systems import SYSTEMS

# GPT-2-like multi-head shape scaled down for a CPU: like real long-context decoding, the KV
# state (not the weights) dominates memory at a few thousand tokens, which is the regime the
# padding-vs-symbolic comparison is about (paper Fig. 3 uses GPT-2 small at batch 64).
DECODE_CPU = {"d_model": 64, "n_layers": 6, "n_heads": 4, "n_kv_heads": 4, "head_dim": 16,
              "ffn_dim": 128, "vocab_size": 128}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxrl-sym", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("decode", help="compare generation systems on one model")
    d.add_argument("--attention", choices=("full", "window", "block", "linear", "mixed"),
                   default="full")
    d.add_argument("--tokens", type=int, default=128, help="new tokens per row")
    d.add_argument("--batch", type=int, default=4)
    d.add_argument("--prompt-len", default="8:24", help="MIN:MAX prompt lengths")
    d.add_argument("--window", type=int, default=128)
    d.add_argument("--block", type=int, default=64)
    d.add_argument("--systems", default="sym,padded")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--preset", default="decode-cpu",
                   help="model preset: decode-cpu (default), tiny, small, gpt2-small, qwen2.5-0.5b")
    d.add_argument("--model", default=None, metavar="MODULE:FUNCTION",
                   help="your own model: FUNCTION(seed) in importable MODULE returns an nnx.Module "
                        "following the contract model(tokens, positions, segment_ids) -> logits; "
                        "--preset/--attention/--window/--block are then ignored (the model "
                        "defines its attention)")
    d.add_argument("--backend", default="xla", choices=("xla", "triton", "auto"),
                   help="sym's kernels: xla, triton (interpreted on CPU), auto")
    d.add_argument("--json", action="store_true", help="print one JSON object")
    d.add_argument("--no-warm", action="store_true", help="skip the warm (timing) run")
    from jaxrl_sym.rl.cli import add_train_parser

    add_train_parser(sub)
    r = sub.add_parser("_system", help=argparse.SUPPRESS)
    r.add_argument("spec")
    r.add_argument("out")
    return p


def _spec(args: argparse.Namespace, system: str) -> dict[str, Any]:
    lo, _, hi = args.prompt_len.partition(":")
    return {"system": system, "attention": args.attention, "tokens": args.tokens,
            "batch": args.batch, "prompt_len": [int(lo), int(hi or lo)], "window": args.window,
            "block": args.block, "seed": args.seed, "preset": args.preset, "model": args.model,
            "backend": args.backend, "warm": not args.no_warm}


def user_model(ref: str, seed: int) -> Any:
    """``MODULE:FUNCTION`` → ``FUNCTION(seed)``, checked against the model contract."""
    import importlib

    from jaxrl_sym.errors import InputError
    from jaxrl_sym.models.contract import check_model

    mod_name, _, fn_name = ref.partition(":")
    try:
        fn = getattr(importlib.import_module(mod_name), fn_name)
    except (ImportError, AttributeError) as err:
        raise InputError(f"--model {ref}: cannot import {fn_name!r} from {mod_name!r} ({err}); "
                         "is the module on PYTHONPATH?") from err
    model = fn(seed)
    check_model(model)
    return model


def build_model(spec: dict[str, Any]):
    """The model and prompts every system shares (same seed → same weights and prompts)."""
    from dataclasses import replace

    from jaxrl_sym.models.contract import check_model

    if spec.get("model"):
        model = user_model(spec["model"], spec["seed"])
        return model, _prompts(spec, check_model(model).vocab_size)

    from flax import nnx

    from jaxrl_sym.models.lm import DecoderLM, LMConfig, preset
    from jaxrl_sym.ops.attention import Block, Causal, Linear, Window

    cfg = (preset("small", **DECODE_CPU) if spec["preset"] == "decode-cpu"
           else preset(spec["preset"]))
    n = cfg.n_layers
    att = spec["attention"]
    if att == "mixed":
        cfg = replace(cfg, patterns=LMConfig.mixed(spec["window"], n_layers=n).patterns)
    else:
        pat = {"full": Causal(), "window": Window(spec["window"]), "block": Block(spec["block"]),
               "linear": Linear()}[att]
        cfg = replace(cfg, patterns=(pat,) * n)
    return DecoderLM(cfg, rngs=nnx.Rngs(spec["seed"])), _prompts(spec, cfg.vocab_size)


def _prompts(spec: dict[str, Any], vocab: int) -> list[np.ndarray]:
    rng = np.random.default_rng(spec["seed"])
    lo, hi = spec["prompt_len"]
    return [rng.integers(0, vocab, size=int(rng.integers(lo, hi + 1)), dtype=np.int32)
            for _ in range(spec["batch"])]


def run_system(spec: dict[str, Any]) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Run one system cold (compiles, logits) then warm (timing). Returns (metrics, arrays)."""
    from dataclasses import replace

    from jaxrl_sym.generation import GenerationConfig
    from jaxrl_sym.runtime.metrics import peak_rss_bytes
    from jaxrl_sym.systems import generator

    model, prompts = build_model(spec)
    gcfg = GenerationConfig(max_new_tokens=spec["tokens"], return_logits=True)
    system = spec["system"]
    gen = generator(system, model, backend=spec["backend"])
    t0 = time.perf_counter()
    cold = gen(prompts, gcfg)
    cold_wall = time.perf_counter() - t0  # the whole call: every system's compiles included
    steps = max(len(t) for t in cold.tokens)
    metrics: dict[str, Any] = {
        "xla_compiles": int(cold.stats["xla_compiles"]),
        "s_per_token_with_compile": cold_wall / steps,
        "peak_bytes": int(cold.stats["peak_bytes"]),
        "generated_tokens": int(sum(len(t) for t in cold.tokens)),
        "dispatches": int(cold.stats.get("dispatches", -1)),
    }
    if spec.get("warm", True):
        nolog = replace(gcfg, return_logits=False)
        if system == "sym":
            # The no-logits step programs are other executables than the cold run's: compile
            # them in an untimed call, so ``s_per_token`` is steady state (the padded baseline
            # reports its run time without its compile already).
            gen(prompts, nolog)
        warm = gen(prompts, nolog)
        metrics["s_per_token"] = warm.stats["run_seconds"] / steps
        metrics["peak_bytes"] = int(warm.stats["peak_bytes"])
        metrics["warm_xla_compiles"] = int(warm.stats["xla_compiles"])
    else:
        metrics["s_per_token"] = metrics["s_per_token_with_compile"]
    metrics["peak_rss_bytes"] = peak_rss_bytes()
    arrays = {f"tok{i}": t for i, t in enumerate(cold.tokens)}
    arrays.update({f"logit{i}": lg for i, lg in enumerate(cold.logits or [])})
    return metrics, arrays


def _check(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> dict[str, Any]:
    rows = sum(1 for k in a if k.startswith("tok"))
    equal = all(np.array_equal(a[f"tok{i}"], b[f"tok{i}"]) for i in range(rows))
    diff = 0.0
    for i in range(rows):
        la, lb = a.get(f"logit{i}"), b.get(f"logit{i}")
        if la is not None and lb is not None:
            n = min(len(la), len(lb))
            if n:
                diff = max(diff, float(np.max(np.abs(la[:n] - lb[:n]))))
    return {"tokens_equal": bool(equal), "max_abs_logit_diff": diff}


def decode(args: argparse.Namespace) -> dict[str, Any]:
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    bad = [s for s in systems if s not in SYSTEMS]
    if bad:
        raise SystemExit(f"--systems: unknown {bad}; choose from {', '.join(SYSTEMS)}")
    results: dict[str, Any] = {}
    arrays: dict[str, dict[str, np.ndarray]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for s in systems:
            spec_path = os.path.join(tmp, f"{s}.json")
            out = os.path.join(tmp, f"{s}.npz")
            with open(spec_path, "w") as f:
                json.dump(_spec(args, s), f)
            cmd = [sys.executable, "-m", "jaxrl_sym.cli", "_system", spec_path, out]
            # GPU: the allocator's peak is only meaningful without XLA's preallocation.
            env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if proc.returncode != 0:
                results[s] = {"error": (proc.stderr or proc.stdout).strip().splitlines()[-1:]}
                continue
            with open(out + ".json") as f:
                results[s] = json.load(f)
            with np.load(out) as z:
                arrays[s] = dict(z)
    report: dict[str, Any] = {"config": _spec(args, "-"), "systems": results}
    report["config"].pop("system")
    if "sym" in arrays and "padded" in arrays:
        report["check"] = _check(arrays["sym"], arrays["padded"])
    import datetime
    import importlib.metadata as md

    import jax

    report["device"] = str(jax.devices()[0].device_kind)
    versions = {}
    for pkg in ("jax", "jaxlib", "flax", "numpy", "triton", "jax-triton"):
        with contextlib.suppress(md.PackageNotFoundError):
            versions[pkg] = md.version(pkg)
    report["versions"] = versions
    report["date"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    report["command"] = "jaxrl-sym " + " ".join(sys.argv[1:])
    return report


def _table(report: dict[str, Any]) -> str:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="jaxrl-sym decode " + " ".join(f"{k}={v}" for k, v in report["config"].items()))
    cols = ("s_per_token", "s_per_token_with_compile", "peak_bytes", "peak_rss_bytes",
            "xla_compiles", "dispatches")
    t.add_column("system")
    for c in cols:
        t.add_column(c, justify="right")
    for name, m in report["systems"].items():
        if "error" in m:
            t.add_row(name, *(["error"] + [""] * (len(cols) - 1)))
            continue
        t.add_row(name, *(f"{m[c]:.4g}" if isinstance(m[c], float) else f"{m[c]:,}"
                          for c in cols))
    console = Console(record=True, width=140)
    with console.capture() as cap:
        console.print(t)
        if "check" in report:
            console.print(f"sym vs padded: {report['check']}")
        for name, m in report["systems"].items():
            if "error" in m:
                console.print(f"[red]{name} failed:[/red] {m['error']}")
    return cap.get()


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.cmd == "_system":
        with open(args.spec) as f:
            spec = json.load(f)
        metrics, arrays = run_system(spec)
        np.savez(args.out, **arrays)
        with open(args.out + ".json", "w") as f:
            json.dump(metrics, f)
        return 0
    if args.cmd == "decode":
        if args.model is not None and (":" not in args.model or args.model.startswith(":")
                                       or args.model.endswith(":")):
            _parser().error(f"--model {args.model!r}: want MODULE:FUNCTION, e.g. "
                            "mypkg.models:make_model")
        report = decode(args)
        print(json.dumps(report) if args.json else _table(report))
        return 0 if all("error" not in m for m in report["systems"].values()) else 1
    if args.cmd == "train":
        from jaxrl_sym.rl.cli import run_train

        return run_train(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
