"""The GPU plan: every measurement a lent GPU should make, in priority order, in one command.

A GPU is lent rarely and briefly (15 device minutes a session, machine start included), so the
plan is prepared here and only *produces results* there:

    python -m bench gpu_plan --budget-min 8 --out $OUT --commit <git sha>   # on the GPU
    python -m bench gpu_plan --dry-run --out /tmp/plan                       # CPU, tiny shapes

Each item runs in its own process (``bench.lib.child``: its own allocator peak, an OOM is a row)
with a timeout of what is left of the budget; an item whose expected minutes no longer fit is
recorded as skipped, not started. After every item one line is appended to ``plan.jsonl`` in
``--out``: the item, its status, seconds, the experiment's own JSON report (parsed), the log's tail,
and the device, versions, date and git commit, so a run cut short keeps everything it finished. The
device tool returns at most 8 files, so the whole plan is two: ``plan.jsonl`` and ``plan.log``.

``--dry-run`` runs every item's code path at tiny shapes on whatever backend is here (CI runs it):
a GPU run then spends its minutes on results, not on script bugs. Items that need a GPU report
``skipped`` with the experiment's own reason on a CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import presets
from bench.lib import child
from jaxrl_sym.errors import InputError

_GPU_OUT = str(child.ROOT / "bench" / "results" / "gpu_plan")  # then moved to <device>/<date>/
PRESETS: dict[str, dict[str, Any]] = {
    "quick": {"budget_min": 30.0, "dry_run": True, "out": presets.quick_dir("gpu_plan"),
              "commit": None, "only": None},
    "full": {"budget_min": 25.0, "dry_run": False, "out": _GPU_OUT, "commit": None, "only": None},
    "gpu": {"budget_min": 25.0, "dry_run": False, "out": _GPU_OUT, "commit": None, "only": None},
}


@dataclass(frozen=True)
class Item:
    """One measurement: ``gpu``/``dry`` are its argv after ``python -m`` (``{out}`` is the
    item's result file); ``minutes`` is the expected time on an H100, start-up included (from
    the last H100 run where it ran, else an estimate); ``why`` is what it answers;
    ``projection``: the committed ``bench project`` JSON its measurement is compared with."""

    name: str
    minutes: float
    why: str
    gpu: tuple[str, ...]
    dry: tuple[str, ...]
    needs_gpu: bool = False
    projection: str | None = None
    junit: bool = False  # a pytest run: its result file is JUnit XML, not an experiment's JSON
    env: tuple[tuple[str, str], ...] = ()  # set for the item (dry runs too: XLA checks flags)


_RL = ("bench", "rlft_step", "--steps", "1", "--out", "{out}")
_RL_DRY = ("bench", "rlft_step", "--preset", "quick", "--out", "{out}")
# the configuration people run: bf16-mixed + LoRA 16 at the gpu preset (dry: rank 4, quick)
_BF16 = (*_RL, "--preset", "gpu", "--precision", "bf16-mixed", "--lora-rank", "16")
_BF16_DRY = (*_RL_DRY, "--precision", "bf16-mixed", "--lora-rank", "4")


def _sym_with(engine: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(gpu, dry) argv of sym's bf16-mixed + LoRA 16 step with one engine-options change (JSON):
    an ablation against the sym-vs-padded item's sym."""
    return tuple((*base, "--systems", "sym", "--engine", engine) for base in (_BF16, _BF16_DRY))


