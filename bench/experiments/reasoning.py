"""Where padding breaks: one GRPO step at reasoning lengths, projected per system — the peak at
a fixed batch, the largest batch a device holds, and the step's seconds. Compiled, never run.

Why: every GPU number so far is at 1k-token responses, where padding hurts least. Reasoning RL
runs caps of 4k-32k with a median far below the cap (:func:`jaxrl_sym.workloads.reasoning`:
log-normal, median cap/16, ~1% truncated at the cap, prompt/response correlation 0.3). A padded
system sizes every row's cache and every update row to the cap; sym's stores follow the
lengths. This experiment runs ``python -m bench project --cap CAP`` (every program of the step
compiled at the workload's shapes, XLA's memory and cost analyses, the step ledger) for each
system and reduces its report to three numbers per system:

* ``peak_gb``: the ledger's largest moment at the workload's batch (``prompts x group``).
* ``largest_batch``: samples that fit the device (``project``'s own rule: generation's
  bytes grow per sample, measured at B and 2B by the system's own walk of its generation
  programs — its estimate where it has no walk — and ``largest_batch_from`` says which; the
  reference and update programs are fixed by ``--update-tokens``), 0 when the fixed part alone
  does not fit.
* ``step_s``: the roofline of the compiled reference/update/apply programs plus generation
  priced by the model fitted on every committed H100 generation row
  (``bench/results/projection/dispatch``: bytes read / bandwidth + kernels x 5.5 us): each
  decode step reads the weights and the K/V the system's layout holds — sym the live rows'
  keys, padded every row's cache to the cap (masked attention reads every slot) — and launches
  the kernels per step the dispatch ledger counted at the Qwen2.5-0.5B shape.
  ``generation_floor_s`` is the bytes term alone.

    python -m bench reasoning --cap 16384 --device a100-40gb --precision bf16-mixed \\
        --lora-rank 16 --json
    python -m bench reasoning --preset quick            # tiny model, cap 512: the path, fast
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench import presets
from bench.lib import child
from bench.lib.projection import devices, roofline

DISPATCH = child.ROOT / "bench" / "results" / "projection" / "dispatch"
GB = 1e9
PRESETS: dict[str, dict[str, Any]] = {
    "quick": {"preset_of_project": "quick", "cap": 512, "prompts": 2, "group": 2,
              "update_tokens": 1024, "device": "h100", "systems": "sym,padded"},
    "full": {"preset_of_project": "gpu", "cap": 16384, "prompts": 16, "group": 8,
             "update_tokens": 16384, "device": "h100", "systems": "sym,padded"},
    "gpu": {"preset_of_project": "gpu", "cap": 16384, "prompts": 16, "group": 8,
            "update_tokens": 16384, "device": "h100", "systems": "sym,padded"},
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = presets.parser("reasoning", __doc__, PRESETS)
    p.add_argument("--cap", type=presets.at_least(16), default=None,
                   help="the responses' cap (4096, 8192, 16384, 32768 in the table)")
    p.add_argument("--device", default=None, choices=tuple(devices()),
                   help="the GPU whose memory, bandwidth and flops price the step")
    p.add_argument("--precision", default=None, choices=("fp32", "bf16-mixed", "bf16"),
                   help="the trainers' precision policy (default fp32)")
    p.add_argument("--lora-rank", type=presets.at_least(1), default=None,
                   help="train LoRA adapters of this rank instead of every weight")
    p.add_argument("--prompts", type=presets.at_least(1), default=None,
                   help="prompts per step (the fixed batch is prompts x group samples)")
    p.add_argument("--group", type=presets.at_least(2), default=None,
                   help="samples per prompt")
    p.add_argument("--update-tokens", type=presets.at_least(1), default=None,
                   help="token slots per training micro-batch (at least one padded row: "
                        "prompt + cap)")
    p.add_argument("--systems", default=None, type=presets.systems(trains=True),
                   help="comma-separated trainable systems")
    p.add_argument("--compile-for", default=None, choices=("h100",),
                   help="compile for this GPU (XLA:GPU's buffer assignment; "
                        "scripts/gpu_compile_deps.sh first) instead of this CPU")
    p.add_argument("--dispatch-from", default=None, metavar="OUT_JSON", type=_report_file,
                   help="take generation's dispatch ledger from an earlier run's OUT.json of "
                        "the same cap, batch and precision instead of compiling it again")
    p.add_argument("--reprice", default=None, metavar="OUT_JSON", type=_repriceable,
                   help="price a committed run's OUT.json again (each device's roofline, the "
                        "current calibration) from its own compiled report; nothing compiles; "
                        "OUT.json and OUT.md are rewritten")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    p.add_argument("--out", default=None, help="OUT.json (summary + project's report), OUT.md")
    return presets.parse(p, PRESETS, argv)


def _reasoning_report(text: str, needs: str, what: str) -> str:
    """``text``: an earlier reasoning OUT.json holding a non-empty ``needs`` field."""
    try:
        old = json.loads(Path(text).read_text())
    except (OSError, ValueError) as err:
        raise argparse.ArgumentTypeError(f"cannot read {text!r} as a reasoning report: "
                                         f"{err}") from None
    if not isinstance(old, dict) or not old.get(needs):
        raise argparse.ArgumentTypeError(f"{text!r} holds no {what}")
    return text


def _report_file(text: str) -> str:
    """``--dispatch-from``: an earlier run's OUT.json holding its dispatch rows."""
    return _reasoning_report(text, "dispatch", "dispatch rows (a reasoning OUT.json written "
                             "with the compile-only packages)")


