"""``jaxrl-sym generate`` and ``jaxrl-sym export``: Hugging Face checkpoints from the command line.

``generate`` runs a batch of prompts (text through the checkpoint's tokenizer, optionally its chat
template, or raw ids) on one system (a non-peer system of :mod:`jaxrl_sym.systems`: sym, padded
or pershape) and prints each row's tokens, log-probs and text; with ``--json`` the last stdout
line is one JSON object. ``export`` writes a checkpoint directory transformers loads: from a
directory (e.g. to cast the dtype) or from an RL training checkpoint that started from one
(its flags, checks and run: :mod:`jaxrl_sym.hf_export_cli`).

Like :mod:`jaxrl_sym.cli`, this module is JAX-free at import: every flag that can be checked from
the file system and JSON alone (directories, ids against ``config.json``'s vocabulary, numbers,
the output directory) is checked before JAX is imported, so a typo fails in well under a second.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from jaxrl_sym import jsonl, systems
from jaxrl_sym.hf_checks import DTYPES, CliError, is_gguf, model_errors
from jaxrl_sym.sharding import Distributed  # JAX-free at import

COMMANDS = ("generate", "export")


def _prompt_text(text: str) -> tuple[str, Any]:
    """``("text", text)``; bytes that are not UTF-8 (Python keeps them in ``argv`` as lone
    surrogates, which the tokenizer refuses with a TypeError) are an argparse error on the
    flag."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise argparse.ArgumentTypeError(
            f"holds bytes that are not UTF-8 at character {err.start + 1} "
            f"({text[err.start:err.end].encode('utf-8', 'surrogateescape')!r}); give the "
            "prompt as UTF-8 text (check the terminal's or script's encoding)") from None
    return ("text", text)


def _prompt_ids(text: str) -> tuple[str, Any]:
    """``1,2,3`` → ``("ids", [1, 2, 3])``; anything else is an argparse error on the flag."""
    try:
        ids = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated integer token ids like "
                                         f"1,2,3; got {text!r}") from None
    if any(i < 0 for i in ids):
        raise argparse.ArgumentTypeError(f"token ids must be >= 0; got {text!r}")
    return ("ids", ids)


def add_parsers(sub: Any, formatter: type) -> dict[str, argparse.ArgumentParser]:
    """Add ``generate`` and ``export`` (:mod:`jaxrl_sym.hf_export_cli`) to the top-level
    sub-parser group; returns them."""
    from jaxrl_sym.hf_export_cli import export_parser  # imports this module: not at the top

    return {"generate": _generate_parser(sub, formatter), "export": export_parser(sub, formatter)}


def _generate_parser(sub: Any, formatter: type) -> argparse.ArgumentParser:
    g = sub.add_parser("generate", help="generate text with a Hugging Face checkpoint",
                       description="Generate for a batch of prompts with a Hugging Face "
                                   "checkpoint directory;\nevery row stops at an EOS id or "
                                   "--max-new-tokens.", formatter_class=formatter)
    g.add_argument("--model", required=True, metavar="DIR",
                   help="checkpoint directory, or a llama.cpp .gguf file")
    g.add_argument("--prompt", dest="prompts", action="append", type=_prompt_text,
                   metavar="TEXT", help="a text prompt (repeat for a batch)")
    g.add_argument("--prompt-ids", dest="prompts", action="append", type=_prompt_ids,
                   metavar="1,2,3", help="a prompt as token ids (repeat; mixes with --prompt)")
    g.add_argument("--chat", action="store_true",
                   help="wrap each --prompt as one user message in the checkpoint's chat "
                        "template (with the assistant turn opened)")
    g.add_argument("--max-new-tokens", type=int, default=64, help="per row (>= 1)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--no-memory-check", action="store_true",
                   help="skip the memory estimate made before generating (a request that does "
                        "not fit is refused without it)")
    g.add_argument("--extrapolate", action="store_true",
                   help="generate past the checkpoint's max_position_embeddings (refused "
                        "without it: the model never saw those positions)")
    g.add_argument("--seed", type=int, default=0, help="sampling seed (any integer)")
    gen = systems.names(peer=False)  # the systems that run any model of the contract
    g.add_argument("--system", choices=gen, default=systems.REFERENCE,
                   help="; ".join(f"{n}: {systems.get(n).summary}" for n in gen))
    g.add_argument("--dtype", choices=DTYPES, default=None,
                   help="parameter dtype (default: the checkpoint's)")
    g.add_argument("--eos-id", type=int, action="append", default=None, metavar="ID",
                   help="end token id (repeatable); default: the checkpoint's "
                        "(generation_config.json, config.json, tokenizer_config.json)")
    g.add_argument("--ignore-eos", action="store_true",
                   help="run every row to --max-new-tokens")
    g.add_argument("--mesh", default=None, metavar="AXES",
                   help="with --system sym: generate on a device mesh, e.g. data=8 (weights "
                        "sharded, rows split over data; see README 'Multi-device')")
    Distributed.add_flags(g, "the rows")
    g.add_argument("--json", action="store_true", help="print one JSON object last")
    return g


