"""The padded baseline's generation program at the RL step's workload, compiled for an H100
without a GPU (:mod:`bench.lib.projection.xla_gpu`) and for this CPU: XLA's memory analysis side
by side and the largest temporaries by name.

Why: the H100 run of 2026-11-27 measured padded's bf16-mixed + LoRA step at 9.55 GB, reached in
generation, against a projected 5.68; the autotuner was ruled out (same peak with it off). The
answer is in XLA:GPU's buffer assignment of the one program ``padded_generate`` runs, which
this experiment reads at the real shapes in a minute, on a machine with no GPU.

    bash scripts/gpu_compile_deps.sh                          # once: ~590 MB into .gpu-compile/
    python -m bench gpu_compile --preset gpu --precision bf16  # Qwen2.5-0.5B shape, 128 rows
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from bench import presets
from bench.experiments import rlft_step
from bench.lib.projection import xla_gpu
from jaxrl_sym.errors import InputError

_COMMON = {"sigma": 0.6, "seed": 0, "target": "h100", "precision": "fp32"}
PRESETS: dict[str, dict[str, Any]] = {
    "quick": {**_COMMON, "model": "cpu", "scale": 16, "prompts": 4, "group": 2,
              "out": str(Path(presets.quick_dir("gpu_compile")) / "padded_generation")},
    "full": {**_COMMON, "model": "cpu", "scale": 8, "prompts": 16, "group": 8, "out": None},
    "gpu": {**_COMMON, "model": "gpu", "scale": 1, "prompts": 16, "group": 8, "out": None},
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = presets.parser("gpu_compile", __doc__, PRESETS)
    p.add_argument("--target", default=None, choices=tuple(xla_gpu.TARGETS),
                   help="the GPU the programs compile for")
    p.add_argument("--precision", default=None, choices=("fp32", "bf16"),
                   help="dtype of the weights generation reads (bf16: bf16-mixed's copy)")
    p.add_argument("--runtime-ledger", action="store_true",
                   help="instead of the padded program: the symbolic runtime's generation "
                        "ledger (its own programs over its policy's dispatches), every program "
                        "compiled for the target")
    p.add_argument("--rows", type=presets.at_least(1), default=None,
                   help="with --runtime-ledger: EngineOptions.microbatch_rows (resident rows)")
    p.add_argument("--out", default=None, help="OUT.json and OUT.md")
    return presets.parse(p, PRESETS, argv)


def abstract_model(args: argparse.Namespace) -> tuple[Any, Any, list[Any], Any]:
    """The workload's model (abstract: shapes only), its state in the weights' dtype, the
    expanded prompts and the generation config."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxrl_sym.generation import GenerationConfig
    from jaxrl_sym.models.lm import init_model, preset

    dtype = jnp.bfloat16 if args.precision == "bf16" else jnp.float32
    model = nnx.eval_shape(lambda: init_model(
        preset("small", **rlft_step.model_config(args), dtype=dtype), args.seed))
    state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
        x.shape, dtype if jnp.issubdtype(x.dtype, jnp.floating) else x.dtype),
        nnx.split(model)[1])
    prompts, limits = rlft_step.workload(args)
    expanded = [p for p in prompts for _ in range(args.group)]
    return model, state, expanded, GenerationConfig(max_new_tokens=tuple(int(x) for x in limits))


def sym_generation(args: argparse.Namespace) -> dict[str, Any]:
    """The runtime's generation ledger for the workload, its programs compiled for the target:
    the peak moment with its named buffers."""
    import jax

    from jaxrl_sym.runtime.memory.ledger_generation import sym_ledger
    from jaxrl_sym.runtime.options import EngineOptions
    from jaxrl_sym.runtime.plan import compile_generation
    from jaxrl_sym.tracer.trace import trace_model

    model, state, expanded, gcfg = abstract_model(args)
    program, _, _ = trace_model(model)
    plan = compile_generation(program, EngineOptions(microbatch_rows=args.rows))
    leaves = jax.tree_util.tree_leaves(state)
    out = {}
    for key, comp in (("gpu", xla_gpu.compiler(args.target)), ("cpu", None)):
        t0 = time.perf_counter()
        led = sym_ledger(plan, leaves, expanded, gcfg, compiler=comp).ledger
        peak = max(led.moments, key=lambda m: m.total)
        out[key] = {"peak": peak.total, "moment": f"{peak.stage}: {peak.what}",
                    "buffers": [{"name": b.name, "bytes": b.nbytes}
                                for b in sorted(peak.buffers, key=lambda b: -b.nbytes)[:8]],
                    "seconds": time.perf_counter() - t0}
    return out


