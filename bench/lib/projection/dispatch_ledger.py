"""The dispatch ledger of one generation request: every program a system runs for it, compiled
for a GPU on this machine (:mod:`bench.lib.projection.xla_gpu`), and what running them costs the
host — launches, CUDA-graph capture, host round-trips — from XLA's own thunk sequence
(:mod:`bench.lib.projection.thunks`), beside the bytes XLA's cost analysis says each step moves.

Why: on the H100 (2026-11-26b) sym's generation took 3.71 s where its bytes need 0.46 s. A
decode tile's loop test was a host round-trip per token and each step launched its kernels one
by one — or so the hypothesis went. This counts both without a GPU, for the programs the
runtime would run (sym: its policy's dispatches over the request, :func:`sym_ledger`; padded:
its one program), so a change to the tile program is measured here before a GPU runs it.

The time model (:func:`price`): ``read / bandwidth + kernels × t_kernel + launches ×
t_launch + syncs × t_sync``. ``read`` is what each step reads in the system's layout — the
weights and every store or cache at its allocated size (XLA's masked attention reads every
slot; XLA's cost analysis instead counts a store's in-place update as a copy of it, 2.5 s of
"bytes" for sym's generation at the GPU preset and 6.1 s for padded's, which measured 4.25 s).
``t_kernel`` is what one GPU operation costs beyond its bytes (inside a CUDA graph too: a decode
step is ~500 small kernels), ``t_launch`` a launch from the host, ``t_sync`` a host round-trip;
the three are fitted on the committed H100 generation seconds (:func:`fit`), each row priced
with the programs as they ran then (one loop test per step).
"""

from __future__ import annotations

import dataclasses
import re
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from bench.lib.projection import thunks, xla_gpu

COMMAND_BUFFERS = {
    "default": None,  # XLA:GPU's default command-buffer types (no WHILE, no CONDITIONAL)
    "while": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,WHILE,CONDITIONAL",
}
"""``xla_gpu_enable_command_buffer`` settings the ledger compiles under (FIELD_NOTES §12)."""


KERNELS = ("decode_attention",)
"""The runtime's own kernels by the name XLA gives their thunks (the pallas backend's decode
attention, :mod:`jaxrl_sym.backends.pallas_ops`): each program lists where they run."""


class Recorder:
    """A ledger's ``compiler(build)``: each program compiled for ``target`` with XLA's dumps
    (its thunk tree kept, in compile order) and for this machine (its cost analysis).
    ``check``: compile decode tiles testing their rows every ``check`` steps instead of the
    plan's (1: the tile program as the committed GPU runs measured it, one test per step)."""

    def __init__(self, target: str, command_buffers: str | None, check: int | None = None
                 ) -> None:
        self.target, self.check = target, check
        self.trees: list[tuple[thunks.Thunk, ...]] = []
        self.seconds: list[float] = []  # each compile for the target (this CPU's seconds)
        self.options = {} if command_buffers is None else {
            "xla_gpu_enable_command_buffer": command_buffers}

    def __call__(self, build: Any) -> Any:
        kwargs = dict(build.kwargs)
        if self.check is not None and "check" in kwargs:
            kwargs["check"] = self.check
            build = dataclasses.replace(build, kwargs=tuple(kwargs.items()))
        with tempfile.TemporaryDirectory(prefix="dispatch_") as dump:
            t0 = time.perf_counter()
            gpu = xla_gpu.compile_for(build.jitted, *build.args, target=self.target,
                                          kwargs=kwargs, dump_to=dump, options=self.options)
            self.seconds.append(time.perf_counter() - t0)
            self.trees.append(thunks.load(dump)[0])
        return xla_gpu.Analysed(gpu, build())


@dataclasses.dataclass(frozen=True)
class ProgramCount:
    """One program as a generation runs it: ``calls`` dispatches, ``iterations`` of its
    untested loop in all (a decode tile's checks; 0 for a loop-free program), what it moves and
    what running it costs (``counts``, the per-dispatch read-back included)."""

    stage: str
    name: str
    calls: int
    steps: int
    iterations: float
    bytes: float  # XLA's cost analysis (per iteration) times the steps
    read: float  # what the steps read in the system's layout (see the module docstring)
    counts: thunks.Counts
    loops: list[tuple[int, int | None, bool]]
    custom_calls: list[tuple[str, bool]]
    kernels: list[tuple[str, bool]]  # the runtime's own kernels (:data:`KERNELS`), captured?
    program: int = 0  # which compiled program it runs (the recorder's compile order)
    step: list[str] = dataclasses.field(default_factory=list)  # one decode step's kernels