def _repriceable(text: str) -> str:
    """``--reprice``: a reasoning OUT.json holding its project report."""
    return _reasoning_report(text, "project", "project report (a reasoning OUT.json written "
                             "by --out)")


def project_argv(args: argparse.Namespace, out: Path) -> list[str]:
    """``python -m bench project``'s command line for this cap (its preset's model)."""
    argv = ["--preset", args.preset_of_project, "--cap", str(args.cap), "--device",
            args.device, "--systems", args.systems, "--prompts", str(args.prompts),
            "--group", str(args.group), "--update-tokens", str(args.update_tokens),
            "--measure", "false", "--out", str(out)]
    if args.precision:
        argv += ["--precision", args.precision]
    if args.lora_rank:
        argv += ["--lora-rank", str(args.lora_rank)]
    if args.compile_for:
        argv += ["--compile-for", args.compile_for]
    return argv


def dispatch_rows(args: argparse.Namespace) -> dict[str, Any] | None:
    """Each system's dispatch ledger at this cap (``python -m bench dispatch --cap``, its
    programs compiled for the H100 in a child: the CUDA plugin must load before JAX's backends),
    or None without the compile-only CUDA packages (``scripts/gpu_compile_deps.sh``)."""
    from bench.lib.projection import xla_gpu

    if xla_gpu.unavailable() is not None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "dispatch"
        argv = ["--preset", "gpu" if args.preset_of_project == "gpu" else "quick",
                "--device", "h100", "--cap", str(args.cap), "--systems", args.systems,
                "--prompts", str(args.prompts), "--group", str(args.group),
                "--precision", "bf16-mixed" if args.precision == "bf16-mixed" else "fp32",
                "--out", str(out)]
        res = child.run(child.experiment("dispatch", *argv))
        if not res.ok:
            print(f"dispatch: {res.status}\n{res.tail(8)}", file=sys.stderr)
            return None
        return json.loads(out.with_suffix(".json").read_text())["systems"]


def _earlier(args: argparse.Namespace) -> dict[str, Any] | None:
    """The dispatch rows of an earlier run (``--dispatch-from``), refused unless it projected
    the same request (cap, samples, precision: what generation's programs depend on)."""
    old = json.loads(Path(args.dispatch_from).read_text())
    same = (old["cap"], old["samples"], old["precision"]) == (
        args.cap, args.prompts * args.group, args.precision or "fp32")
    if not same:
        raise SystemExit(f"--dispatch-from {args.dispatch_from}: it projected cap "
                         f"{old['cap']}, {old['samples']} samples, {old['precision']}; this "
                         "run differs")
    return old["dispatch"]


def generation_seconds(row: dict[str, Any] | None, dev: dict[str, Any], per: dict[str, float]
                       ) -> float | None:
    """The dispatch ledger's generation on ``dev``: what the steps read in the system's layout
    over its bandwidth plus the fitted per-kernel time (None: no ledger)."""
    from bench.lib.projection.dispatch_ledger import price

    return None if row is None else price(row, dev["bandwidth"], per)