def _vocab_size(path: str) -> int | None:
    try:
        with open(os.path.join(path, "config.json")) as f:
            vocab = json.load(f).get("vocab_size")
    except (OSError, ValueError, AttributeError):
        return None
    return vocab if isinstance(vocab, int) else None


def check_generate(args: argparse.Namespace) -> list[str]:
    """Every problem with a ``generate`` command line, each naming the flag."""
    errors = model_errors("--model", args.model)
    prompts = args.prompts or []
    if not prompts:
        errors.append("give at least one --prompt TEXT or --prompt-ids 1,2,3")
    if args.max_new_tokens < 1:
        errors.append(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    from jaxrl_sym.errors import SymError
    from jaxrl_sym.generation import GenerationConfig  # JAX-free: the library's own rules

    try:
        GenerationConfig(max_new_tokens=1, temperature=args.temperature)
    except SymError as err:
        errors.append(f"--temperature: {err}")
    if args.ignore_eos and args.eos_id:
        errors.append("--ignore-eos and --eos-id contradict each other; give one")
    if any(i < 0 for i in args.eos_id or []):
        errors.append(f"--eos-id must be >= 0, got {args.eos_id}")
    if args.mesh is not None:
        from jaxrl_sym.sharding import MeshConfig  # JAX-free

        try:
            MeshConfig.parse(args.mesh)
        except SymError as err:
            errors.append(str(err))
        if not systems.get(args.system).capabilities.shards:
            errors.append(f"--mesh applies to --system {' or '.join(systems.names(shards=True))} "
                          f"(got --system {args.system})")
    try:
        args.distributed = Distributed.from_flags(args.coordinator, args.num_processes,
                                                  args.process_id)
    except SymError as err:
        errors.append(str(err))
    else:
        if args.distributed is not None and args.mesh is None:
            errors.append(Distributed.NEEDS_MESH)
    if not os.path.isfile(os.path.join(args.model, "config.json")):
        return errors
    vocab = _vocab_size(args.model)
    for n, (kind, value) in enumerate(prompts):
        if kind == "ids" and vocab is not None and max(value) >= vocab:
            errors.append(f"--prompt-ids (prompt {n}): id {max(value)} is outside the "
                          f"vocabulary [0, {vocab}) of {args.model}/config.json")
        if kind == "text" and not os.path.isfile(os.path.join(args.model, "tokenizer.json")):
            errors.append(f"--prompt (prompt {n}): {args.model} has no tokenizer.json; give "
                          "--prompt-ids instead")
    for i in args.eos_id or []:
        if vocab is not None and i >= vocab:
            errors.append(f"--eos-id {i} is outside the vocabulary [0, {vocab})")
    if args.chat and not any(kind == "text" for kind, _ in prompts):
        errors.append("--chat applies to --prompt TEXT prompts; none were given")
    elif args.chat and not _has_chat_template(args.model):
        errors.append(f"--chat: {args.model} has no chat template (no chat_template.jinja, no "
                      "chat_template in tokenizer_config.json); drop --chat to send plain text")
    return errors


def _has_chat_template(path: str) -> bool:
    """Whether HFText will find a template (the same files, without importing it)."""
    if os.path.isfile(os.path.join(path, "chat_template.jinja")):
        return True
    for name in ("tokenizer_config.json", "chat_template.json"):
        try:
            with open(os.path.join(path, name)) as f:
                if json.load(f).get("chat_template"):
                    return True
        except (OSError, ValueError, AttributeError):
            continue
    return False


def _encode_prompts(args: argparse.Namespace, text: Any) -> list[list[int]]:
    out = []
    for kind, value in args.prompts:
        if kind == "ids":
            out.append(list(value))
        elif args.chat:
            out.append(text.encode_chat([{"role": "user", "content": value}]))
        else:
            out.append(text.encode(value))
        if not out[-1]:
            raise CliError(f"--prompt {value!r} encodes to no tokens; give a non-empty prompt")
    return out


def cut_at_eos(tokens: list[int], eos_ids: tuple[int, ...]) -> int:
    """Length of the row up to and including its first EOS id (all of it when none)."""
    for i, t in enumerate(tokens):
        if t in eos_ids:
            return i + 1
    return len(tokens)


def generate_rows(args: argparse.Namespace) -> dict[str, Any]:
    """Load, encode, generate and decode; the report ``--json`` prints."""
    from jaxrl_sym.generation import GenerationConfig
    from jaxrl_sym.models.hf import load_pretrained
    from jaxrl_sym.models.hf.config import check_positions
    from jaxrl_sym.models.hf.text import HFText, find_eos_ids

    t0 = time.perf_counter()
    model, tok, _ = load_pretrained(args.model, dtype=args.dtype)
    if is_gguf(args.model):  # text prompts need its vocabulary: HFText says why it has none
        has_tok = tok is not None or args.chat or any(k == "text" for k, _ in args.prompts)
    else:
        has_tok = os.path.isfile(os.path.join(args.model, "tokenizer.json"))
    text = HFText(args.model) if has_tok else None
    prompts = _encode_prompts(args, text)
    longest = max(len(p) for p in prompts)
    check_positions(model.cfg.max_position_embeddings, longest + args.max_new_tokens,
                    f"--max-new-tokens {args.max_new_tokens} after the longest prompt "
                    f"({longest} tokens)", "lower --max-new-tokens or shorten the prompt; "
                    "--extrapolate generates past it on purpose", allow=args.extrapolate)
    if args.ignore_eos:
        eos: tuple[int, ...] = ()
    else:
        eos = tuple(args.eos_id) if args.eos_id else find_eos_ids(
            args.model, text.tokenizer if text else None)
    # Every system stops a row at the first of any EOS id; the cut below only re-derives the
    # row's end (and is a no-op on their output).
    gcfg = GenerationConfig(max_new_tokens=args.max_new_tokens, eos_id=eos or None,
                            temperature=args.temperature, seed=args.seed)
    mesh = None
    if args.mesh is not None:  # check_generate allowed it only on a system that shards
        from jaxrl_sym.sharding import MeshConfig

        mesh = MeshConfig.parse(args.mesh)
    bound = systems.get(args.system).bind(model, systems.BindOptions(mesh=mesh))
    if not args.no_memory_check:
        _check_memory(bound, [len(p) for p in prompts], gcfg)
    res = bound.generate([_np_ids(p) for p in prompts], gcfg)
    rows = []
    for p, toks, lps in zip(prompts, res.tokens, res.logprobs, strict=True):
        n = cut_at_eos([int(t) for t in toks], eos)
        kept = [int(t) for t in toks[:n]]
        rows.append({"prompt_ids": p, "tokens": kept,
                     "logprobs": [float(x) for x in lps[:n]],
                     "text": text.decode(kept) if text else None,
                     "stop": "eos" if kept and kept[-1] in eos else "length"})
    return {"rows": rows, "model": os.path.abspath(args.model), "system": args.system,
            "mesh": args.mesh,
            "max_new_tokens": args.max_new_tokens, "temperature": gcfg.temperature,
            "seed": gcfg.seed, "eos_ids": list(eos), "seconds": time.perf_counter() - t0}


def _check_memory(bound: Any, prompt_lens: list[int], gcfg: Any) -> None:
    """The system's estimate for this request against the device's (or host's) memory, before
    anything is allocated: a padded MAX_LEN cache of a billion tokens used to die in XLA with a
    64 GB RESOURCE_EXHAUSTED traceback, and sym ran without a word."""
    from jaxrl_sym.runtime.memory.estimate import check_request

    est = bound.estimate(prompt_lens, gcfg)
    if est is not None:
        refused = check_request([est], lower="--max-new-tokens or the prompts")[
            "systems"][est.system]["refused"]
        if refused:
            raise CliError(refused)


def _np_ids(ids: list[int]) -> Any:
    import numpy as np

    return np.asarray(ids, np.int32)


def run(args: argparse.Namespace, refuse: Callable[[list[str]], int]) -> int:
    """Check the flags (JAX-free), then run ``generate``/``export``; print; exit code."""
    from jaxrl_sym.hf_export_cli import check_export, export_or_stop

    errors = check_generate(args) if args.cmd == "generate" else check_export(args)
    if errors:
        return refuse(errors)
    from jaxrl_sym.errors import SymError

    dist = getattr(args, "distributed", None)
    try:
        if dist is not None:
            dist.initialize()
        report = generate_rows(args) if args.cmd == "generate" else export_or_stop(args)
    except (SymError, CliError) as err:
        print(f"jaxrl-sym {args.cmd}: error: {err}", file=sys.stderr)
        return 2
    if dist is not None and not dist.reports():
        return 0  # every process generated the same rows; process 0 prints them
    if args.json:
        print(jsonl.dumps(report))
    elif args.cmd == "generate":
        for i, row in enumerate(report["rows"]):
            shown = row["text"] if row["text"] is not None else row["tokens"]
            print(f"[{i}] ({len(row['tokens'])} tokens, {row['stop']}) {shown}")
    else:
        print(f"wrote {report['out']}: {', '.join(report['files'])}")
    return 0