def program_count(run: Any, tree: tuple[thunks.Thunk, ...], check: int | None,
                  read_per_step: float | None = None) -> ProgramCount:
    """``run`` (a :class:`~jaxrl_sym.runtime.memory.ledger_generation.ProgramRun`) priced on its
    thunk tree: a decode tile runs ``steps / check`` tested iterations over its calls.
    ``read_per_step``: what one step reads in the layout (None: XLA's cost analysis)."""
    fixed = thunks.count(tree, 0.0)
    per = thunks.count(tree, 1.0) + fixed * -1.0
    iters = run.steps / check if check and per.kernels else 0.0
    reads = run.calls if run.stage in ("prefill", "decode", "refill") else 0
    counts = fixed * run.calls + per * iters + thunks.Counts(syncs=reads)
    counts = counts + thunks.Counts(launches=run.calls)  # the executable's own dispatch
    cost = run.size.bytes_accessed * run.steps
    read = cost if read_per_step is None else read_per_step * run.steps
    return ProgramCount(run.stage, run.what, run.calls, run.steps, iters, cost, read, counts,
                        thunks.loops(tree), thunks.custom_calls(tree),
                        thunks.kernels_named(tree, KERNELS),
                        step=thunks.step_kernels(tree) if run.stage == "decode" else [])


def ledger_counts(runs: Sequence[Any], sizes: dict[tuple, Any], trees: list[Any],
                  check: int | None, read: Callable[[tuple], float | None]
                  ) -> list[ProgramCount]:
    """Each run of a generation ledger with its program's thunk tree: ``sizes`` (the ledger's
    compiled sizes by cache key, in compile order) and ``trees`` (the recorder's, same order);
    ``read(key)``: what one step of that program reads in the layout (None: cost analysis)."""
    by_size = {id(size): (i, key, tree) for i, ((key, size), tree) in
               enumerate(zip(sizes.items(), trees, strict=True))}
    out = []
    for r in runs:
        i, key, tree = by_size[id(r.size)]
        out.append(dataclasses.replace(program_count(r, tree, check, read(key)), program=i))
    return out


def totals(progs: Sequence[ProgramCount], decode_steps: int, tokens: int) -> dict[str, Any]:
    """The request's totals and the per-step figures the issue asks for."""
    total = thunks.Counts()
    for p in progs:
        total = total + p.counts
    tiles = [p for p in progs if p.stage == "decode"]
    tile = thunks.Counts()
    for p in tiles:
        tile = tile + p.counts
    return {"launches": total.launches, "kernels": total.kernels, "syncs": total.syncs,
            "bytes": sum(p.bytes for p in progs), "read": sum(p.read for p in progs),
            "decode_steps": decode_steps,
            "tokens": tokens, "dispatches": sum(p.calls for p in progs),
            "launches_per_step": tile.launches / max(1, decode_steps),
            "kernels_per_step": tile.kernels / max(1, decode_steps),
            "host_syncs_per_token": tile.syncs / max(1, decode_steps),
            "host_syncs_per_sample_token": tile.syncs / max(1, tokens),
            "captured": tile.captured / tile.kernels if tile.kernels else 0.0,
            "step_kernels": step_kinds(tiles)}


def step_kinds(tiles: Sequence[ProgramCount]) -> dict[str, int]:
    """One decode step's kernels by fusion kind (XLA's fusion name without its numbering:
    ``gemm_fusion_dot``, ``input_reduce_fusion``, ``decode_attention``, …), most first, from
    the first decode program with a step loop: where a step's ~5.5 µs kernels come from."""
    step = next((p.step for p in tiles if p.step), [])
    kinds = Counter(re.sub(r"(_\d+)+$", "", n) for n in step)
    return dict(kinds.most_common())


TERMS = ("kernels", "launches", "syncs")
"""The counts the time model prices beyond the bytes (``t_kernel``, ``t_launch``, ``t_sync``)."""


def first_call(progs: Sequence[ProgramCount], compile_s: Sequence[float],
               run_s: Sequence[float], threads: int) -> float:
    """Wall seconds of a system's first generation call, its compiles included: each program
    compiles on the host thread at its first use, except sym's decode programs when it compiles
    them ahead (``EngineOptions.compile_threads`` = ``threads``): those are queued when the call
    starts, in the order of first use, each to the background thread that frees first, and a
    dispatch waits only for its own. ``compile_s``: each compiled program's seconds (the
    recorder's order); ``run_s``: each entry of ``progs``' projected seconds. Assumes a core per
    compile thread beside the host's (an H100 host has 16 or more)."""
    lanes, ready = [0.0] * threads, {}
    for p in progs:
        if threads and p.stage == "decode" and p.program not in ready:
            k = min(range(threads), key=lanes.__getitem__)
            lanes[k] += compile_s[p.program]
            ready[p.program] = lanes[k]
    t = 0.0
    for p, s in zip(progs, run_s, strict=True):
        if p.program in ready:
            t = max(t, ready[p.program])
        else:
            t += compile_s[p.program]
            ready[p.program] = 0.0  # compiled here, now: later uses wait for nothing
        t += s
    return t


