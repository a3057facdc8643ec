"""The benchmark suite's jobs: plan them from a preset, run each in its own process, keep every
result as a JSONL row (resumable), render tables and plots (``python -m bench suite``).

Scenarios (each configuration × system is one child process,
``python -m bench.lib.suite.suite_child``):

* ``decode`` — the paper's Fig. 3 and beyond: full, window, block, linear and mixed attention at
  N new tokens per row (every row runs to N), systems sym (each backend available), padded XLA,
  per-shape JAX (small N only: it compiles once per length).
* ``realistic`` — :func:`jaxrl_sym.workloads.realistic`: prompts uniform, responses log-normal
  with a heavy tail, capped; each row ends at its sampled length, as if EOS had been sampled
  there (random weights never pick EOS on purpose).
* ``growing`` — :func:`jaxrl_sym.workloads.growing_runs`: the median response length rising 10×
  over a sequence of runs (DeepSeek-R1 reports mean response length rising ~10× over RL
  training).
* ``rlft`` — one GRPO step, sym vs padded: ``python -m bench rlft_step`` as a child.
* ``trace`` — length profiles as data (:mod:`jaxrl_sym.workloads`): skewed per task (math, code,
  chat), growing (median 10× over the steps) and, with ``--trace FILE.jsonl``, a user trace;
  each profile is replayed step after step by every system in one process, which reports its
  idle fraction and useful tokens/s; plotted in ``trace_idle.png``.

A configuration already in the JSONL with status ``ok`` or ``oom`` is skipped unless ``force``;
one that fails (``error``, ``timeout``) is retried. A child that runs out of memory becomes a row
with ``status: "oom"``, never a crash of the suite (:mod:`bench.lib.child`). Before anything runs,
every configuration's memory can be estimated from shapes
(``jaxrl_sym.runtime.memory.estimate``); one
estimated above the limit is recorded as ``status: "skipped: estimated X GB > limit Y GB"``
without being started. Every row carries device, versions, git commit, date and command.
"""

from __future__ import annotations

import datetime
import json
import re
import sys
import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench.lib import child
from bench.lib.record import git_commit
from bench.lib.requests import prompt_tokens
from bench.lib.roles import rank
from bench.lib.suite import suite_child
from bench.lib.suite.suite_padding import layers_for, work_for
from bench.lib.suite.suite_report import render_markdown, render_summary
from bench.lib.suite.suite_trace import run_trace_job, trace_configs
from jaxrl_sym import systems as registry
from jaxrl_sym.workloads import growing_runs, realistic, uniform

DONE = ("ok", "oom")  # statuses that count as finished (not re-run without --force)
RLFT = "rlft"  # the RL-step job's stand-in system: one child compares the trainable systems
RLFT_SYSTEMS = (registry.REFERENCE, registry.BASELINE)
Command = Callable[[str, str], list[str]]  # (spec path, out path) -> a child's command

# --------------------------------------------------------------------------- presets

# --------------------------------------------------------------------------- jobs


@dataclass
class Job:
    """One configuration run by one system. ``config`` (without the system) names the request."""

    config: dict[str, Any]
    system: str
    prompt_lens: list[int] = field(default_factory=list)
    limits: list[int] = field(default_factory=list)
    steps: list[tuple[list[int], list[int]]] = field(default_factory=list)  # trace replays

    @property
    def key(self) -> str:
        return row_key(self.config, self.system)

    def label(self) -> str:
        c = self.config
        what = {"decode": lambda: f"{c['attention']} N={c['tokens']}",
                "realistic": lambda: f"median {c['median']}",
                "growing": lambda: f"run {c['run']} median {c['median']}",
                "rlft": lambda: f"{c['prompts']}x{c['group']}",
                "trace": lambda: f"{c['profile']} ({c['steps']} steps)"}[c["scenario"]]()
        return f"{c['scenario']} {what} {self.system}"


def row_key(config: dict[str, Any], system: str) -> str:
    """The identity of a result row: the exact configuration plus the system."""
    return json.dumps({**config, "system": system}, sort_keys=True)


def limited(p: dict[str, Any]) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
    """Systems the preset runs at some decode points only, with those (lengths, kinds): the
    per-shape baseline compiles once per length, so it runs at ``pershape_tokens`` of
    ``pershape_kinds`` and in no other scenario."""
    return {"pershape": (tuple(p["pershape_tokens"]), tuple(p["pershape_kinds"]))}


