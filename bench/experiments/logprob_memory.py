"""RL update peak bytes at Qwen's 151,936-token vocabulary, unchunked vs chunked log-probs.

One process, one small DecoderLM (width 128, 2 layers: the vocabulary dominates), the sym
system's packed layout of ``N`` token slots (sequences of 256 tokens, rows of 1024), and for
each token count and ``ExecutionConfig.logprob_chunk`` (``0`` = off) the step's own fused
update program (``stages.update_once``: loss, gradient and Adam in one program, as a one-micro-batch
step runs it). The peak is what the step reports, :class:`~jaxrl_sym.rl.step.programs.Programs`'
``peak``: inputs + resident state + XLA's temporaries (``memory_analysis``) + outputs.

Configurations whose compiled peak exceeds the preset's ``run_limit_gb``, or with more than its
``run_max_tokens`` slots, are compiled but not run (the shared CPU box has no room or time for
them); their peak is the same sum read from the compiled executable (where both exist they agree
to a few hundred bytes), and the table marks them ``compiled only``. The run time is one warm
call.

    python -m bench logprob_memory --preset full   # 1k, 4k, 16k slots; off, 256, 1024, 4096
    python -m bench logprob_memory --preset full --tokens 1024 --chunks 0,1024
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from bench import presets
from bench.lib.child import ROOT
from jaxrl_sym.rl import RLConfig

if TYPE_CHECKING:
    from jaxrl_sym.rl import RLTrainer

VOCAB = 151_936
SEQ, PROMPT, ROW = 256, 64, 1024
_LIMITS = {"run_limit_gb": 5.0, "run_max_tokens": 4096}
PRESETS: dict[str, dict[str, Any]] = {
    "quick": {**_LIMITS, "tokens": "256", "chunks": "0,256",
              "out": str(Path(presets.quick_dir("logprob_memory")) / "logprob_memory")},
    "full": {**_LIMITS, "tokens": "1024,4096,16384", "chunks": "0,256,1024,4096",
             "out": str(ROOT / "bench" / "results" / "cpu" / "logprob_memory")},
    "gpu": {"run_limit_gb": 60.0, "run_max_tokens": 16384, "tokens": "1024,4096,16384",
            "chunks": "0,256,1024,4096", "out": None},
}


def batch(tr: RLTrainer, tokens: int, seed: int = 0) -> tuple[Any, dict[str, np.ndarray]]:
    """A packed layout of ``tokens`` slots and loss arrays (random advantages, log-probs)."""
    rng = np.random.default_rng(seed)
    n = tokens // SEQ
    prompts = [rng.integers(1, VOCAB, PROMPT).astype(np.int32) for _ in range(n)]
    responses = [rng.integers(1, VOCAB, SEQ - PROMPT).astype(np.int32) for _ in range(n)]
    lay = tr.system.layout(prompts, responses, row_len=ROW)  # the trainer's system: sym
    mask = lay.mask()
    arrays = {"targets": lay.targets, "mask": mask,
              "weight": (mask / mask.sum()).astype(np.float32),
              "old_lp": np.full(lay.shape, -11.0, np.float32),
              "ref_lp": np.full(lay.shape, -11.0, np.float32),
              "adv": rng.normal(size=lay.shape).astype(np.float32)}
    return lay, arrays


def compiled_peak(tr: RLTrainer, lay: Any, arrays: dict[str, np.ndarray]) -> int:
    """What ``Programs.run`` would record for the update, from the compiled executable alone."""
    from dataclasses import replace

    import jax

    from jaxrl_sym.rl.step.stages import micro_batches

    # the whole layout in one program (sym would cut it at DEFAULT_UPDATE_TOKENS otherwise)
    (inputs, arr), = micro_batches(replace(tr.cfg.execution, update_tokens=lay.targets.size),
                                   lay, arrays)
    args = (tr.params, tr.opt_state, tr.state.frozen, inputs, arr)
    exe = tr.context.fns(tr.system)["update"].lower(*args).compile()
    ma = exe.memory_analysis()
    held = sum(int(np.asarray(x).nbytes) for x in jax.tree_util.tree_leaves(args))
    return held + int(ma.temp_size_in_bytes) + int(ma.output_size_in_bytes)


def measure(tokens: int, chunk: int, run_limit: float, run_max_tokens: int) -> dict[str, Any]:
    from jaxrl_sym.models.lm import init_model, preset  # JAX only once the flags are read
    from jaxrl_sym.rl import RLTrainer
    from jaxrl_sym.rl.step.stages import update_once
    from jaxrl_sym.runtime.metrics import tree_bytes

    model = init_model(preset("small", vocab_size=VOCAB, d_model=128, n_layers=2), 0)
    cfg = RLConfig.of(group_size=2, logprob_chunk=chunk or None, pack_row_len=ROW)
    tr = RLTrainer(model, lambda p, r: 0.0, cfg, system="sym")
    lay, arrays = batch(tr, tokens)
    t = time.perf_counter()
    peak = compiled_peak(tr, lay, arrays)
    row: dict[str, Any] = {"tokens": tokens, "slots": int(np.prod(lay.shape)),
                           "logprob_chunk": chunk or None, "compile_s": time.perf_counter() - t,
                           "compiled_peak_bytes": peak,
                           "logits_bytes_fp32": int(np.prod(lay.shape)) * VOCAB * 4,
                           "state_bytes": tree_bytes(tr.state.params)
                           + tree_bytes(tr.state.opt_state),
                           "chunking": tr.context.fns(tr.system)["logprob_chunking"]}
    if peak > run_limit or tokens > run_max_tokens:
        return {**row, "ran": False}
    ctx = tr.context
    # update_once consumes (donates) the state it is given: the first run's output feeds the next
    params, opt, _ = update_once(ctx, tr.params, tr.opt_state, tr.state, lay, arrays)  # compile+run
    tr.programs.peak = 0
    t = time.perf_counter()
    _, _, aux = update_once(ctx, params, opt, tr.state, lay, arrays)
    return {**row, "ran": True, "run_s": time.perf_counter() - t,
            "programs_peak_bytes": tr.programs.peak, "loss": aux["loss"]}


def table(rows: list[dict[str, Any]]) -> str:
    gb = lambda b: f"{b / 1e9:.2f}"
    lines = ["| slots | logprob_chunk | update peak (GB) | fp32 logits alone (GB) | "
             "run (s) | how |", "|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        peak = r.get("programs_peak_bytes", r["compiled_peak_bytes"])
        how = "ran: Programs.peak" if r["ran"] else "compiled only: memory_analysis"
        run = f"{r['run_s']:.1f}" if r["ran"] else "-"
        lines.append(f"| {r['slots']} | {r['logprob_chunk'] or 'off'} | {gb(peak)} | "
                     f"{gb(r['logits_bytes_fp32'])} | {run} | {how} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, every setting of the chosen preset filled in."""
    p = presets.parser("logprob_memory", __doc__, PRESETS)
    p.add_argument("--tokens", default=None, type=presets.ints(1),
                   help="comma-separated token slot counts")
    p.add_argument("--chunks", default=None, type=presets.ints(0),
                   help="comma-separated logprob_chunk values (0: off)")
    p.add_argument("--out", default=None, help="OUT.json and OUT.md")
    return presets.parse(p, PRESETS, argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import jax

    rows = []
    for tokens in presets.csv(args.tokens, int):
        for chunk in presets.csv(args.chunks, int):
            rows.append(measure(tokens, chunk, args.run_limit_gb * 1e9, args.run_max_tokens))
            print(json.dumps(rows[-1]), flush=True)
    cmd = presets.command("logprob_memory", argv)
    meta = {"command": cmd, "vocab": VOCAB, "model": "DecoderLM d_model=128, 2 layers",
            "device": str(jax.devices()[0]), "jax": jax.__version__}
    out = Path(args.out) if args.out else (
        ROOT / "bench" / "results" / jax.devices()[0].platform / "logprob_memory")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({**meta, "rows": rows}, indent=1))
    out.with_suffix(".md").write_text(
        f"# RL update peak bytes, vocabulary {VOCAB}\n\n`{cmd}`\n\n{meta['model']}, sym packed "
        f"layout (sequences of {SEQ}, rows of {ROW}), fused loss + gradient + Adam update, "
        f"{meta['device']}, jax {meta['jax']}.\n\n{table(rows)}\n")
    print(table(rows))
    return 0