PLAN: tuple[Item, ...] = (
    Item("gpu_tests", 1.2, "compiled Triton kernels against XLA, the decode kernel now reading "
         "heads-major stores [B, Hkv, C, D] (2026-11-26b: 8 passed, 54 s, slots-major); the "
         "pallas backend's decode kernel compiled by XLA's Triton against numpy (never run "
         "compiled before)",
         ("pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "tests/test_kernels_interpret.py",
          "tests/test_pallas_decode.py", "--junitxml={out}"),
         ("pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "tests/test_kernels_interpret.py",
          "tests/test_pallas_decode.py", "--junitxml={out}"), junit=True),
    Item("rl_step_sym_pallas", 3.5,
         "sym's bf16-mixed + LoRA 16 step with backend pallas: each decode step's attention one "
         "Pallas kernel inside the tile's CUDA graph, writing the step's keys and values itself "
         "(bench dispatch: 369 kernels a step instead of 513, projected generation 2.77 s "
         "instead of 3.52 at 9 programs); generation s against "
         "the next item's sym in the same tree — if it pays, pallas becomes the GPU default",
         *_sym_with('{"backend": "pallas"}')),
    Item("rl_step_bf16mixed_lora16", 6.5,
         "sym vs padded at sym's defaults (128 resident rows), bf16-mixed + LoRA 16, in one run: "
         "since the last (2026-11-26b: 8.44 vs 10.09 GB) the stores are heads-major (the H100 "
         "compile found the decode tile holding a transposed copy of every store, 1.69 GB), "
         "shared prompts are written into every copy (the prefill's row gather copied every "
         "store), compaction goes store by store, reference chunks during generation are one "
         "row, one in flight, and the stores start at 768 slots (a 1.5x capacity grid); "
         "projected sym 2.60 vs padded 5.37 GB (bench/results/projection/"
         "rl_step_gpu_h100_bf16mixed_lora16.md); decode tiles test their rows once per 8 steps "
         "(static inner loops) and, with early compaction (the GPU default), tiles keep their "
         "length while rows end: 0.16 host round-trips per decode step where there was one "
         "(bench dispatch) — generation s against 3.71 (2026-11-26b) and the dispatch "
         "ledger's projection; compaction now (0.5, 16) on a GPU: 9-11 generation programs "
         "instead of 21 (cold programs and compile s of the first step); decode programs and "
         "the overlapped reference's program now compile ahead on 4 threads "
         "(EngineOptions.compile_threads): bench dispatch projects sym's first generation "
         "at 25.6 s with them, 93.4 s without, padded's 43.1 s",
         _BF16,
         _BF16_DRY,
         projection="bench/results/projection/rl_step_gpu_h100_bf16mixed_lora16.json"),
    Item("rl_step_sym_late_compaction", 3.5,
         "sym's bf16-mixed + LoRA 16 step with compaction at tile ends (compact_early false): "
         "tiles shrink to 8 steps while rows end, as every GPU run so far measured (bench "
         "dispatch: 74 tiles, 0.27 host round-trips a decode step); the previous item's sym runs "
         "the new GPU default, early compaction with tiles that keep their length (19 tiles, "
         "0.16) at the same buckets and row-steps — generation s, this change alone",
         *_sym_with('{"compact_early": false}')),
    Item("rl_step_sym_memory_knobs", 3.5,
         "sym alone with its memory knobs, bf16-mixed + LoRA 16: generation through 32 resident "
         "rows with refill, update micro-batches of one 1,280-slot row; 2026-11-27: 5.12 GB "
         "(0.536x padded's 9.55), step 9.02 s; since then LoRA runs unmerged in every program "
         "(no 0.99 GB merged copy beside the frozen base)",
         (*_BF16,
          "--systems", "sym", "--update-tokens", "1280",
          "--engine", '{"microbatch_rows": 32, "refill": true}'),
         (*_BF16_DRY, "--systems", "sym",
          "--update-tokens", "256", "--engine", '{"microbatch_rows": 4, "refill": true}'),
         projection="bench/results/projection/"
                    "rl_step_gpu_h100_bf16mixed_lora16_sym_update1280_refill32.json"),
    Item("rl_step_sym_knobs_no_overlap", 3.5,
         "item 2 with the reference scored after generation instead of during it: the H100 "
         "held ~1.9 GB in sym's generation beyond every program the ledger compiles (for the "
         "H100: the runtime's generation 1.82 GB, an overlapped reference chunk 0.19); the "
         "leading suspect is the temporaries of reference chunks queued asynchronously behind "
         "the decode tiles (86 per step), each allocated when enqueued — since capped at 1 in "
         "flight (systems/overlap.py MAX_INFLIGHT), so item 2 measures the cap and this the "
         "reference after generation",
         (*_BF16,
          "--systems", "sym", "--update-tokens", "1280",
          "--engine", '{"microbatch_rows": 32, "refill": true}', "--no-overlap-reference"),
         (*_BF16_DRY, "--systems", "sym", "--update-tokens", "256",
          "--engine", '{"microbatch_rows": 4, "refill": true}', "--no-overlap-reference")),
    Item("rl_step_padded_bf16mixed_lora16", 2.5,
         "padded alone, bf16-mixed + LoRA 16, default flags: the baseline for the knobs item "
         "in the same tree (2026-11-27: 9.55 GB, step 15.75 s); since then its prefill no "
         "longer stacks every chunk's logits (-2.18 GB, H100 compile) and LoRA runs unmerged",
         (*_BF16, "--systems", "padded"),
         (*_BF16_DRY, "--systems", "padded"),
         projection="bench/results/projection/rl_step_gpu_h100_bf16mixed_lora16.json"),
    Item("rl_step_sym_while_graphs", 3.5,
         "sym's bf16-mixed + LoRA 16 step with XLA's while loops and conditionals inside CUDA "
         "graphs: a decode tile's outer loop (a test per 8 steps) runs on device, the whole "
         "tile one graph (bench dispatch --command-buffers while: 0 host round-trips inside a "
         "tile); generation s against item 2's sym in the same tree — if it pays, the flag "
         "becomes the library's GPU default",
         (*_BF16,
          "--systems", "sym"),
         (*_BF16_DRY, "--systems", "sym"),
         env=(("XLA_FLAGS", "--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL"),)),
    Item("decode_kernel_batch1", 2.5,
         "batch-1 decode-attention bandwidth, the kernel now (2-block splits, combine in the "
         "split launch, K/V loads not waiting on positions), each change undone alone, and the "
         "first run's layout (2026-11-26b: now 1.3-1.8x faster at 4k with many kv heads, up to "
         "1.5x slower at 32k with 4-7 query heads per kv head)",
         ("bench", "decode_kernel", "--preset", "gpu", "--batches", "1",
          "--lengths", "4096,32768", "--variants", "now,launch,predicated,wide,before",
          "--out", "{out}"),
         ("bench", "decode_kernel", "--preset", "quick", "--out", "{out}"), needs_gpu=True),
    Item("refill", 6.0,
         "refill vs compaction vs padded groups of R on the GPU-sized realistic request, where "
         "a decode step is memory-bound (replay-projected at 512 samples: refill 1.8x / 1.5x "
         "faster than compaction at R = 32 / 64; on the 2-core CPU it is slower); 2026-11-26b: "
         "no row in 276 s (tokens differed from compaction's on the GPU; now recorded)",
         ("bench", "refill", "--preset", "gpu", "--out", "{out}"),
         ("bench", "refill", "--preset", "quick", "--out", "{out}")),
    Item("rl_step_fp32_sym", 2.7,
         "sym's fp32 full fine-tuning peak after the cost-model work (first run 44.9 GB vs "
         "padded 33.5; projected 24.65 vs 21.77)",
         (*_RL, "--preset", "gpu", "--systems", "sym"),
         (*_RL_DRY, "--systems", "sym"),
         projection="bench/results/projection/rl_step_gpu_h100.json"),
    Item("rl_step_fp32_padded", 2.0, "padded's fp32 peak in the same tree as sym's",
         (*_RL, "--preset", "gpu", "--systems", "padded"),
         (*_RL_DRY, "--systems", "padded"),
         projection="bench/results/projection/rl_step_gpu_h100.json"),
)