def runs_pattern(system: str, kind: str) -> bool:
    """Whether ``system`` runs attention ``kind`` (Tunix's Qwen2: full attention only)."""
    patterns = registry.get(system).capabilities.patterns
    return patterns is None or kind in patterns


def _decode_jobs(p: dict[str, Any], systems: Sequence[str], seed: int) -> list[Job]:
    jobs: list[Job] = []
    only = limited(p)
    for kind in p["kinds"]:
        extra = {n for toks, kinds in only.values() if kind in kinds for n in toks}
        for n in sorted({*p["tokens"], *extra}):
            cfg = {"preset": p["preset"], "seed": seed, "scenario": "decode", "attention": kind,
                   "tokens": n, "batch": p["batch"], "prompt_len": list(p["prompt_len"]),
                   "window": p["window"], "block": p["block"]}
            lens = list(uniform(np.random.default_rng(seed), p["batch"], *p["prompt_len"]))
            names = [s for s in systems if s not in only and runs_pattern(s, kind)]
            names += [s for s, (toks, kinds) in only.items()
                      if s in systems and kind in kinds and n in toks]
            jobs += [Job(cfg, s, lens, [n] * p["batch"]) for s in names]
    return jobs


def plan(p: dict[str, Any], *, systems: Sequence[str], scenarios: Sequence[str],
         seed: int = 0, trace: str | None = None) -> list[Job]:
    """Every job of preset ``p`` (deterministic: prompts and limits come from ``seed``)."""
    for s in systems:
        registry.get(s)  # an unknown name is an InputError listing the systems
    jobs = _decode_jobs(p, systems, seed) if "decode" in scenarios else []
    base = {"preset": p["preset"], "seed": seed}
    others = [s for s in systems if s not in limited(p)]
    if "realistic" in scenarios:
        r = p["realistic"]
        cfg = {**base, "scenario": "realistic", "attention": "full", "window": p["window"],
               "block": p["block"], "batch": r["batch"], "prompt_len": list(r["prompt"]),
               "median": r["median"], "cap": r["cap"], "sigma": r["sigma"]}
        step = realistic(**r, seed=seed)
        jobs += [Job(cfg, s, list(step.prompt_lens), list(step.response_lens)) for s in others]
    if "growing" in scenarios:
        g = p["growing"]
        for k, (median, step) in enumerate(growing_runs(**g, seed=seed)):
            cfg = {**base, "scenario": "growing", "attention": "full", "window": p["window"],
                   "block": p["block"], "batch": g["batch"], "prompt_len": list(g["prompt"]),
                   "run": k, "median": median, "cap": g["cap"], "sigma": g["sigma"]}
            jobs += [Job(cfg, s, list(step.prompt_lens), list(step.response_lens))
                     for s in others]
    if "rlft" in scenarios:
        cfg = {"scenario": "rlft", "seed": seed, **p["rlft"]}
        jobs.append(Job(cfg, RLFT))
    if "trace" in scenarios:
        jobs += [Job(cfg, s, steps=steps)
                 for cfg, steps in trace_configs(p, seed=seed, trace=trace) for s in others]
    # Keep the configurations in plan order; within one, the baseline first.
    first: dict[str, int] = {}
    for i, j in enumerate(jobs):
        first.setdefault(json.dumps(j.config, sort_keys=True), i)
    return sorted(jobs, key=lambda j: (first[json.dumps(j.config, sort_keys=True)],
                                       rank(j.system)))


# --------------------------------------------------------------------------- children


def child_command(spec_path: str, out_path: str) -> list[str]:
    """The command that runs one system on one request (tests pass a stand-in instead)."""
    return child.module("bench.lib.suite.suite_child", spec_path, out_path)


def rlft_command(cfg: dict[str, Any], out_path: str) -> list[str]:
    """``python -m bench rlft_step`` with the preset's sizes (it runs each system in its own
    process)."""
    preset = "gpu" if cfg.get("preset") == "gpu" else "full"  # the model: Qwen2.5's or shrunk
    return child.experiment("rlft_step", "--preset", preset,
                            "--out", out_path, "--scale", str(cfg["scale"]),
                            "--prompts", str(cfg["prompts"]), "--group", str(cfg["group"]),
                            "--steps", str(cfg["steps"]), "--seed", str(cfg["seed"]))