def summarise(report: dict[str, Any], gen: dict[str, Any] | None, device: str
              ) -> dict[str, Any]:
    """Per system: peak at the batch, largest batch on ``device``, projected step seconds."""
    dev = devices()[device]
    per = json.loads((DISPATCH / "calibration_h100.json").read_text())["per"]
    out: dict[str, Any] = {}
    for name, row in report["systems"].items():
        if "error" in row:
            out[name] = {"error": row["error"]}
            continue
        priced = roofline(row, dev)  # this device's, not the one project was run for
        stages = {k: v for k, v in priced["seconds"].items() if k != "generation floor"}
        g = generation_seconds((gen or {}).get(name), dev, per)
        d = row["decode"]
        out[name] = {"peak_gb": round(row["ledger"]["peak"]["total"] / GB, 3),
                     "fits": priced["fits"],
                     "largest_batch": row["largest_batch"].get(device),
                     "largest_batch_from": (row.get("largest_batch_from") or {}).get("used"),
                     "step_s": None if g is None else round(sum(stages.values()) + g, 3),
                     "generation_s": None if g is None else round(g, 3),
                     "generation_floor_s": round((d["weights_bytes"] + d["kv_bytes"])
                                                 / dev["bandwidth"], 3),
                     "other_stages_s": {k: round(v, 3) for k, v in stages.items()}}
    return out


def markdown(summary: dict[str, Any], argv: list[str]) -> str:
    lines = [f"`{presets.command('reasoning', argv)}`", "",
             f"cap {summary['cap']}, {summary['samples']} samples, {summary['device']}, "
             f"{summary['precision']}, LoRA {summary['lora_rank'] or 'off'}", "",
             "| system | peak GB (fixed batch) | fits | largest batch | step s | generation s "
             "| generation floor s |", "|---|---:|---|---:|---:|---:|---:|"]
    for name, r in summary["systems"].items():
        if "error" in r:
            lines.append(f"| {name} | error: {r['error'][:80]} | | | | | |")
            continue
        show = lambda x: "-" if x is None else f"{x:.1f}"
        lines.append(f"| {name} | {r['peak_gb']:.2f} | {'yes' if r['fits'] else 'no'} | "
                     f"{r['largest_batch']} | {show(r['step_s'])} | "
                     f"{show(r['generation_s'])} | {r['generation_floor_s']:.2f} |")
    lines += ["", "Largest batch: generation's bytes at B and 2B samples, extended linearly, "
              "from each system's " + ", ".join(
                  f"{n} {r.get('largest_batch_from') or '-'}"
                  for n, r in summary["systems"].items() if "error" not in r)
              + " (walk: its own programs over the step's lengths; estimate: every row to the "
              "longest)."]
    return "\n".join(lines)


def reprice(path: Path, argv: list[str]) -> int:
    """``--reprice``: a committed run's summary and ``by_device`` priced again from its own
    project report and dispatch rows (each device's roofline and the current calibration);
    nothing is compiled. Its ``.json`` and ``.md`` are rewritten in place."""
    old = json.loads(path.read_text())
    report, gen = old["project"], old.get("dispatch")
    summary = {k: old[k] for k in ("cap", "device", "precision", "lora_rank", "samples",
                                   "generation")}
    summary["systems"] = summarise(report, gen, summary["device"])
    every = {d: summarise(report, gen, d) for d in devices()}
    path.write_text(json.dumps({**summary, "by_device": every, "project": report,
                                "dispatch": gen}, indent=1))
    md = path.with_suffix(".md")
    ran = md.read_text().splitlines()[0] if md.exists() else "(its command: unknown)"
    text = markdown(summary, argv)
    md.write_text(f"{ran}, re-priced by\n\n{text}\n")  # the run's own command first
    print(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.reprice:
        return reprice(Path(args.reprice), argv or sys.argv[1:])
    from bench.experiments import project

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "project"
        rc = project.main(project_argv(args, out))
        report = json.loads(out.with_suffix(".json").read_text())
    gen = dispatch_rows(args) if not args.dispatch_from else _earlier(args)
    summary = {"cap": args.cap, "device": args.device, "precision": args.precision or "fp32",
               "lora_rank": args.lora_rank, "samples": args.prompts * args.group,
               "generation": "dispatch ledger (H100 compile, fitted per-kernel time)"
               if gen is not None else "not priced: no compile-only CUDA packages",
               "systems": summarise(report, gen, args.device)}
    text = markdown(summary, argv or [])
    print(json.dumps(summary) if args.json else text)
    if args.out:
        path = Path(args.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        every = {d: summarise(report, gen, d) for d in devices()}  # re-priced per device
        path.with_suffix(".json").write_text(json.dumps(
            {**summary, "by_device": every, "project": report, "dispatch": gen}, indent=1))
        path.with_suffix(".md").write_text(text + "\n")
    print(f"(project exit code {rc})", file=sys.stderr)
    return rc
