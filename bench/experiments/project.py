"""Project one GRPO step's memory and time to a GPU from XLA's own analyses — compiled, never run.

Why: GPUs are lent rarely, and what a 2-core CPU shows (compute, compile seconds) is not what a
GPU pays (bytes moved, launches, memory peaks). Every program of the step (reference chunks,
gradient micro-batches, gradient sum, optimiser apply) is compiled on this machine at the
workload's real shapes; XLA's ``memory_analysis`` and ``cost_analysis`` give its temporaries,
outputs, flops and bytes; :func:`jaxrl_sym.rl.step.ledger.step_ledger` adds the state and the
generation stores into a ledger of named buffers per moment of the step, whose largest moment is
the projected peak. Time per stage is a roofline over the programs (``max(flops / peak flops,
bytes / bandwidth)`` each, times how often it runs) and, for generation, the memory-bound floor
(every decode step reads the weights and each live row's K/V once). Device constants are data:
``bench/devices.json``.

The workload is ``rlft_step``'s (same prompts, lengths, model, RLConfig). ``--measure`` also runs
a warm-up and a measured step on this machine with the process's RSS sampled every 2 ms (large
buffers forced to ``mmap`` so a freed buffer leaves RSS), and sets the measured rise of RSS during
the step beside the ledger's transient bytes (its peak minus the state held before the step).
The ``gpu`` preset on ``--device h100`` sets the projection beside the committed H100 run.

    python -m bench project --preset quick
    python -m bench project --preset gpu --device h100     # ~10 min of compiles on 2 cores
    python -m bench project --workload decode --preset gpu  # lib/projection/projection_decode.py
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any

from bench import presets
from bench.experiments import rlft_step
from bench.lib import child
from bench.lib.projection import calibration, devices, render, roofline, xla_gpu

_COMMON = {"sigma": 0.6, "beta": 0.04, "seed": 0, "systems": "sym,padded", "device": "h100"}
PRESETS: dict[str, dict[str, Any]] = {
    "quick": {**_COMMON, "model": "cpu", "scale": 16, "prompts": 4, "group": 2,
              "update_tokens": None, "measure": True,
              "out": os.path.join(presets.quick_dir("project"), "rl_step")},
    "full": {**_COMMON, "model": "cpu", "scale": 8, "prompts": 16, "group": 8,
             "update_tokens": None, "measure": True,
             "out": str(child.ROOT / "bench" / "results" / "cpu" / "project_rl_step")},
    "gpu": {**_COMMON, "model": "gpu", "scale": 1, "prompts": 16, "group": 8,
            "update_tokens": 4096, "measure": False, "out": None},
}
# Large buffers through mmap: freed memory leaves RSS at once, so RSS follows live bytes.
_CHILD_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "JAX_PLATFORMS": "cpu"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = presets.parser("project", __doc__, PRESETS)
    p.add_argument("--workload", choices=("rl-step", "decode"), default="rl-step",
                   help="what to project: the RL step, or a generation request (decode: its "
                        "own presets and flags, `--workload decode --help`)")
    p.add_argument("--device", default=None, choices=tuple(devices()),
                   help="the GPU whose memory and bandwidth price the step")
    p.add_argument("--systems", default=None, type=presets.systems(trains=True),
                   help="comma-separated trainable systems")
    p.add_argument("--model", default=None,
                   help="the policy: cpu / gpu (the preset's Qwen2.5-shaped DecoderLM), or "
                        "zoo-gpt2, zoo-gemmaish, hf-llama (bench/lib/models.py)")
    p.add_argument("--measure", type=presets.truth, default=None,
                   help="also run the step here and compare the ledger with the measured peak")
    p.add_argument("--precision", default=None, choices=("fp32", "bf16-mixed", "bf16"),
                   help="the trainers' precision policy (default fp32, as the H100 run)")
    p.add_argument("--lora-rank", type=presets.at_least(1), default=None,
                   help="train LoRA adapters of this rank instead of every weight")
    p.add_argument("--update-tokens", type=presets.at_least(1), default=None,
                   help="update_tokens: token slots per training micro-batch")
    p.add_argument("--logprob-chunk", type=presets.at_least(1), default=None,
                   help="logprob_chunk: token slots whose logits exist at once")
    p.add_argument("--engine", default=None, metavar="JSON",
                   type=presets.json_object(presets.engine_options),
                   help="EngineOptions fields for the trainer's generation, e.g. "
                        "'{\"microbatch_rows\": 32, \"refill\": true}' (as rlft_step's)")
    p.add_argument("--prompts", type=presets.at_least(1), default=None,
                   help="prompts per step (the preset's otherwise)")
    p.add_argument("--group", type=presets.at_least(2), default=None, help="samples per prompt")
    p.add_argument("--seed", type=presets.at_least(0), default=None,
                   help="the workload's draw: prompts and response lengths (the preset's: 0)")
    p.add_argument("--cap", type=presets.at_least(16), default=None,
                   help="the reasoning-length workload at this response cap instead of "
                        "rlft_step's (jaxrl_sym.workloads.reasoning: log-normal responses, "
                        "median cap/16, ~1%% truncated at the cap; python -m bench reasoning)")
    p.add_argument("--no-remat", action="store_true",
                   help="remat=False: keep the layers' activations for the backward")
    p.add_argument("--out", default=None, help="OUT.json and OUT.md")
    p.add_argument("--recalibrate", default=None, metavar="OUT_JSON",
                   help="run nothing: set OUT.json's projection beside the newest committed "
                        "device run of its configuration and re-render OUT.md (a note written "
                        "by hand between the title and the command line is kept)")
    p.add_argument("--compile-for", default=None, metavar="TARGET",
                   choices=tuple(xla_gpu.TARGETS),
                   help="compile the step's programs for this GPU (h100) instead of this CPU: "
                        "XLA:GPU's own buffer assignment, no GPU needed "
                        "(bench/lib/projection/xla_gpu.py; "
                        "scripts/gpu_compile_deps.sh first)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return presets.parse(p, PRESETS, argv)


def run_child(args: argparse.Namespace) -> dict[str, Any]:
    """One system's ledger (and measurement): runs in its own process."""
    if args.compile_for:  # before JAX starts its backends: the CUDA plugin must be found
        why = xla_gpu.unavailable()
        if why is not None:
            raise SystemExit(f"--compile-for {args.compile_for}: {why}")
    from bench.lib.projection import measure_step, system_ledger

    out = system_ledger(args, args.child)
    if args.measure:
        out["measured"] = measure_step(args, out.pop("_trainer"))
    out.pop("_trainer", None)
    return out