def run_process(cmd: list[str], timeout: float) -> tuple[str, str, int]:
    """Run a child; (status, stderr tail, returncode), ``-1`` on a timeout."""
    res = child.run(cmd, timeout=timeout)
    return res.status, "" if res.ok else res.tail(), res.returncode


# --------------------------------------------------------------------------- rows


def load_rows(path: Path) -> dict[str, dict[str, Any]]:
    """Rows of a JSONL file by key (a later row replaces an earlier one of the same key)."""
    rows: dict[str, dict[str, Any]] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                rows[row["key"]] = row
    return rows


def _append(path: Path, row: dict[str, Any]) -> None:
    with path.open("a") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()


def _check(sym: dict[str, Any], padded: dict[str, Any] | None,
           arrays: dict[str, dict[str, np.ndarray]]) -> dict[str, Any] | None:
    """Tokens (digest) and, where both runs' arrays are at hand, max |log-prob difference|."""
    if padded is None or padded.get("status") != "ok" or sym.get("status") != "ok":
        return None
    out: dict[str, Any] = {"tokens_equal": sym["tokens_sha"] == padded["tokens_sha"]}
    a, b = arrays.get(sym["key"]), arrays.get(padded["key"])
    if a is not None and b is not None:
        diffs = [float(np.max(np.abs(a[k] - b[k]))) for k in a
                 if k.startswith("lp") and k in b and a[k].shape == b[k].shape and a[k].size]
        out["max_abs_logprob_diff"] = max(diffs, default=0.0)
    return out


def _in_process(spec: dict[str, Any]) -> tuple[str, str, dict[str, Any], dict[str, Any]]:
    """Run a child's work in this process (notebooks at small sizes: no process start-up, but
    peak RSS is then the notebook's, not the system's)."""
    try:
        metrics, arrs = suite_child.run(spec)
    except Exception as e:  # a failed configuration is a row, as with a child process
        text = f"{type(e).__name__}: {e}"
        return child.classify_failure(1, text), child.tail(text), {}, {}
    return "ok", "", metrics, arrs


def run_job(job: Job, tmp: Path, timeout: float, arrays: dict[str, dict[str, np.ndarray]],
            *, in_process: bool = False, command: Command = child_command
            ) -> list[dict[str, Any]]:
    """Run one job; returns its result rows (no metadata yet). The RL step yields one row per
    system it compares."""
    if job.system == RLFT:
        return _run_rlft(job, tmp, timeout)
    if job.config["scenario"] == "trace":
        spec = {**job.config, "system": job.system, "steps": job.steps}
        row = {**job.config, "system": job.system, "key": job.key}
        return [run_trace_job(spec, row, tmp, lambda s, o: run_process(command(s, o), timeout))]
    spec = {**job.config, "system": job.system, "prompt_lens": job.prompt_lens,
            "limits": job.limits, "warm": True}
    row: dict[str, Any] = {**job.config, "system": job.system, "key": job.key}
    if in_process:
        status, err, metrics, arrs = _in_process(spec)
        rc = 0 if status == "ok" else 1
        row.update(metrics)
        if arrs:
            arrays[job.key] = arrs
    else:
        spec_path, out = tmp / "spec.json", tmp / "out.json"
        out.unlink(missing_ok=True)
        spec_path.write_text(json.dumps(spec))
        status, err, rc = run_process(command(str(spec_path), str(out)), timeout)
        if status == "ok":
            row.update(json.loads(out.read_text()))
            npz = Path(str(out) + ".npz")
            if npz.exists():
                with np.load(npz) as z:
                    arrays[job.key] = dict(z)
    row["status"] = status
    if status != "ok":
        row.update(error=err, returncode=rc)
    from jaxrl_sym.cli import DECODE_CPU
    from jaxrl_sym.models.lm import preset as lm_preset

    cfg = job.config
    n_layers = (DECODE_CPU["n_layers"] if cfg["preset"] == "decode-cpu"
                else lm_preset(cfg["preset"]).n_layers)
    layers = layers_for(cfg["attention"], n_layers, cfg["window"], cfg["block"])
    row.update(work_for(job.system, job.prompt_lens, job.limits, layers).fractions())
    row["max_limit"] = max(job.limits)
    row["useful_tokens"] = int(sum(job.limits))
    return [row]