def run_seconds(p: ProgramCount, bandwidth: float, per: dict[str, float]) -> float:
    """One entry's projected seconds (:func:`price` of its own counts)."""
    return price({"read": p.read, **{t: getattr(p.counts, t) for t in TERMS}}, bandwidth, per)


def price(row: dict[str, Any], bandwidth: float, per: dict[str, float]) -> float:
    """Seconds: what the steps read over bandwidth, plus each kernel, host launch and
    round-trip at its fitted cost ``per[term]``."""
    return row["read"] / bandwidth + sum(row[t] * per[t] for t in TERMS)


def fit(rows: Sequence[tuple[dict[str, Any], float]], bandwidth: float) -> dict[str, float]:
    """Each term's cost by non-negative least squares over (counts, measured seconds): what
    the bytes leave unexplained, split between kernels, launches and round-trips; relative
    errors weigh equally (each row divided by its seconds)."""
    from scipy.optimize import nnls

    a = np.array([[r[t] for t in TERMS] for r, _ in rows], float)
    b = np.array([s - r["read"] / bandwidth for r, s in rows], float)
    w = np.array([1.0 / s for _, s in rows])
    scale = a.max(axis=0)
    scale[scale == 0] = 1.0
    x, _ = nnls(a / scale * w[:, None], b * w)
    return {t: float(v / c) for t, v, c in zip(TERMS, x, scale, strict=True)}


def generation_rows(model: Any, state: Any, prompts: list[np.ndarray], limits: list[int],
                    systems: Sequence[str], engine: dict[str, Any], target: str,
                    command_buffers: str | None, check: int | None,
                    progress: Callable[[str], None] = print) -> dict[str, Any]:
    """Each system's dispatch ledger for generating ``limits`` tokens after ``prompts``."""
    tokens = int(sum(limits))
    out: dict[str, Any] = {}
    for name in systems:
        walk = WALKS[name]
        rec = Recorder(target, command_buffers, check if walk.tiled else None)
        progs, steps, ran = walk.programs(model, state, prompts, limits, engine, rec, check)
        out[name] = {**totals(progs, steps, tokens), "cold_programs": len(ran),
                     "compile_s": sum(rec.seconds[i] for i in ran),
                     "compile_s_each": list(rec.seconds), "compiles_ahead": walk.engine,
                     "programs": [{**dataclasses.asdict(p), "counts": dataclasses.asdict(
                         p.counts)} for p in progs]}
        progress(f"{name}: {len(rec.trees)} programs compiled for {target}")
    return out


def _sym_programs(model: Any, state: Any, prompts: list[np.ndarray], limits: list[int],
                  engine: dict[str, Any], rec: Recorder, check: int | None
                  ) -> tuple[list[ProgramCount], int, list[int]]:
    """sym's programs over its policy's dispatches (:func:`sym_ledger`); a decode step reads
    the weights and every store at the group's (rows, capacity) — the XLA backend's masked
    attention reads every slot. Returns (programs, decode steps, the compiles it runs)."""
    import jax

    from jaxrl_sym.generation import GenerationConfig
    from jaxrl_sym.runtime.memory.ledger import tree_nbytes
    from jaxrl_sym.runtime.memory.ledger_generation import sym_ledger
    from jaxrl_sym.runtime.options import EngineOptions
    from jaxrl_sym.runtime.plan import compile_generation
    from jaxrl_sym.tracer.trace import trace_model

    plan = compile_generation(trace_model(model)[0], EngineOptions(**engine), platform="gpu")
    leaves = jax.tree_util.tree_leaves(state)
    weights = tree_nbytes(leaves)
    gcfg = GenerationConfig(max_new_tokens=tuple(int(n) for n in limits))
    sizes: dict[tuple, Any] = {}
    led = sym_ledger(plan, leaves, prompts, gcfg, sizes=sizes, compiler=rec)

    def read(key: tuple) -> float | None:
        if key[0] not in ("decode_tile", "decode"):
            return None
        rows, cap = key[1][0], max(c for _, c in key[2])
        return weights + tree_nbytes(jax.eval_shape(lambda: plan.builder.init_stores(rows, cap)))

    runs = led.runs
    opts = plan.options
    if opts.refill and opts.microbatch_rows is not None and len(prompts) > opts.microbatch_rows:
        runs = _refill_runs(plan, runs, prompts, limits, gcfg)
    progs = ledger_counts(runs, sizes, rec.trees, check or plan.tiling.check, read)
    steps = sum(p.steps for p in progs if p.stage == "decode")
    return progs, steps, list(range(len(rec.trees)))


