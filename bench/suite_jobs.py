"""Padding-vs-symbolic benchmark suite: one command, resumable, results as JSONL + Markdown + PNG.

    .venv/bin/python bench/suite.py --quick     # CPU preset (2 cores: about 10 minutes)
    .venv/bin/python bench/suite.py             # full size, for a GPU (GPT-2-small shape)
    .venv/bin/python bench/suite.py --quick --only decode --force   # re-run a part
    .venv/bin/python bench/suite.py --quick --render                # tables and plots only

Scenarios (each configuration × system is one child process, see ``suite_child.py``):

* ``decode`` — the paper's Fig. 3 and beyond: full, window, block, linear and mixed attention at
  N new tokens per row (every row runs to N), systems sym (each backend available), padded XLA,
  per-shape JAX (small N only: it compiles once per length).
* ``realistic`` — prompts uniform in [64, 512], responses log-normal with median 275 capped at
  1024 (both divided by ``scale`` on the CPU preset); each row ends at its sampled length, as if
  EOS had been sampled there (random weights never pick EOS on purpose).
* ``growing`` — the same, with the median response length rising 10× over a sequence of runs
  (DeepSeek-R1 reports mean response length rising ~10× over RL training).
* ``rlft`` — one GRPO step, sym vs padded: ``bench/rlft_step.py`` run as a subprocess.
* ``trace`` — length profiles as data (:mod:`jaxrl_sym.workloads`): skewed per task (math, code,
  chat), growing (median 10× over the steps) and, with ``--trace FILE.jsonl``, a user trace of
  prompt/response lengths; each profile is replayed step after step by every system in one
  process, which reports its idle fraction (token positions computed on padding or on rows
  already finished / computed) and useful tokens/s; plotted in ``trace_idle.png``.

Results go to ``bench/results/<device>/suite/`` (``results.jsonl``, ``results.md``, ``*.png``) and
``bench/results/<device>/SUITE.md``. A configuration already in the JSONL with status ``ok`` or
``oom`` is skipped unless ``--force``; one that fails (``error``, ``timeout``) is retried. A child
that runs out of memory (``RESOURCE_EXHAUSTED``/out of memory in its stderr, or killed by a
signal such as the kernel's OOM killer) becomes a row with ``status: "oom"``, never a crash of
the suite. Before anything runs, every configuration's memory is estimated from shapes
(``jaxrl_sym.runtime.estimate``); one estimated above the device's limit (or ``--memory-limit``)
is recorded as ``status: "skipped: estimated X GB > limit Y GB"`` without being started
(``--no-memory-check`` runs it anyway). Every row carries device, versions, git commit, date
and command.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(HERE) not in sys.path:  # importable from tests as well as run as a script
    sys.path.insert(0, str(HERE))

DONE = ("ok", "oom")  # statuses that count as finished (not re-run without --force)
# padded first: the others are checked against it
SYSTEM_ORDER = ("padded", "sym-xla", "sym-triton", "pershape", "tunix", "tunix-defaults")
PEERS = ("tunix", "tunix-defaults")  # Tunix's Qwen2: full attention only; optional package
_OOM = re.compile(r"RESOURCE_EXHAUSTED|out of memory|OutOfMemory|MemoryError|"
                  r"Cannot allocate memory|CUDA_ERROR_OUT_OF_MEMORY", re.IGNORECASE)

# --------------------------------------------------------------------------- presets

QUICK: dict[str, Any] = {
    "name": "quick",
    # The CLI's decode-cpu model (6 layers, 4 heads, width 64): KV state dominates memory at a
    # few thousand tokens, as in real long-context decoding.
    "preset": "decode-cpu", "batch": 4, "prompt_len": (8, 24), "window": 64, "block": 64,
    "kinds": ("full", "window", "block", "linear", "mixed"),
    "tokens": (256, 512, 1024),
    "systems": ("sym-xla", "padded", "tunix"),  # tunix where installed (the peers extra)
    # Per-shape compiles once per length (seconds each on a loaded 2-core CPU): one small N.
    "pershape_tokens": (16,), "pershape_kinds": ("full",),
    "realistic": {"batch": 16, "prompt": (16, 128), "median": 69, "cap": 256, "sigma": 0.6},
    "growing": {"batch": 16, "prompt": (16, 128), "medians": (16, 160), "runs": 3, "cap": 512,
                "sigma": 0.6},
    "rlft": {"scale": 8, "prompts": 8, "group": 4, "steps": 1},
    # lengths / 16: math median 75 (cap 512), code 50, chat 12.5, growing 6.25 -> 62.5
    "trace": {"batch": 16, "steps": 2, "growing_steps": 3, "scale": 16},
    "timeout": 900,
}

FULL: dict[str, Any] = {
    "name": "full",
    # GPT-2 small's shape (12 layers, 12 heads, width 768), batch 64, window 512 (paper Fig. 3).
    "preset": "gpt2-small", "batch": 64, "prompt_len": (8, 24), "window": 512, "block": 512,
    "kinds": ("full", "window", "block", "linear", "mixed"),
    "tokens": (512, 1024, 2048, 4096, 8192, 16384),
    "systems": ("sym-xla", "sym-triton", "padded", "tunix"),
    "pershape_tokens": (512,), "pershape_kinds": ("full", "window"),
    "realistic": {"batch": 64, "prompt": (64, 512), "median": 275, "cap": 1024, "sigma": 0.6},
    "growing": {"batch": 64, "prompt": (64, 512), "medians": (100, 1000), "runs": 6, "cap": 4096,
                "sigma": 0.6},
    # Qwen2.5-0.5B's shape at the paper's lengths (bench/rlft_step.py --preset gpu)
    "rlft": {"preset": "gpu", "scale": 1, "prompts": 16, "group": 8, "steps": 2},
    "trace": {"batch": 64, "steps": 4, "growing_steps": 6, "scale": 1},
    "timeout": 3600,
}

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


def lognormal_limits(rng: np.random.Generator, n: int, median: float, sigma: float,
                     cap: int) -> list[int]:
    """Per-row response lengths: log-normal around ``median``, rounded, in [1, cap]."""
    x = np.exp(np.log(median) + sigma * rng.standard_normal(n))
    return [int(v) for v in np.clip(np.round(x), 1, cap)]


def _prompts(rng: np.random.Generator, n: int, lo: int, hi: int) -> list[int]:
    return [int(x) for x in rng.integers(lo, hi + 1, size=n)]


def plan(p: dict[str, Any], *, systems: Sequence[str], scenarios: Sequence[str],
         seed: int = 0, trace: str | None = None) -> list[Job]:
    """Every job of preset ``p`` (deterministic: prompts and limits come from ``seed``)."""
    jobs: list[Job] = []
    base = {"preset": p["preset"], "seed": seed}
    if "decode" in scenarios:
        for kind in p["kinds"]:
            extra = p["pershape_tokens"] if kind in p["pershape_kinds"] else ()
            for n in sorted({*p["tokens"], *extra}):
                cfg = {**base, "scenario": "decode", "attention": kind, "tokens": n,
                       "batch": p["batch"], "prompt_len": list(p["prompt_len"]),
                       "window": p["window"], "block": p["block"]}
                rng = np.random.default_rng(seed)
                lens = _prompts(rng, p["batch"], *p["prompt_len"])
                names = [s for s in systems if s != "pershape"
                         and (s not in PEERS or kind == "full")]
                if "pershape" in systems and n in extra:
                    names.append("pershape")
                jobs += [Job(cfg, s, lens, [n] * p["batch"]) for s in names]
    others = [s for s in systems if s != "pershape"]
    if "realistic" in scenarios:
        r = p["realistic"]
        cfg = {**base, "scenario": "realistic", "attention": "full", "window": p["window"],
               "block": p["block"], "batch": r["batch"], "prompt_len": list(r["prompt"]),
               "median": r["median"], "cap": r["cap"], "sigma": r["sigma"]}
        rng = np.random.default_rng(seed)
        lens = _prompts(rng, r["batch"], *r["prompt"])
        lim = lognormal_limits(rng, r["batch"], r["median"], r["sigma"], r["cap"])
        jobs += [Job(cfg, s, lens, lim) for s in others]
    if "growing" in scenarios:
        g = p["growing"]
        lo, hi = g["medians"]
        for k in range(g["runs"]):
            median = round(lo * (hi / lo) ** (k / max(1, g["runs"] - 1)), 1)
            cfg = {**base, "scenario": "growing", "attention": "full", "window": p["window"],
                   "block": p["block"], "batch": g["batch"], "prompt_len": list(g["prompt"]),
                   "run": k, "median": median, "cap": g["cap"], "sigma": g["sigma"]}
            rng = np.random.default_rng(seed + k)
            lens = _prompts(rng, g["batch"], *g["prompt"])
            lim = lognormal_limits(rng, g["batch"], median, g["sigma"], g["cap"])
            jobs += [Job(cfg, s, lens, lim) for s in others]
    if "rlft" in scenarios:
        cfg = {"scenario": "rlft", "seed": seed, **p["rlft"]}
        jobs.append(Job(cfg, "rlft"))
    if "trace" in scenarios:
        from suite_trace import trace_configs

        jobs += [Job(cfg, s, steps=steps)
                 for cfg, steps in trace_configs(p, seed=seed, trace=trace) for s in others]
    # Keep the configurations in plan order; within one, padded first (sym is checked against it).
    order = {s: i for i, s in enumerate(SYSTEM_ORDER)}
    first: dict[str, int] = {}
    for i, j in enumerate(jobs):
        first.setdefault(json.dumps(j.config, sort_keys=True), i)
    return sorted(jobs, key=lambda j: (first[json.dumps(j.config, sort_keys=True)],
                                       order.get(j.system, 99)))


# --------------------------------------------------------------------------- children


def child_command(spec_path: str, out_path: str) -> list[str]:
    """The command that runs one system (tests replace it with a fake child)."""
    return [sys.executable, str(HERE / "suite_child.py"), spec_path, out_path]


def rlft_command(cfg: dict[str, Any], out_path: str) -> list[str]:
    """``bench/rlft_step.py`` with the preset's sizes (it runs each system in its own process)."""
    return [sys.executable, str(HERE / "rlft_step.py"), "--json", out_path,
            "--scale", str(cfg["scale"]), "--prompts", str(cfg["prompts"]),
            "--group", str(cfg["group"]), "--steps", str(cfg["steps"]), "--seed", str(cfg["seed"]),
            "--preset", cfg.get("preset", "cpu")]