def _run_rlft(job: Job, tmp: Path, timeout: float) -> list[dict[str, Any]]:
    out = tmp / "rlft.json"
    out.unlink(missing_ok=True)
    status, err, rc = run_process(rlft_command(job.config, str(out)), timeout)
    report = json.loads(out.read_text()) if out.exists() else {"systems": {}}
    rows = []
    for system in RLFT_SYSTEMS:
        r = report["systems"].get(system)
        row: dict[str, Any] = {**job.config, "system": system, "key": row_key(job.config, system)}
        if status == "ok" and r is not None and "error" not in r:
            row.update(status="ok", **r, ratios=report.get("ratios", {}))
        else:
            text = err or str((r or {}).get("error", ""))
            row.update(status=status if status != "ok" else child.classify_failure(1, text),
                       error=text, returncode=rc)
        rows.append(row)
    return rows


def estimate_jobs(jobs: Sequence[Job], limit: int | None) -> dict[str, dict[str, Any]]:
    """Each generation job's memory estimate from shapes, keyed by job key: ``total``,
    ``limit`` and ``refused`` (a message, or None when it fits).

    Why: a configuration that cannot fit used to start, compile and die with
    ``RESOURCE_EXHAUSTED`` minutes later. One child process estimates every job (JAX and each
    model loaded once, on the host CPU, so this process never holds a device context); every
    prompt is taken at the job's longest prompt (the worst case). RL-step jobs are not
    estimated. Empty, with a warning, when the estimate itself fails: the jobs then run.
    """
    todo = [j for j in jobs if j.system != RLFT  # peers have no shape estimate
            and not registry.get(j.system).capabilities.peer
            and j.config["scenario"] != "trace"]
    specs = [{**j.config, "model": None, "systems": [j.system], "memory_limit": limit,
              "batch": len(j.prompt_lens), "prompt_len": [max(j.prompt_lens)] * 2,
              "tokens": max(j.limits), "return_logits": False} for j in todo]
    if not specs:
        return {}
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out = Path(tmp) / "estimate.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(specs))
        status, err, _ = run_process(child.module("jaxrl_sym.cli", "_estimate", str(spec_path),
                                                  str(out)), timeout=600)
        if status != "ok":
            print(f"warning: memory estimate failed ({err}); running without the check",
                  file=sys.stderr)
            return {}
        results = json.loads(out.read_text())
    return {j.key: {"total": r["systems"][j.system]["estimate"]["total"], "limit": r["limit"],
                    "refused": r["systems"][j.system]["refused"]}
            for j, r in zip(todo, results, strict=True)}


def skipped_row(job: Job, est: dict[str, Any]) -> dict[str, Any]:
    """The result row of a job refused by the memory check (not run; retried on resume)."""
    return {**job.config, "system": job.system, "key": job.key,
            "status": f"skipped: estimated {est['total'] / 1e9:.3g} GB > limit "
                      f"{est['limit'] / 1e9:.3g} GB",
            "estimated_bytes": est["total"], "memory_limit": est["limit"],
            "error": est["refused"]}


def pending(jobs: Iterable[Job], rows: dict[str, dict[str, Any]], force: bool) -> list[Job]:
    """Jobs still to run: not finished (ok/oom) in ``rows``, or all with ``force``."""
    out = []
    for j in jobs:
        keys = ([row_key(j.config, s) for s in RLFT_SYSTEMS] if j.system == RLFT
                else [j.key])
        if force or not all(rows.get(k, {}).get("status") in DONE for k in keys):
            out.append(j)
    return out


