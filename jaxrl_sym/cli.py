"""``jaxrl-sym``: side-by-side padding-vs-symbolic decoding on the same model and weights.

Every system runs in its own process (so peak RSS is its own), twice: a cold run (compiles
included, logits kept for the check) and a warm run (steady-state seconds per token). The parent
compares every baseline's tokens and logits against sym's and ends with one verdict per baseline.

Every flag is checked before JAX is imported (this module and its top imports are JAX-free),
so a bad flag fails in under a second with its name. Then each system's memory is estimated from
shapes (:mod:`jaxrl_sym.runtime.memory.estimate`, in a child process) and a system that cannot fit
(``--memory-limit``, else the GPU's or the host's memory) is skipped with the estimate's
breakdown, instead of dying with ``RESOURCE_EXHAUSTED`` minutes into its run.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

from jaxrl_sym import jsonl, systems
from jaxrl_sym.compile_cache import configure_environment
from jaxrl_sym.decode_run import (  # noqa: F401 - DECODE_CPU, build_model: read by bench/
    DECODE_CPU,
    PROGRESS_PREFIX,
    build_model,
    checks,
    estimate_child,
    prompts_for,
    run_system,
)
from jaxrl_sym.errors import SymError
from jaxrl_sym.generation import seed32
from jaxrl_sym.hf_cli import COMMANDS as HF_COMMANDS
from jaxrl_sym.hf_cli import add_parsers as add_hf_parsers
from jaxrl_sym.hf_cli import run as run_hf
from jaxrl_sym.output_paths import check_output_dir, check_output_file, path_errors
from jaxrl_sym.report import decode_table
from jaxrl_sym.rl.run import config_file
from jaxrl_sym.rl.run.eval_cli import add_eval_parser
from jaxrl_sym.runtime.options import BACKENDS, EngineOptions  # JAX-free
from jaxrl_sym.sizes import parse_bytes

# ``decode-cpu`` plus ``jaxrl_sym.models.lm.preset_names()``, spelled out so that ``--preset`` is
# checked without importing the model code (JAX); a test keeps the two lists equal.
PRESETS = ("decode-cpu", "tiny", "small", "gpt2-small", "qwen2.5-0.5b")
ATTENTIONS = ("full", "window", "block", "linear", "mixed")
INTERNAL = "_system"  # the child-process sub-command; not part of the user-facing parser
ESTIMATE = "_estimate"  # the child that estimates memory per system before any system runs


class _Help(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults in every option's help (a user should not need the source to learn them);
    descriptions keep their line breaks. Unset defaults (None, False) are left out."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if (action.default is None or action.default is False
                or "(default" in (action.help or "")):  # unset, or the help already says it
            return action.help
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    """The top-level parser, remembering its sub-command parsers (for their usage lines)."""

    commands: dict[str, argparse.ArgumentParser]


def _decode_parser(sub: Any) -> argparse.ArgumentParser:
    d = sub.add_parser("decode", help="compare generation systems on one model",
                       description="Generate with each system on the same model, weights and "
                                   "prompts;\nreport time per token, memory, compiles and a "
                                   "verdict per baseline.", formatter_class=_Help)
    d.add_argument("--attention", choices=ATTENTIONS, default="full",
                   help="attention pattern of every layer (mixed: window and full interleaved)")
    d.add_argument("--tokens", type=int, default=128, help="new tokens per row (>= 1)")
    d.add_argument("--batch", type=int, default=4, help="rows (prompts) per request (>= 1)")
    d.add_argument("--prompt-len", default="8:24", metavar="MIN:MAX",
                   help="prompt lengths drawn uniformly from [MIN, MAX] (1 <= MIN <= MAX; "
                        "one number N means N:N)")
    d.add_argument("--window", type=int, default=128,
                   help="window size for --attention window/mixed (>= 1)")
    d.add_argument("--block", type=int, default=64, help="block size for --attention block (>= 1)")
    d.add_argument("--systems", default="sym,padded", metavar="S1,S2,...",
                   help=f"comma-separated, from {', '.join(systems.names())}; every other "
                        f"system is compared with {systems.REFERENCE}")
    d.add_argument("--seed", type=int, default=0,
                   help="weights and prompts; any integer, used modulo 2**32")
    d.add_argument("--preset", default="decode-cpu", choices=PRESETS, help="model preset")
    d.add_argument("--model", default=None, metavar="MODULE:FUNCTION",
                   help="your own model: FUNCTION(seed) in importable MODULE returns an nnx.Module "
                        "following the contract model(tokens, positions, segment_ids) -> logits; "
                        "--preset/--attention/--window/--block are then ignored (the model "
                        "defines its attention)")
    d.add_argument("--backend", default="xla", choices=BACKENDS,
                   help="sym's kernels: xla, triton (interpreted on CPU), auto")
    d.add_argument("--engine", default=None, metavar="JSON",
                   help="sym's runtime options (EngineOptions fields, as training takes them), "
                        "e.g. '{\"refill\": true, \"microbatch_rows\": 8}'")
    d.add_argument("--mesh", default=None, metavar="AXES",
                   help="run the sym systems on a device mesh, e.g. data=8 (axes data/fsdp/"
                        "model; sizes multiply to the device count); padded, pershape and Tunix "
                        "run on one device as the reference the tokens are checked against")
    d.add_argument("--speculate", type=int, default=0, metavar="K",
                   help="speculative decoding: a draft proposes K tokens per row, the model "
                        "verifies them in one forward (sym and padded; 0: off)")
    d.add_argument("--draft", default="ngram", choices=("ngram", *PRESETS),
                   help="the draft for --speculate: ngram (prompt lookup, no model) or a model "
                        "preset (a DecoderLM of that shape with the model's vocabulary, weights "
                        "seeded by --seed + 1; sym only: padded then decodes plainly, as its "
                        "report row says)")
    d.add_argument("--json", action="store_true", help="print one JSON object")
    d.add_argument("--out", default=None, metavar="FILE.json",
                   help="also write the report as JSON to this file")
    d.add_argument("--no-warm", action="store_true", help="skip the warm (timing) run")
    d.add_argument("--memory-limit", default=None, metavar="BYTES",
                   help="refuse a system whose estimated memory exceeds BYTES (e.g. 40e9, 16G, "
                        "8GiB); default: the device's limit (GPU) or the host's memory (CPU)")
    d.add_argument("--no-memory-check", action="store_true",
                   help="run every system even when its memory estimate exceeds the limit")
    return d


def _parser(with_train: bool = True) -> _Parser:
    """The user-facing parser. ``with_train=False`` lists ``train`` without building its
    options: they live in :mod:`jaxrl_sym.rl.run.cli`, whose import pulls in JAX (seconds), so only
    a ``train`` command line pays for it."""
    p = _Parser(prog="jaxrl-sym", description=__doc__, formatter_class=_Help)
    sub = p.add_subparsers(dest="cmd", required=True,
                           metavar="{decode,train,generate,export,eval}")
    p.commands = {"decode": _decode_parser(sub)}
    p.commands.update(add_hf_parsers(sub, _Help))  # generate, export: jaxrl_sym/hf_cli.py
    p.commands["eval"] = add_eval_parser(sub, _Help)  # jaxrl_sym/rl/run/eval_cli.py
    if with_train:
        from jaxrl_sym.rl.run.cli import add_train_parser

        train = p.commands["train"] = add_train_parser(sub)
        train.formatter_class = _Help
        for action in train._actions:  # options without help text would hide their default
            if action.help is None and action.default is not None and action.default is not False:
                action.help = "(default: %(default)s)"
    else:
        p.commands["train"] = sub.add_parser(
            "train", help="RL fine-tuning (GRPO/RLOO/PPO) on an offline task")
    return p


def parse_prompt_len(text: str) -> tuple[int, int]:
    """``MIN:MAX`` (or ``N``) → ``(MIN, MAX)`` with ``1 <= MIN <= MAX``, else ValueError naming
    ``--prompt-len`` (this used to fail in a child process as numpy's ``low >= high``)."""
    lo_s, sep, hi_s = text.partition(":")
    try:
        lo, hi = int(lo_s), int(hi_s if sep else lo_s)
    except ValueError:
        raise ValueError(f"--prompt-len must be MIN:MAX (two integers) or N, got {text!r}") \
            from None
    if lo < 1 or hi < lo:
        raise ValueError(f"--prompt-len must satisfy 1 <= MIN <= MAX, got {text!r}")
    return lo, hi


def _at_least(args: argparse.Namespace, minima: dict[str, int]) -> list[str]:
    """One message per integer flag below its minimum (``--tokens must be >= 1, got 0``)."""
    errors = []
    for dest, lo in minima.items():
        value = getattr(args, dest, None)
        if value is not None and value < lo:
            errors.append(f"--{dest.replace('_', '-')} must be >= {lo}, got {value}")
    return errors


def _module_findable(module: str) -> bool:
    """Whether ``module``'s top-level package can be found where the child process will look
    (the working directory first, as ``python -m`` puts it there) — without importing it."""
    top = module.split(".")[0]
    return (top in sys.modules or top in sys.builtin_module_names
            or importlib.machinery.PathFinder.find_spec(top, [os.getcwd(), *sys.path])
            is not None)


def check_decode(args: argparse.Namespace) -> list[str]:
    """Every problem with a ``decode`` command line, each naming the flag as typed."""
    errors = _at_least(args, {"tokens": 1, "batch": 1, "window": 1, "block": 1})
    try:
        parse_prompt_len(args.prompt_len)
    except ValueError as err:
        errors.append(str(err))
    engine = None
    try:
        engine = None if args.engine is None else EngineOptions.from_json(args.engine)
    except SymError as err:
        errors.append(str(err))
    if engine is not None and engine.backend != EngineOptions.backend:
        errors.append("--engine: give the backend with --backend, not as an engine field")
    options = systems.BindOptions(backend=args.backend, mesh=args.mesh, engine=engine,
                                  speculate=max(args.speculate, 0), draft=args.draft)
    errors += systems.refusals(args.systems, options, attention=args.attention,
                               user_model=bool(args.model))
    if args.model is not None:
        mod, _, fn = args.model.partition(":")
        if not mod or not fn or ":" in fn:
            errors.append(f"--model must be MODULE:FUNCTION, e.g. mypkg.models:make_model; got "
                          f"{args.model!r}")
        elif not _module_findable(mod):
            errors.append(f"--model {args.model}: no module {mod.split('.')[0]!r} in the working "
                          "directory or on PYTHONPATH")
    if args.memory_limit is not None:
        try:
            parse_bytes(args.memory_limit)
        except ValueError as err:
            errors.append(str(err))
    if args.mesh is not None:
        from jaxrl_sym.sharding import MeshConfig  # JAX-free

        try:
            MeshConfig.parse(args.mesh)
        except ValueError as err:
            errors.append(str(err))
    if args.speculate < 0:
        errors.append(f"--speculate must be >= 0 (0: off), got {args.speculate}")
    elif args.draft != "ngram" and not args.speculate:
        errors.append(f"--draft {args.draft} drafts for --speculate K; give K >= 1")
    errors += path_errors(check_output_file, "--out", args.out)
    return errors


def check_train(args: argparse.Namespace) -> list[str]:
    """Every problem with a ``train`` command line that can be seen without running it: the
    flags' own format (sizes, rates, output paths: a read-only ``--metrics`` path used to fail
    after the steps ran), then — when those pass — the library's rules, by building the configs
    ``train`` runs with (:func:`jaxrl_sym.rl.run.cli.check_configs`; JAX-free)."""
    from jaxrl_sym.rl.run.cli import check_configs

    errors = _at_least(args, {"steps": 1, "group": 1, "seed": 0})
    for dest, positive in (("lr", True), ("beta", False)):
        value = getattr(args, dest, None)
        if value is not None and (not math.isfinite(value) or value < 0
                                  or (positive and value == 0)):
            errors.append(f"--{dest.replace('_', '-')} must be finite and "
                          f"{'> 0' if positive else '>= 0'}, got {value}")
    errors += path_errors(check_output_dir, "--checkpoint-dir",
                          getattr(args, "checkpoint_dir", None))
    errors += path_errors(check_output_file, "--metrics", getattr(args, "metrics", None))
    errors += path_errors(check_output_file, "--plot", getattr(args, "plot", None))
    return errors or check_configs(args)


def _spec(args: argparse.Namespace, system: str) -> dict[str, Any]:
    lo, hi = parse_prompt_len(args.prompt_len)
    return {"system": system, "attention": args.attention, "tokens": args.tokens,
            "batch": args.batch, "prompt_len": [lo, hi], "window": args.window,
            "block": args.block, "seed": seed32(args.seed), "preset": args.preset,
            "model": args.model, "backend": args.backend, "warm": not args.no_warm,
            "speculate": args.speculate, "draft": args.draft,
            "engine": json.loads(args.engine) if args.engine else None,
            "mesh": args.mesh if system in systems.names(shards=True) else None}


def _run_child(spec: dict[str, Any], tmp: str) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """One system in its own process; (metrics or {"error": [...]}, arrays)."""
    s = spec["system"]
    spec_path, out = os.path.join(tmp, f"{s}.json"), os.path.join(tmp, f"{s}.npz")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    cmd = [sys.executable, "-m", "jaxrl_sym.cli", INTERNAL, spec_path, out]
    # GPU: the allocator's peak is only meaningful without XLA's preallocation.
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    # The child's output is streamed: its progress lines (see _progress_printer) reach the user
    # while it runs; the rest is kept for the error message.
    lines: list[str] = []
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=env) as proc:
        for line in proc.stdout or ():
            if line.startswith(PROGRESS_PREFIX):
                print(line.rstrip(), file=sys.stderr, flush=True)
            else:
                lines.append(line)
    if proc.returncode != 0:
        return {"error": "".join(lines).strip().splitlines()[-1:]}, {}
    with open(out + ".json") as f:
        metrics = json.load(f)
    with np.load(out) as z:
        return metrics, dict(z)