def main(argv: list[str] | None = None) -> int:
    if _workload(argv) == "decode":  # its own presets and children: projection_decode.py
        from bench.lib.projection import projection_decode

        return projection_decode.main(argv)
    args = parse_args(argv)
    if args.recalibrate:
        return recalibrate(Path(args.recalibrate))
    if args.child:
        print(json.dumps(run_child(args)))
        return 0
    device = devices()[args.device]
    report: dict[str, Any] = {"command": presets.command("project", argv),
                              "preset": args.preset, "device": device, "systems": {},
                              "config": config(args),
                              "compiled_for": args.compile_for or "cpu"}
    for name in presets.csv(args.systems):
        res = child.run(child.experiment("project", *(argv or []), "--child", name),
                        env=_CHILD_ENV)
        if not res.ok:
            report["systems"][name] = {"error": f"{res.status}: {res.tail()}"}
            print(f"{name}: {res.status}\n{res.tail(8)}", file=sys.stderr)
            continue
        row = json.loads(res.stdout.strip().splitlines()[-1])
        row["projection"] = roofline(row, device)
        report["systems"][name] = row
    if args.preset == "gpu" and device.get("results"):
        report["calibration"] = calibration(report, device)
    text = render(report)
    print(text)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".json").write_text(json.dumps(report, indent=1))
        out.with_suffix(".md").write_text(text + "\n")
    return 0 if all("error" not in r for r in report["systems"].values()) else 1


def recalibrate(path: Path) -> int:
    """Re-set a committed projection beside the device runs committed since (no compiles)."""
    if not path.is_file():
        raise SystemExit(f"--recalibrate {path}: no such projection report (OUT.json)")
    report = json.loads(path.read_text())
    if "config" not in report:  # written before the config was stored: its command says it,
        words = shlex.split(report["command"])  # and remat did not exist yet (off)
        report["config"] = {**config(parse_args(words[words.index("project") + 1:])),
                            "remat": False}
    report["calibration"] = calibration(report, report["device"])
    md = path.with_suffix(".md")
    old = md.read_text() if md.exists() else ""
    text = render(report)
    note = old.split("\n`python -m bench project", 1)[0].split("\n", 1)[1:] if old else []
    if note and note[0].strip():
        title, rest = text.split("\n", 1)
        text = f"{title}\n{note[0].rstrip()}\n{rest}"
    path.write_text(json.dumps(report, indent=1))
    md.write_text(text + "\n")
    print(text)
    return 0


def config(args: argparse.Namespace) -> dict[str, Any]:
    """The projected step's configuration in ``rlft_step``'s report keys (what a measured run
    must share to calibrate it: :func:`bench.lib.projection.run_config`)."""
    return {"preset": args.preset, "cap": args.cap, "precision": args.precision or "fp32",
            "lora_rank": args.lora_rank, "update_tokens": args.update_tokens,
            "engine": args.engine, "logprob_chunk": args.logprob_chunk,
            "remat": not args.no_remat}


def _workload(argv: list[str] | None) -> str:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--workload", default="rl-step")
    return p.parse_known_args(argv)[0].workload


# the workload is rlft_step's: one definition
workload, model_config = rlft_step.workload, rlft_step.model_config
