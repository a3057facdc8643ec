"""``jaxrl-sym export``: its flags, their checks (JAX-free, like :mod:`jaxrl_sym.hf_cli`), the
export itself, and what a signal does to it.

Split from :mod:`jaxrl_sym.hf_cli` (which keeps ``generate``, the model checks both commands
share, and the dispatch) when signal handling and the tokenizer rule pushed it past 500 lines.

Why an export handles signals: it writes a temporary directory beside ``--out`` and swaps it
into place at the end (:func:`jaxrl_sym.models.hf.export.swap_into_place`). Python's defaults
turned Ctrl-C into a traceback and let SIGTERM/SIGHUP/SIGUSR1 end the process in the middle,
leaving that hidden partial directory. Here every one of them stops the export, removes the
partial copy, prints one line and exits 128 + signal, as an interrupted ``train`` does.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import signal
import sys
import threading
import time
from typing import Any

from jaxrl_sym.hf_checks import DTYPES, CliError, is_gguf, model_errors


def export_parser(sub: Any, formatter: type) -> argparse.ArgumentParser:
    """The ``export`` sub-command's parser, added to the top-level group ``sub``."""
    e = sub.add_parser("export", help="write a Hugging Face checkpoint directory",
                       description="Write a checkpoint directory transformers loads, from a "
                                   "checkpoint directory (--model; e.g. with --dtype) or from "
                                   "an RL training checkpoint (--checkpoint-dir).",
                       formatter_class=formatter)
    src = e.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", metavar="DIR", help="a Hugging Face checkpoint directory")
    src.add_argument("--checkpoint-dir", metavar="DIR",
                     help="an RL training checkpoint directory (jaxrl-sym train --model)")
    e.add_argument("--out", required=True, metavar="DIR", help="directory to create")
    e.add_argument("--step", type=int, default=None,
                   help="with --checkpoint-dir: this step (default: the newest good one)")
    e.add_argument("--dtype", choices=DTYPES, default=None,
                   help="cast the parameters (default: keep)")
    e.add_argument("--peft", action="store_true",
                   help="with --checkpoint-dir of a LoRA run: write its adapters as a PEFT "
                        "adapter directory (adapter_config.json + adapter_model.safetensors) "
                        "instead of the merged model")
    e.add_argument("--max-shard-size", default="5GB", metavar="BYTES",
                   help="shard the weights above this size (e.g. 5GB, 500MiB)")
    e.add_argument("--overwrite", action="store_true",
                   help="replace a non-empty --out (only once the new one is complete)")
    e.add_argument("--no-tokenizer", action="store_true",
                   help="export from a source that has no tokenizer.json (refused without it: "
                        "nothing could encode text for the export)")
    e.add_argument("--json", action="store_true", help="print one JSON object last")
    return e


def parse_size(text: str) -> int:
    """``5GB``/``5G`` (10**9), ``500MiB`` (2**20), ``123`` → bytes, else an InputError naming
    ``--max-shard-size``."""
    from jaxrl_sym.sizes import parse_bytes

    return parse_bytes(text, flag="--max-shard-size")


def check_export(args: argparse.Namespace) -> list[str]:
    """Every problem with an ``export`` command line, each naming the flag."""
    if args.model is not None:
        errors = model_errors("--model", args.model)
        if not errors and is_gguf(args.model):  # config and tokenizer rebuilt from the file
            if args.no_tokenizer:
                errors.append(f"--no-tokenizer: --model {args.model} is a GGUF file whose "
                              "tokenizer the export writes; drop --no-tokenizer")
        elif not errors and (problem := tokenizer_problem(args.model, args.no_tokenizer,
                                                          f"--model {args.model}")):
            errors.append(problem)
        if args.step is not None:
            errors.append("--step applies to --checkpoint-dir only")
        if args.peft:
            errors.append("--peft applies to --checkpoint-dir of a LoRA run only")
    else:
        errors = ([] if os.path.isdir(args.checkpoint_dir)
                  else [f"--checkpoint-dir {args.checkpoint_dir}: no such directory"])
        if args.step is not None and args.step < 1:
            errors.append(f"--step must be >= 1, got {args.step}")
        if args.peft and args.no_tokenizer:
            errors.append("--no-tokenizer applies to a model export; a --peft adapter "
                          "directory holds no tokenizer")
    try:
        parse_size(args.max_shard_size)
    except ValueError as err:
        errors.append(str(err))
    out = os.path.abspath(args.out)
    if os.path.exists(out) and not os.path.isdir(out):
        errors.append(f"--out {args.out}: exists and is not a directory")
    elif os.path.isdir(out) and os.listdir(out) and not args.overwrite:
        errors.append(f"--out {args.out}: not empty; choose a new directory or pass --overwrite")
    elif not os.path.isdir(os.path.dirname(out)):
        errors.append(f"--out {args.out}: parent directory {os.path.dirname(out)} does not "
                      "exist")
    return errors