def decode(args: argparse.Namespace) -> dict[str, Any]:
    """Run every system of ``--systems`` (one child process each) and build the report."""
    from jaxrl_sym.report import verdict_lines

    names = systems.split(args.systems)
    results: dict[str, Any] = {}
    arrays: dict[str, dict[str, np.ndarray]] = {}
    memory = memory_check(args, names)
    estimates = {s: e["estimate"]["total"] for s, e in (memory or {"systems": {}})["systems"]
                 .items()}
    if memory and not args.no_memory_check and all(e["refused"] for e in
                                                   memory["systems"].values()):
        return {"systems": {s: {"skipped": e["refused"], "estimated_bytes": estimates[s]}
                            for s, e in memory["systems"].items()}}  # nothing fits: no work
    with tempfile.TemporaryDirectory() as tmp:
        for k, s in enumerate(names, 1):
            # Peers have no shape estimate (runtime.memory.estimate knows our systems only).
            refused = memory["systems"][s]["refused"] if memory and s in memory["systems"] \
                else None
            if refused and not args.no_memory_check:
                results[s] = {"skipped": refused, "estimated_bytes": estimates[s]}
                print(f"[{k}/{len(names)}] {s}: skipped: {refused}", file=sys.stderr,
                      flush=True)
                continue
            # Progress on stderr: a large run is minutes per system, and silence looks hung.
            print(f"[{k}/{len(names)}] {s}: running…", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            results[s], got = _run_child(_spec(args, s), tmp)
            if got:
                arrays[s] = got
            if s in estimates:
                results[s]["estimated_bytes"] = estimates[s]
            state = "failed" if "error" in results[s] else "done"
            print(f"[{k}/{len(names)}] {s}: {state} in {time.perf_counter() - t0:.1f} s",
                  file=sys.stderr, flush=True)
    report: dict[str, Any] = {"config": _spec(args, "-"), "systems": results}
    report["config"].pop("system")
    if memory:
        report["memory_check"] = {"limit": memory["limit"], "source": memory["limit_source"],
                                  "enforced": not args.no_memory_check,
                                  "estimates": {s: e["estimate"]
                                                for s, e in memory["systems"].items()}}
    report.update(checks(arrays))
    from jaxrl_sym.report import run_metadata

    report.update(run_metadata("jaxrl-sym " + " ".join(sys.argv[1:])))
    ran = {s: m for s, m in results.items() if "skipped" not in m}
    report["verdict"] = verdict_lines({**report, "systems": ran}) + [
        f"{s} was not run: {m['skipped']}" for s, m in results.items() if "skipped" in m]
    return report


def _child(argv: list[str]) -> int:
    """``_system SPEC OUT``: run one system from a spec file (the parent's child process)."""
    spec_path, out = argv
    with open(spec_path) as f:
        spec = json.load(f)
    metrics, arrays = run_system(spec)
    np.savez(out, **arrays)
    with open(out + ".json", "w") as f:
        json.dump(metrics, f)
    return 0


def memory_check(args: argparse.Namespace, names: list[str]) -> dict[str, Any] | None:
    """Estimate every system's memory from shapes in a child process, before any system runs.

    Why a child: the estimate imports JAX and traces the model; doing that here would make this
    parent hold a device context (and, on a GPU, memory) beside every measured system. Returns
    :func:`jaxrl_sym.runtime.memory.estimate.check_request`'s result, or None (with a warning on
    stderr) when the estimate itself failed — the systems then run and report their own errors.
    """
    ours = [s for s in names if not systems.get(s).capabilities.peer]  # no shape estimate
    if not ours:
        return None
    spec = {**_spec(args, "-"), "systems": ours,
            "memory_limit": parse_bytes(args.memory_limit) if args.memory_limit else None}
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out = os.path.join(tmp, "spec.json"), os.path.join(tmp, "estimate.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
        proc = subprocess.run([sys.executable, "-m", "jaxrl_sym.cli", ESTIMATE, spec_path, out],
                              capture_output=True, text=True, env=env)
        if proc.returncode != 0 or not os.path.exists(out):
            last = (proc.stderr or proc.stdout).strip().splitlines()[-1:]
            print(f"warning: memory estimate failed, running without the check: {last}",
                  file=sys.stderr, flush=True)
            return None
        with open(out) as f:
            return json.load(f)


def _refuse(p: _Parser, cmd: str, errors: list[str]) -> int:
    """Usage plus one ``error:`` line per problem on stderr; exit code 2 (as argparse's own).
    Returned, not raised, so in-process callers (tests, scripts) get the code from ``main``."""
    p.commands[cmd].print_usage(sys.stderr)
    for e in errors:
        print(f"jaxrl-sym {cmd}: error: {e}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``jaxrl-sym``: parse, check every flag, then (only then) do the work."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # Before JAX is imported anywhere: this process and its children share the persistent
    # compilation cache (``JAXRL_SYM_COMPILE_CACHE=off`` or a directory; see compile_cache).
    configure_environment()
    if argv[:1] == [INTERNAL]:
        return _child(argv[1:])
    if argv[:1] == [ESTIMATE]:
        return estimate_child(argv[1:])
    try:  # installed system plugins (entry points): a broken one is named, not a traceback
        systems.load_plugins()
    except SymError as e:
        print(f"jaxrl-sym: error: {e}", file=sys.stderr)
        return 2
    p = _parser(with_train=argv[:1] == ["train"])
    if argv[:1] == ["train"]:  # --config FILE: its flags go before the command line's
        try:
            argv = ["train", *config_file.with_config(p.commands["train"], argv[1:])]
        except SymError as e:
            return _refuse(p, "train", [str(e)])
    args = p.parse_args(argv)
    if args.cmd == "decode":
        errors = check_decode(args)
        if errors:
            return _refuse(p, "decode", errors)
        report = decode(args)
        if all("skipped" in m for m in report["systems"].values()):
            # Nothing fits: refuse as for a bad flag (no system ran, no report to print).
            return _refuse(p, "decode", [m["skipped"] for m in report["systems"].values()])
        if args.out:
            with open(args.out, "w") as f:
                f.write(jsonl.dumps(report, indent=1))
        print(jsonl.dumps(report) if args.json else decode_table(report))
        return 0 if all("error" not in m and "skipped" not in m
                        for m in report["systems"].values()) else 1
    if args.cmd == "train":
        errors = check_train(args)
        if errors:
            return _refuse(p, "train", errors)
        if args.print_config:  # the effective flags, as the TOML --config reads
            print(config_file.effective(p.commands["train"], args), end="")
            return 0
        from jaxrl_sym.rl.run.cli import run_train

        return run_train(args)
    if args.cmd in HF_COMMANDS:
        return run_hf(args, lambda errors: _refuse(p, args.cmd, errors))
    if args.cmd == "eval":
        from jaxrl_sym.rl.run.eval_cli import run_eval

        return run_eval(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