def run_jobs(jobs: Sequence[Job], out_dir: Path, meta: dict[str, Any], *, force: bool = False,
             timeout: float = 900, progress: bool = True, in_process: bool = False,
             echo: Callable[[str], None] | None = print, memory_check: bool = False,
             memory_limit: int | None = None, command: Command = child_command
             ) -> dict[str, dict[str, Any]]:
    """Run what is not finished yet, appending one row per result to ``results.jsonl`` as soon
    as it exists (a killed suite loses at most the configuration it was running).

    in_process: run each configuration in this process instead of a child (for notebooks at
    small sizes; peak RSS and out-of-memory isolation are then lost).
    memory_check: estimate every job first (:func:`estimate_jobs`) and record a job whose
    estimate exceeds ``memory_limit`` (default: the device's limit, else host memory) as
    ``status: "skipped: estimated X GB > limit Y GB"`` instead of running it.
    command: how a configuration's child is started (tests pass a stand-in child)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "results.jsonl"
    rows = load_rows(path)
    todo = pending(jobs, rows, force)
    if echo and len(todo) < len(jobs):
        echo(f"{len(jobs) - len(todo)} of {len(jobs)} configurations already done (--force to "
             "re-run)")
    arrays: dict[str, dict[str, np.ndarray]] = {}
    estimates = estimate_jobs(todo, memory_limit) if memory_check else {}
    bar = _progress(progress)
    with bar, tempfile.TemporaryDirectory() as tmpname:
        task = bar.add_task("suite", total=len(todo)) if bar else None
        for job in todo:
            if bar:
                bar.update(task, description=job.label())
            est = estimates.get(job.key)
            rows_out = ([skipped_row(job, est)] if est and est["refused"] else
                        run_job(job, Path(tmpname), timeout, arrays, in_process=in_process,
                                command=command))
            for row in rows_out:
                if row["system"] != registry.BASELINE:
                    padded = rows.get(row_key(job.config, registry.BASELINE))
                    check = _check(row, padded, arrays) if "tokens_sha" in row else None
                    if check is not None:
                        row["check_vs_padded"] = check
                row.update(meta)
                row["suite_started"] = meta.get("date")
                row["date"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
                rows[row["key"]] = row
                _append(path, row)
                if echo:
                    echo(_summary(row))
            if bar:
                bar.advance(task)
    return rows


class _NoBar:
    def __enter__(self) -> _NoBar:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def __bool__(self) -> bool:
        return False


def _progress(enabled: bool) -> Any:
    if not enabled:
        return _NoBar()
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("{task.description:<40}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn())


def _summary(row: dict[str, Any]) -> str:
    head = f"{row['scenario']:<9} {row.get('attention', ''):<6} " \
           f"{row.get('tokens', row.get('median', '')):>6} {row['system']:<10} {row['status']}"
    if row["status"] != "ok" or row["scenario"] == RLFT:
        return head
    if row["scenario"] == "trace":
        return (f"trace {row['profile']:<14} {row['system']:<10} ok  idle "
                f"{100 * row['idle_fraction']:.1f}%  {row['useful_tokens_per_s']:.3g} tokens/s")
    return (f"{head}  {row['s_per_token'] * 1e3:.3g} ms/token  "
            f"{row['peak_bytes'] / 2**20:.3g} MB  {row['xla_compiles']} compiles")


# --------------------------------------------------------------------------- metadata & output


def device_meta(command: str, *, in_process: bool = False) -> dict[str, Any]:
    """Device, versions, git commit, date and command (device probed in a child process, so this
    process never holds a GPU context that would sit beside the measured children)."""
    if in_process:
        meta = suite_child.probe()
    else:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "probe.json"
            res = child.run(child.module("bench.lib.suite.suite_child", "--probe", str(out)))
            if not res.ok:
                raise RuntimeError(f"device probe failed: {res.tail()}")
            meta = json.loads(out.read_text())
    meta.update(git=git_commit(), command=command,
                date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"))
    return meta


def device_dir(device: str) -> str:
    """``cpu``, or a slug of the GPU name: ``NVIDIA H100 80GB HBM3`` → ``nvidia-h100-80gb-hbm3``."""
    return re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-") or "unknown"


def write_outputs(rows: dict[str, dict[str, Any]], out_dir: Path, *, plots: bool = True) -> None:
    """results.md, ../SUITE.md and the PNGs from every row in the JSONL."""
    data = list(rows.values())
    (out_dir / "results.md").write_text(render_markdown(data))
    if plots:
        from bench.lib import plots as plotting  # matplotlib: only when plotting

        plotting.plot_all(data, out_dir)
    (out_dir.parent / "SUITE.md").write_text(render_summary(data, out_dir.name))


def suite_request(grid: dict[str, Any], scenario: str = "realistic"
                  ) -> tuple[Any, list[np.ndarray], Any, dict[str, Any]]:
    """The suite's ``scenario`` request at ``grid`` (a suite preset): model, prompts, config
    and the job's configuration, exactly as the suite's child runs it."""
    from jaxrl_sym.decode_run import build_model
    from jaxrl_sym.generation import GenerationConfig

    job = next(j for j in plan(grid, systems=("padded",), scenarios=(scenario,)))
    model, _ = build_model({**job.config, "system": "padded", "batch": 1, "prompt_len": [1, 1]})
    prompts = prompt_tokens(job.config["seed"], job.prompt_lens, model.cfg.vocab_size)
    cfg = GenerationConfig(max_new_tokens=tuple(int(x) for x in job.limits))
    return model, prompts, cfg, job.config