def _result(item: Item, path: Path) -> Any:
    """The item's result file, parsed (pytest: the JUnit counts); None where none was written."""
    if not path.exists() or path.stat().st_size == 0:
        return None
    if item.junit:
        suite = ET.parse(path).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        return {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    return json.loads(path.read_text())


def _git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              cwd=child.ROOT, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None  # the device gets the tree without .git: pass --commit


def run_item(item: Item, args: argparse.Namespace, timeout: float) -> dict[str, Any]:
    """Run one item; its row for ``plan.jsonl`` (status, seconds, result, log tail)."""
    out = Path(args.out)
    res_path = out / f"{item.name}.{'xml' if item.junit else 'json'}"
    argv = [a.replace("{out}", str(res_path)) for a in (item.dry if args.dry_run else item.gpu)]
    t0 = time.perf_counter()
    env = {"PYTHONUNBUFFERED": "1", **dict(item.env)}  # XLA:CPU parses (and refuses) GPU flags
    res = child.run(child.module(*argv), timeout=timeout, env=env)
    seconds = time.perf_counter() - t0
    with open(out / "plan.log", "a") as f:
        f.write(f"===== {item.name}: {' '.join(argv)} ({res.status}, {seconds:.0f} s)\n"
                f"{res.stdout}\n{res.stderr}\n")
    result = _result(item, res_path)
    status = res.status
    if status == "ok" and result is None:  # ran, wrote nothing: an experiment that said why not
        status = "skipped" if item.needs_gpu else "error"
    if item.junit and result and (result["failures"] or result["errors"]):
        status = "failed"
    res_path.unlink(missing_ok=True)  # its content is in the row: the device returns 8 files
    return {"status": status, "seconds": round(seconds, 1), "result": result,
            "tail": child.tail(res.stderr or res.stdout, 12), "command": " ".join(argv),
            "env": dict(item.env)}


def _environment(args: argparse.Namespace) -> dict[str, Any]:
    from jaxrl_sym.report import run_metadata

    meta = run_metadata()
    return {**{k: v for k, v in meta.items() if k != "command"},
            "plan_command": presets.command("gpu_plan", args.argv),
            "commit": args.commit or _git_commit(), "dry_run": args.dry_run}


def run_plan(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every item in order within ``--budget-min``; one ``plan.jsonl`` line each as it ends."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = _environment(args)
    deadline = time.monotonic() + args.budget_min * 60
    wanted = presets.csv(args.only) if args.only else [i.name for i in PLAN]
    rows = []
    for item in (i for i in PLAN if i.name in wanted):
        left = deadline - time.monotonic()
        if not args.dry_run and left < item.minutes * 60:
            row = {"status": "skipped", "seconds": 0.0, "result": None, "command": "",
                   "tail": f"budget: {left / 60:.1f} min left, expected {item.minutes} min"}
        else:
            row = run_item(item, args, timeout=max(left, 30.0))
        row = {"item": item.name, "why": item.why, "expected_minutes": item.minutes, **row,
               **env}
        with open(out / "plan.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        print(f"{item.name}: {row['status']} in {row['seconds']:.0f} s", flush=True)
        rows.append(row)
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = presets.parser("gpu_plan", __doc__, PRESETS)
    p.add_argument("--budget-min", type=presets.finite_at_least(0), default=None,
                   help="minutes for the whole plan; items that no longer fit are skipped")
    p.add_argument("--dry-run", action="store_const", const=True, default=None,
                   help="every item at tiny shapes on this backend (CI's check of the plan)")
    p.add_argument("--out", default=None,
                   help="folder for plan.jsonl and plan.log (on the device tool: $OUT)")
    p.add_argument("--commit", default=None, help="git commit of the tree (the device has no .git)")
    p.add_argument("--only", default=None, help="comma-separated item names")
    p.add_argument("--report", default=None, metavar="PLAN_JSONL",
                   help="run nothing: write plan.md beside this plan.jsonl (projections beside)")
    args = presets.parse(p, PRESETS, argv)
    if args.report:
        return args
    unknown = set(presets.csv(args.only or "")) - {i.name for i in PLAN}
    if unknown:
        p.error(f"--only {', '.join(sorted(unknown))}: unknown; items are "
                f"{', '.join(i.name for i in PLAN)}")
    args.argv = argv
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv if argv is not None else sys.argv[1:])
    if args.report:
        from bench.lib import gpu_report

        plan = Path(args.report)
        if not plan.is_file():
            raise InputError(f"--report {plan}: no such file; give a plan.jsonl a plan wrote")
        print(f"wrote {gpu_report.write(plan, {i.name: i.projection for i in PLAN})}")
        return 0
    rows = run_plan(args)
    bad = [r["item"] for r in rows if r["status"] not in ("ok", "skipped")]
    where = os.path.join(args.out, "plan.jsonl")
    print(f"plan: {len(rows) - len(bad)} of {len(rows)} ok or skipped; results in {where}"
          + (f"; not ok: {', '.join(bad)}" if bad else ""))
    return 1 if bad else 0