def _refill_runs(plan: Any, runs: Sequence[Any], prompts: list[np.ndarray], limits: list[int],
                 gcfg: Any) -> list[Any]:
    """With refill the memory ledger walks each distinct program once (its representative
    moments); how often each runs is the refill replay's (:func:`jaxrl_sym.runtime.refill.
    replay`, the engine's own policy over the request, a GRPO group's samples sharing their
    prompt). Calls of a kind are shared evenly among its programs (one each for a GRPO step)."""
    from jaxrl_sym.runtime import refill

    opts, seen = plan.options, {}
    ids = [seen.setdefault(p.tobytes(), len(seen)) for p in prompts]
    run = refill.replay([len(p) for p in prompts], limits, rows=opts.microbatch_rows,
                        refill=opts.refill_policy(), compaction=plan.compaction,
                        tiling=plan.group_tiling(gcfg),
                        min_capacity=opts.min_capacity, prompt_ids=ids)
    total = {"prompt_cache": (run.prefill_dispatches, run.prefill_dispatches),
             "refill": (run.refill_dispatches, run.refill_dispatches),
             "decode": (run.decode_dispatches, run.decode_steps)}
    kind = lambda r: "decode" if r.stage == "decode" else r.what.split("[")[0]
    share = {k: sum(kind(r) == k for r in runs) for k in total}
    return [dataclasses.replace(r, calls=total[kind(r)][0] // share[kind(r)],
                                steps=total[kind(r)][1] // share[kind(r)]) for r in runs]


def _padded_programs(model: Any, state: Any, prompts: list[np.ndarray], limits: list[int],
                     engine: dict[str, Any], rec: Recorder, check: int | None
                     ) -> tuple[list[ProgramCount], int, list[int]]:
    """padded's one program (prefill and a scan of decode steps, no loop it tests); each step
    reads the weights and every row's MAX_LEN cache. Its ledger compiles a second program
    without the decode loop (for the per-step cost), which padded never runs."""
    from jaxrl_sym.baselines.padded import left_pad_prompts
    from jaxrl_sym.baselines.padded_ledger import padded_ledger
    from jaxrl_sym.generation import GenerationConfig
    from jaxrl_sym.runtime.memory.estimate import attend_calls
    from jaxrl_sym.runtime.memory.ledger import tree_nbytes

    gcfg = GenerationConfig(max_new_tokens=tuple(int(n) for n in limits))
    led = padded_ledger(model, prompts, gcfg, compiler=rec)
    batch = left_pad_prompts(model, prompts, gcfg)
    calls, _ = attend_calls(model)
    size = lambda dt: np.dtype(dt).itemsize
    per_slot = sum(c.hkv * (c.d * size(c.k_dtype) + c.dv * size(c.v_dtype)) for c in calls)
    per_step = tree_nbytes(state) + batch.batch * (batch.prompt_len + batch.steps) * per_slot
    whole = dataclasses.replace(led.runs[1], stage="decode", calls=1, steps=1)
    prog = program_count(whole, rec.trees[0], None, per_step * (batch.steps - 1))
    cost = sum(r.size.bytes_accessed * r.steps for r in led.runs)
    return ([dataclasses.replace(prog, name=led.runs[0].what.replace(" prefill", ""),
                                 steps=batch.steps - 1, bytes=cost)], batch.steps - 1, [0])


@dataclasses.dataclass(frozen=True)
class Walk:
    """How the dispatch ledger walks one system's generation: ``programs`` (its compiled
    programs over the request), ``tiled`` (its decode tiles take ``--check``), ``engine`` (it
    takes EngineOptions), ``overlapped_reference`` (its RL step scores the reference while it
    generates, inside the measured generation seconds)."""

    programs: Callable[..., tuple[list[ProgramCount], int, list[int]]]
    tiled: bool = False
    engine: bool = False
    overlapped_reference: bool = False


WALKS: dict[str, Walk] = {
    "sym": Walk(_sym_programs, tiled=True, engine=True, overlapped_reference=True),
    "padded": Walk(_padded_programs),
}
"""The systems the dispatch ledger walks, by registered name."""
