"""Every benchmark workload, as lengths: the one home of the requests ``python -m bench`` replays.

* :func:`realistic` — one RL-shaped request: prompts uniform in a range, responses log-normal
  with a heavy tail, capped (:data:`REALISTIC_CPU`, :data:`REALISTIC_GPU`: the sizes the
  benchmarks use); :func:`growing_runs` — the same with the median rising 10x over runs.
* :func:`grpo_rollout` — one GRPO step's prompts (tokens) and per-sample response lengths.
* Length profiles: the prompt and response lengths of a sequence of RL generation steps, replayed
  against every generation system by the suite (``python -m bench suite --only trace``).

Why profiles and not one distribution: RLVR workloads differ per task and drift over training.
A characterization study of production RLVR runs (PolyTrace, see ``/work/shared/seeds/003``)
reports accelerators idling because response lengths are skewed (a few long rows hold a whole
batch) and because the length distribution changes as training goes on; DeepSeek-R1 reports the
mean response length rising about 10x over RL training. A system tuned on one fixed length
distribution can look good and still idle on these, so the suite replays several:

* ``math``, ``code``, ``chat`` — skewed per task: log-normal responses with a heavy tail
  (reasoning-style math: long median, widest tail; code: long prompts, long tail; chat: short
  and narrow), capped like a generation limit caps them;
* ``growing`` — the median response length rising 10x (geometrically) over the steps;
* a user trace — a JSONL file of ``{"prompt_len": P, "response_len": R}`` rows (optional
  ``"step": k`` groups rows into steps; otherwise consecutive rows fill steps of ``batch``),
  validated with errors naming the file and line (:func:`load_trace`).

A profile is pure data (:class:`Profile`: steps of per-row lengths), so every system replays
exactly the same requests and results are comparable across systems and runs.

Idle fraction (:func:`idle_fraction`): the share of computed token positions (one row slot at one
position pushed through the model, in prefill or a decode step) that were not needed — padding
and rows that already finished but still occupy a slot. Token positions stand in for device time
because every position of a decode step costs the same compute; the symbolic runtime books its
positions by cause while it runs (``stats["waste_by_cause"]``); a fixed-shape system's count
follows from its shapes alone (:func:`fixed_shape_positions`).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jaxrl_sym.errors import InputError
from jaxrl_sym.jsonl import parse_object, read_lines

# The realistic request's shapes (FIELD_NOTES §5): prompts uniform in ``prompt``, responses
# log-normal with ``median`` and ``sigma`` capped at ``cap``; the CPU size divides the GPU's
# lengths by 4 (median 275 -> 69) and batch 64 -> 16.
REALISTIC_GPU: dict = {"batch": 64, "prompt": (64, 512), "median": 275, "cap": 1024,
                       "sigma": 0.6}
REALISTIC_CPU: dict = {"batch": 16, "prompt": (16, 128), "median": 69, "cap": 256, "sigma": 0.6}


@dataclass(frozen=True)
class Step:
    """One generation request: per-row prompt lengths and response lengths (EOS positions)."""

    prompt_lens: tuple[int, ...]
    response_lens: tuple[int, ...]

    @property
    def useful_tokens(self) -> int:
        return int(sum(self.response_lens))


@dataclass(frozen=True)
class Profile:
    """A named sequence of steps (what one RL run's generation would request)."""

    name: str
    description: str
    steps: tuple[Step, ...]

    @property
    def useful_tokens(self) -> int:
        return sum(s.useful_tokens for s in self.steps)

    def digest(self) -> str:
        """A short hash of every length: the identity of the replayed requests."""
        h = hashlib.sha256()
        for s in self.steps:
            h.update(json.dumps([s.prompt_lens, s.response_lens]).encode())
        return h.hexdigest()[:12]


@dataclass(frozen=True)
class TaskMix:
    """A task's length distribution at full scale: prompts uniform in ``prompt``, responses
    log-normal with ``median`` and ``sigma`` (the heavy tail), capped at ``cap``."""

    prompt: tuple[int, int]
    median: float
    sigma: float
    cap: int


# Full-scale shapes (divided by ``scale`` on small presets). Medians and tails follow the
# qualitative picture of the RLVR study: math reasoning long with the widest tail, code with long
# prompts, chat short and narrow.
TASKS: dict[str, TaskMix] = {
    "math": TaskMix(prompt=(64, 384), median=1200.0, sigma=1.0, cap=8192),
    "code": TaskMix(prompt=(256, 1024), median=800.0, sigma=0.8, cap=4096),
    "chat": TaskMix(prompt=(32, 512), median=200.0, sigma=0.5, cap=1024),
}


def _scaled(x: float, scale: float) -> int:
    return max(1, math.ceil(x / scale))


def lognormal(rng: np.random.Generator, n: int, median: float, sigma: float,
              cap: int) -> tuple[int, ...]:
    """Per-row lengths: log-normal around ``median``, rounded, in [1, cap]."""
    x = np.exp(np.log(median) + sigma * rng.standard_normal(n))
    return tuple(int(v) for v in np.clip(np.round(x), 1, cap))


def uniform(rng: np.random.Generator, n: int, lo: int, hi: int) -> tuple[int, ...]:
    """Per-row lengths uniform in [lo, hi]."""
    return tuple(int(x) for x in rng.integers(lo, hi + 1, size=n))


def realistic(*, batch: int, prompt: tuple[int, int], median: float, sigma: float, cap: int,
              seed: int = 0, rng: np.random.Generator | None = None) -> Step:
    """One RL-shaped request (:data:`REALISTIC_CPU`'s fields): prompt lengths first, then the
    response lengths, from one generator seeded with ``seed`` (or ``rng``, which a caller then
    goes on drawing prompt tokens from)."""
    rng = np.random.default_rng(seed) if rng is None else rng
    prompts = uniform(rng, batch, *prompt)
    return Step(prompts, lognormal(rng, batch, median, sigma, cap))


def growing_runs(*, batch: int, prompt: tuple[int, int], medians: tuple[float, float],
                 runs: int, cap: int, sigma: float, seed: int = 0) -> list[tuple[float, Step]]:
    """``runs`` realistic requests whose median response length rises geometrically from
    ``medians[0]`` to ``medians[1]`` (rounded to 0.1); run k is seeded with ``seed + k``."""
    lo, hi = medians
    out = []
    for k in range(runs):
        median = round(lo * (hi / lo) ** (k / max(1, runs - 1)), 1)
        out.append((median, realistic(batch=batch, prompt=prompt, median=median, sigma=sigma,
                                      cap=cap, seed=seed + k)))
    return out


def grpo_rollout(*, prompts: int, group: int, scale: int, sigma: float, vocab: int,
                 seed: int = 0) -> tuple[list[np.ndarray], list[int]]:
    """One GRPO step's request: ``prompts`` prompts (random tokens below ``vocab``) of lengths
    uniform in [64, 512] / ``scale``, and ``prompts * group`` response lengths (prompt-major,
    ``group`` per prompt) log-normal with median 275 / ``scale`` capped at 1024 / ``scale``."""
    rng = np.random.default_rng(seed)
    lo, hi = max(1, 64 // scale), max(1, 512 // scale)
    cap, median = max(1, 1024 // scale), 275 / scale
    tokens = [rng.integers(0, vocab, size=int(rng.integers(lo, hi + 1)), dtype=np.int32)
              for _ in range(prompts)]
    lengths = np.exp(np.log(median) + sigma * rng.standard_normal(prompts * group))
    return tokens, [int(x) for x in np.clip(np.round(lengths), 1, cap)]


def skewed(task: str, *, batch: int, steps: int, scale: float = 1.0, seed: int = 0) -> Profile:
    """``steps`` requests of ``batch`` rows drawn from :data:`TASKS` ``[task]``, lengths divided
    by ``scale``."""
    if task not in TASKS:
        raise InputError(f"task {task!r}: unknown; choose one of {sorted(TASKS)}")
    t = TASKS[task]
    lo, hi = _scaled(t.prompt[0], scale), _scaled(t.prompt[1], scale)
    out = []
    for k in range(steps):
        rng = np.random.default_rng([seed, k, sorted(TASKS).index(task)])
        prompts = uniform(rng, batch, lo, hi)
        out.append(Step(prompts, lognormal(rng, batch, t.median / scale, t.sigma,
                                           _scaled(t.cap, scale))))
    return Profile(task, f"{task}: log-normal median {t.median / scale:g}, sigma {t.sigma}, "
                         f"cap {_scaled(t.cap, scale)}", tuple(out))


def growing(*, batch: int, steps: int, medians: tuple[float, float] = (100.0, 1000.0),
            prompt: tuple[int, int] = (64, 512), sigma: float = 0.6, cap: int = 4096,
            scale: float = 1.0, seed: int = 0) -> Profile:
    """The median response length rising geometrically from ``medians[0]`` to ``medians[1]``
    over ``steps`` (10x by default, as DeepSeek-R1 reports over RL training)."""
    lo, hi = (m / scale for m in medians)
    plo, phi = _scaled(prompt[0], scale), _scaled(prompt[1], scale)
    out = []
    for k in range(steps):
        median = lo * (hi / lo) ** (k / max(1, steps - 1))
        rng = np.random.default_rng([seed, k, 99])
        prompts = uniform(rng, batch, plo, phi)
        out.append(Step(prompts, lognormal(rng, batch, median, sigma, _scaled(cap, scale))))
    return Profile("growing", f"growing: median {lo:g} -> {hi:g} over {steps} steps",
                   tuple(out))


def _positive_int(row: dict, key: str, where: str) -> int:
    v = row.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise InputError(f"{where}: {key!r} must be an integer >= 1, got {v!r}")
    return v


def _read_rows(path: Path) -> list[tuple[int | None, int, int]]:
    """(step or None, prompt_len, response_len) per non-blank line, validated."""
    if not path.is_file():
        raise InputError(f"--trace {path}: no such file; give a JSONL file of "
                         '{"prompt_len": P, "response_len": R} rows')
    rows = []
    for i, line in read_lines(path, "--trace"):
        where = f"{path}:{i}"
        row = parse_object(line, where, "an object with prompt_len and response_len")
        step = row.get("step")
        if step is not None and (isinstance(step, bool) or not isinstance(step, int)
                                 or step < 0):
            raise InputError(f"{where}: 'step' must be an integer >= 0, got {step!r}")
        rows.append((step, _positive_int(row, "prompt_len", where),
                     _positive_int(row, "response_len", where)))
    if not rows:
        raise InputError(f"--trace {path}: no rows; give one JSON object per line")
    if len({r[0] is None for r in rows}) > 1:
        raise InputError(f"--trace {path}: give 'step' on every row or on none")
    return rows


def load_trace(path: str | Path, *, batch: int, scale: float = 1.0,
               max_steps: int | None = None) -> Profile:
    """A user trace as a profile. Rows with ``step`` are grouped by it (in step order); without,
    consecutive rows fill steps of ``batch`` (the last may be smaller). Lengths are divided by
    ``scale`` (rounded up, at least 1), so a GPU-sized trace can be replayed on a small preset."""
    path = Path(path)
    rows = _read_rows(path)
    groups: list[list[tuple[int, int]]]
    if rows[0][0] is None:
        flat = [(p, r) for _, p, r in rows]
        groups = [flat[i:i + batch] for i in range(0, len(flat), batch)]
    else:
        by: dict[int, list[tuple[int, int]]] = {}
        for s, p, r in rows:
            by.setdefault(int(s), []).append((p, r))  # type: ignore[arg-type]
        groups = [by[k] for k in sorted(by)]
    steps = tuple(Step(tuple(_scaled(p, scale) for p, _ in g),
                       tuple(_scaled(r, scale) for _, r in g)) for g in groups[:max_steps])
    return Profile(f"trace:{path.stem}", f"trace {path.name} ({len(rows)} rows, lengths / "
                                         f"{scale:g})", steps)


def builtin_profiles(*, batch: int, steps: int, growing_steps: int, scale: float = 1.0,
                     seed: int = 0) -> list[Profile]:
    """The skewed per-task profiles and the growing one, at one size."""
    out = [skewed(t, batch=batch, steps=steps, scale=scale, seed=seed) for t in TASKS]
    out.append(growing(batch=batch, steps=growing_steps, scale=scale, seed=seed))
    return out


def fixed_shape_positions(prompt_lens: Sequence[int],
                          response_lens: Sequence[int]) -> tuple[int, int]:
    """(needed, computed) token positions of a fixed-shape system (the padded baseline) on one
    request. Needed: each row's prompt and every response token fed back once,
    ``sum_i p_i + r_i - 1``. Computed: the left-padded prompt block ``B * max p`` plus all
    ``B`` rows at each of the ``max r - 1`` decode steps (finished rows keep decoding)."""
    b = len(prompt_lens)
    needed = sum(p + r - 1 for p, r in zip(prompt_lens, response_lens, strict=True))
    computed = b * max(prompt_lens) + b * (max(response_lens) - 1)
    return needed, computed


def idle_fraction(needed: int, computed: int) -> float:
    """Share of computed positions that were not needed (0 when nothing was computed)."""
    return 0.0 if computed <= 0 else max(0.0, 1.0 - needed / computed)