def program(args: argparse.Namespace) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    """The padded generation program of the workload, its abstract arguments, and the shape."""
    from jaxrl_sym.baselines.padded import left_pad_prompts, padded_program

    model, state, expanded, gcfg = abstract_model(args)
    batch = left_pad_prompts(model, expanded, gcfg)
    inputs = (batch.tokens, batch.positions, batch.prompt_lens, batch.limits)
    shape = {"rows": batch.batch, "prompt_len": batch.prompt_len, "steps": batch.steps,
             "prefill_chunk": gcfg.prefill_chunk(batch.batch, batch.prompt_len,
                                                 int(model.cfg.vocab_size))}
    return padded_program(model, batch, gcfg), (state, *inputs), shape


def analyse(compiled: Any) -> dict[str, float]:
    m = compiled.memory_analysis()
    return {k: int(getattr(m, f"{k}_size_in_bytes")) for k in ("argument", "output", "temp")}


def run(args: argparse.Namespace) -> dict[str, Any]:
    import jax

    prog, structs, shape = program(args)
    out: dict[str, Any] = {"shape": shape, "target": args.target, "precision": args.precision}
    dump = xla_gpu.dump_dir()
    t0 = time.perf_counter()
    gpu = xla_gpu.compile_for(prog, *structs, target=args.target, dump_to=dump)
    out["gpu"] = {**analyse(gpu), "seconds": time.perf_counter() - t0,
                  "largest_temporaries": [
                      {"name": n, "shape": s, "bytes": b}
                      for n, s, b in xla_gpu.temp_buffers(dump)]}
    t0 = time.perf_counter()
    cpu = prog.lower(*jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                                   structs)).compile()
    out["cpu"] = {**analyse(cpu), "seconds": time.perf_counter() - t0}
    return out


def render(report: dict[str, Any]) -> str:
    sh = report["shape"]
    lines = [f"# Padded generation program compiled for {report['target']} (deviceless) and "
             "this CPU", "",
             f"`{report['command']}` ({report['date']}): {sh['rows']} rows, prompt "
             f"{sh['prompt_len']} slots in chunks of {sh['prefill_chunk']}, {sh['steps']} "
             f"decode steps, weights in {report['precision']}.", "",
             "| compiled for | arguments GB | outputs GB | temporaries GB | total GB |",
             "|---|---:|---:|---:|---:|"]
    for key in ("gpu", "cpu"):
        r = report[key]
        total = r["argument"] + r["output"] + r["temp"]
        name = report["target"] if key == "gpu" else "cpu"
        lines.append(f"| {name} | {r['argument'] / 1e9:.3f} | {r['output'] / 1e9:.3f} | "
                     f"{r['temp'] / 1e9:.3f} | {total / 1e9:.3f} |")
    lines += ["", f"Largest temporaries for {report['target']} (XLA's buffer assignment; "
              "values sharing an offset reuse one buffer):", ""]
    lines += [f"- `{t['name']}` {t['shape']}: {t['bytes'] / 1e9:.3f} GB"
              for t in report["gpu"]["largest_temporaries"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    import shlex
    import sys
    from datetime import date

    args = parse_args(argv if argv is not None else sys.argv[1:])
    why = xla_gpu.unavailable()
    if why is not None:
        raise InputError(f"gpu_compile: {why}")
    if args.runtime_ledger:
        print(json.dumps(sym_generation(args), indent=1))
        return 0
    report = run(args)
    report["command"] = "python -m bench gpu_compile " + shlex.join(
        argv if argv is not None else sys.argv[1:])
    report["date"] = date.today().isoformat()
    text = render(report)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(f"{args.out}.json").write_text(json.dumps(report, indent=1) + "\n")
        Path(f"{args.out}.md").write_text(text)
        print(f"wrote {args.out}.json and {args.out}.md")
    return 0