def classify_failure(returncode: int, stderr: str) -> str:
    """``oom`` when the child ran out of memory (message, or killed by a signal such as the
    kernel's OOM killer's SIGKILL), else ``error``."""
    if _OOM.search(stderr or "") or returncode in (-9, 137):
        return "oom"
    return "error"


def run_process(cmd: list[str], timeout: float) -> tuple[str, str, int]:
    """Run a child; returns (status, stderr tail, returncode). Never raises for the child's
    failures: an out-of-memory or crashing configuration is a result, not a suite crash."""
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout,
                              cwd=ROOT)
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        return "timeout", _tail(err), -1
    if proc.returncode != 0:
        return classify_failure(proc.returncode, proc.stderr), _tail(proc.stderr), proc.returncode
    return "ok", "", 0


def _tail(text: str, lines: int = 4) -> str:
    return "\n".join((text or "").strip().splitlines()[-lines:])


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
    import suite_child

    try:
        metrics, arrs = suite_child.run(spec)
    except Exception as e:  # a failed configuration is a row, as with a child process
        text = f"{type(e).__name__}: {e}"
        return classify_failure(1, text), _tail(text), {}, {}
    return "ok", "", metrics, arrs


def run_job(job: Job, tmp: Path, timeout: float, arrays: dict[str, dict[str, np.ndarray]],
            *, in_process: bool = False) -> list[dict[str, Any]]:
    """Run one job; returns its result rows (no metadata yet). The RL step yields one row per
    system it compares."""
    if job.system == "rlft":
        return _run_rlft(job, tmp, timeout)
    if job.config["scenario"] == "trace":
        from suite_trace import run_trace_job

        spec = {**job.config, "system": job.system, "steps": job.steps}
        row = {**job.config, "system": job.system, "key": job.key}
        return [run_trace_job(spec, row, tmp, lambda s, o: run_process(
            child_command(s, o), timeout))]
    from suite_padding import layers_for, work_for

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
        status, err, rc = run_process(child_command(str(spec_path), str(out)), timeout)
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
    for system in ("sym", "padded"):
        r = report["systems"].get(system)
        row: dict[str, Any] = {**job.config, "system": system, "key": row_key(job.config, system)}
        if status == "ok" and r is not None and "error" not in r:
            row.update(status="ok", **r, ratios=report.get("ratios", {}))
        else:
            text = err or str((r or {}).get("error", ""))
            row.update(status=status if status != "ok" else classify_failure(1, text),
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
    todo = [j for j in jobs if j.system != "rlft" and j.system not in PEERS  # no estimate
            and j.config["scenario"] != "trace"]
    specs = [{**j.config, "model": None, "systems": [j.system], "memory_limit": limit,
              "batch": len(j.prompt_lens), "prompt_len": [max(j.prompt_lens)] * 2,
              "tokens": max(j.limits), "return_logits": False} for j in todo]
    if not specs:
        return {}
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out = Path(tmp) / "estimate.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(specs))
        status, err, _ = run_process([sys.executable, "-m", "jaxrl_sym.cli", "_estimate",
                                      str(spec_path), str(out)], timeout=600)
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
        keys = ([row_key(j.config, s) for s in ("sym", "padded")] if j.system == "rlft"
                else [j.key])
        if force or not all(rows.get(k, {}).get("status") in DONE for k in keys):
            out.append(j)
    return out


def run_jobs(jobs: Sequence[Job], out_dir: Path, meta: dict[str, Any], *, force: bool = False,
             timeout: float = 900, progress: bool = True, in_process: bool = False,
             echo: Callable[[str], None] | None = print, memory_check: bool = False,
             memory_limit: int | None = None) -> dict[str, dict[str, Any]]:
    """Run what is not finished yet, appending one row per result to ``results.jsonl`` as soon
    as it exists (a killed suite loses at most the configuration it was running).

    in_process: run each configuration in this process instead of a child (for notebooks at
    small sizes; peak RSS and out-of-memory isolation are then lost).
    memory_check: estimate every job first (:func:`estimate_jobs`) and record a job whose
    estimate exceeds ``memory_limit`` (default: the device's limit, else host memory) as
    ``status: "skipped: estimated X GB > limit Y GB"`` instead of running it."""
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
                        run_job(job, Path(tmpname), timeout, arrays, in_process=in_process))
            for row in rows_out:
                if row["system"] != "padded":
                    padded = rows.get(row_key(job.config, "padded"))
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
    if row["status"] != "ok" or row["scenario"] == "rlft":
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
        import suite_child

        meta = suite_child.probe()
    else:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "probe.json"
            subprocess.run([sys.executable, str(HERE / "suite_child.py"), "--probe", str(out)],
                           check=True, cwd=ROOT,
                           env={**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"})
            meta = json.loads(out.read_text())
    try:
        git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, cwd=ROOT).stdout.strip()
    except OSError:
        git = ""
    meta.update(git=git, command=command,
                date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"))
    return meta


def device_dir(device: str) -> str:
    """``cpu``, or a slug of the GPU name: ``NVIDIA H100 80GB HBM3`` → ``nvidia-h100-80gb-hbm3``."""
    return re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-") or "unknown"


def write_outputs(rows: dict[str, dict[str, Any]], out_dir: Path, *, plots: bool = True) -> None:
    """results.md, ../SUITE.md and the PNGs from every row in the JSONL."""
    from suite_report import render_markdown, render_summary

    data = list(rows.values())
    (out_dir / "results.md").write_text(render_markdown(data))
    if plots:
        import plots as plotting

        plotting.plot_all(data, out_dir)
    (out_dir.parent / "SUITE.md").write_text(render_summary(data, out_dir.name))


def narrow(preset: dict[str, Any], kinds: str | None, tokens: str | None) -> dict[str, Any]:
    """The preset restricted to the decode ``kinds`` / lengths ``tokens`` asked for (a GPU
    session's time allows a slice of the full grid per command; the JSONL accumulates slices)."""
    out = dict(preset)
    if kinds:
        want = [k.strip() for k in kinds.split(",") if k.strip()]
        unknown = sorted(set(want) - set(preset["kinds"]))
        if unknown:
            raise SystemExit(f"--kinds: unknown {unknown}; the preset has {preset['kinds']}")
        out["kinds"] = tuple(want)
        out["pershape_kinds"] = tuple(k for k in preset["pershape_kinds"] if k in want)
    if tokens:
        lengths = tuple(int(n) for n in tokens.split(","))
        out["tokens"] = lengths
        out["pershape_tokens"] = tuple(n for n in preset["pershape_tokens"] if n in lengths)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="CPU preset (about 10 min on 2 cores)")
    p.add_argument("--only", default="decode,realistic,growing,rlft,trace",
                   help="comma-separated scenarios: decode, realistic, growing, rlft, trace")
    p.add_argument("--trace", default=None, metavar="FILE.jsonl",
                   help='trace scenario: also replay this JSONL of {"prompt_len": P, '
                        '"response_len": R} rows (optional "step": k), lengths divided by the '
                        "preset's scale")
    p.add_argument("--systems", default=None,
                   help="comma-separated: sym-xla, sym-triton, padded, pershape, tunix, "
                        "tunix-defaults (default: the preset's, sym-triton only where compiled "
                        "Triton runs, i.e. on a GPU, tunix only where it is installed)")
    p.add_argument("--kinds", default=None,
                   help="comma-separated decode kinds to run (default: the preset's)")
    p.add_argument("--tokens", default=None,
                   help="comma-separated decode lengths N to run (default: the preset's)")
    p.add_argument("--force", action="store_true", help="re-run finished configurations")
    p.add_argument("--render", action="store_true", help="only rewrite tables and plots")
    p.add_argument("--out", default=None, help="results folder (default bench/results/<device>)")
    p.add_argument("--timeout", type=float, default=None, help="seconds per child process")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--dry-run", action="store_true", help="list the jobs and exit")
    p.add_argument("--no-memory-check", action="store_true",
                   help="run configurations whose memory estimate exceeds the limit")
    p.add_argument("--memory-limit", type=float, default=None, metavar="BYTES",
                   help="skip configurations estimated above BYTES (default: the device's "
                        "limit, else host memory)")
    args = p.parse_args(argv)
    from jaxrl_sym.errors import InputError

    preset = narrow(QUICK if args.quick else FULL, args.kinds, args.tokens)
    command = "python bench/suite.py " + " ".join(sys.argv[1:] if argv is None else argv)
    meta = device_meta(command)
    if args.systems:
        systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    else:
        systems = [s for s in preset["systems"] if (s != "sym-triton" or meta["triton_gpu"])
                   and (s not in PEERS or meta.get("tunix"))]
        if preset["pershape_tokens"]:
            systems.append("pershape")
    scenarios = [s.strip() for s in args.only.split(",") if s.strip()]
    out_dir = Path(args.out) if args.out else ROOT / "bench" / "results" / device_dir(
        meta["device"])
    out_dir = out_dir / "suite"
    try:
        jobs = plan(preset, systems=systems, scenarios=scenarios, trace=args.trace)
    except InputError as e:
        raise SystemExit(f"error: {e}") from None
    if args.dry_run:
        for j in jobs:
            print(j.label())
        return 0
    if not args.render:
        print(f"{len(jobs)} jobs on {meta['device']} → {out_dir}")
        run_jobs(jobs, out_dir, meta, force=args.force,
                 timeout=args.timeout or preset["timeout"], progress=not args.no_progress,
                 memory_check=not args.no_memory_check,
                 memory_limit=int(args.memory_limit) if args.memory_limit else None)
    write_outputs(load_rows(out_dir / "results.jsonl"), out_dir)
    print(f"wrote {out_dir}/results.md, {out_dir.parent}/SUITE.md and plots")
    return 0


if __name__ == "__main__":
    sys.exit(main())