def tokenizer_problem(source: str, no_tokenizer: bool, what: str) -> str | None:
    """Why an export from ``source`` (``what`` names it) would not carry the tokenizer the user
    asked for, else None.

    A source without ``tokenizer.json`` used to export silently without one: the weights load,
    but nothing can encode text for them (transformers' AutoTokenizer, ``generate --prompt``),
    which the user learns later, elsewhere. So a missing one is refused unless
    ``--no-tokenizer`` says so, and ``--no-tokenizer`` beside a tokenizer the export copies
    anyway is refused as a flag that would be ignored."""
    has = os.path.isfile(os.path.join(source, "tokenizer.json"))
    if not has and not no_tokenizer:
        return (f"{what} has no tokenizer.json, so the export would hold no tokenizer and "
                "nothing could encode text for it (transformers' AutoTokenizer, jaxrl-sym "
                "generate --prompt); copy the tokenizer files there, or pass --no-tokenizer to "
                "export the weights without one")
    if has and no_tokenizer:
        return (f"--no-tokenizer: {what} has a tokenizer.json, which the export copies; drop "
                "--no-tokenizer")
    return None


def run_export(args: argparse.Namespace) -> dict[str, Any]:
    """Load (a directory, or an RL checkpoint's policy) and export; the report."""
    t0 = time.perf_counter()
    shard = parse_size(args.max_shard_size)
    if args.model is not None:
        from jaxrl_sym.models.hf import export_pretrained, load_pretrained

        model, _, _ = load_pretrained(args.model, dtype=args.dtype)
        src_dir: Any = args.model
        if is_gguf(args.model):  # the config.json and tokenizer files the loader rebuilds
            from jaxrl_sym.models.hf.gguf import find_gguf
            from jaxrl_sym.models.hf.gguf_source import hf_source

            src_dir = hf_source(find_gguf(args.model) or args.model)
        files = export_pretrained(model, args.out, source_dir=src_dir,
                                  overwrite=args.overwrite, max_shard_bytes=shard)
        source: dict[str, Any] = {"model": os.path.abspath(args.model)}
    else:
        from jaxrl_sym.rl.run.export import export_checkpoint, source_model

        if not args.peft:  # a model export copies the run's source tokenizer
            src = source_model(args.checkpoint_dir, args.step)
            problem = tokenizer_problem(src, args.no_tokenizer, f"the run's source model {src} "
                                        f"(of --checkpoint-dir {args.checkpoint_dir})")
            if problem:
                raise CliError(problem)
        files, source = export_checkpoint(args.checkpoint_dir, args.out, step=args.step,
                                          dtype=args.dtype, overwrite=args.overwrite,
                                          max_shard_bytes=shard, peft=args.peft)
    return {"out": os.path.abspath(args.out), "files": files, **source,
            "seconds": time.perf_counter() - t0}


# train's signals (jaxrl_sym.rl.run.interrupt.SIGNALS; that package imports JAX)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)


def export_or_stop(args: argparse.Namespace) -> dict[str, Any]:
    """:func:`run_export`; a stop signal on the way ends the process instead, leaving nothing
    half-written (:func:`_abandon`): one line on stderr, exit 128 + signal (train's code for an
    interrupted run).

    Why not train's "finish the step, then stop": an export has no step to save — a stopped one
    is worth nothing — and what matters is what it leaves. Python's defaults left too much:
    SIGINT was a traceback, and SIGTERM, SIGHUP and SIGUSR1 ended the process at once with the
    hidden temporary directory the export was writing. Why not an exception unwinding the
    export: a signal may land anywhere — in a garbage-collection callback (JAX has one), where
    Python drops the exception and the export went on; inside a C extension's import, which
    turns it into "ImportError: initialization failed". The handler cleans up itself and ends
    the process with ``os._exit``, wherever it lands. The CLI owns its process (as ``train``'s
    handlers do); an in-process ``main()`` sent a stop signal ends its interpreter too.
    """
    out = os.path.abspath(args.out)
    here = (glob.escape(os.path.dirname(out)), glob.escape(f".{os.path.basename(out)}."))
    patterns = [os.path.join(here[0], here[1] + kind + "-*") for kind in ("tmp", "old")]
    before = {p for pattern in patterns for p in glob.glob(pattern)}
    old = _identity(out)

    def handle(signum: int, _frame: object) -> None:
        for s in STOP_SIGNALS:  # a second signal must not cut the cleanup short
            signal.signal(s, signal.SIG_IGN)
        made = [p for pattern in patterns for p in glob.glob(pattern) if p not in before]
        line = _abandon(signum, out, made, old) + "\n"  # os.write: print may be mid-call
        os.write(sys.stderr.fileno(), line.encode())
        os._exit(128 + signum)

    if threading.current_thread() is not threading.main_thread():
        return run_export(args)
    previous = {s: signal.signal(s, handle) for s in STOP_SIGNALS}
    try:
        return run_export(args)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _identity(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _abandon(signum: int, out: str, made: list[str], old: tuple[int, int] | None) -> str:
    """Undo an export stopped by ``signum`` (the main thread is paused wherever the signal
    landed): put back an ``--out`` a swap moved aside (``.OUT.old-*``, where the system cannot
    exchange two directories) if the new one is not in place, then remove every directory the
    export made beside ``--out`` (``.OUT.tmp-*``, ``.OUT.old-*``). The line to print."""
    name = os.path.basename(out)
    for path in made:
        if os.path.basename(path).startswith(f".{name}.old-") and not os.path.exists(out) \
                and os.path.isdir(os.path.join(path, name)):
            os.rename(os.path.join(path, name), out)
    for path in made:
        shutil.rmtree(path, ignore_errors=True)
    sig = signal.Signals(signum).name
    if _identity(out) != old:  # the signal came after the new --out was in place
        return f"{sig}: stopped as the export finished; {out} holds the complete export"
    return (f"{sig}: export stopped before it finished; {out} "
            f"{'was not created' if old is None else 'is unchanged'} and no partial copy was "
            "left")
