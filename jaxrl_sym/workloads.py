"""Every benchmark workload, as lengths: the one home of the requests ``python -m bench`` replays.

* :func:`realistic` — one RL-shaped request: prompts uniform in a range, responses log-normal
  with a heavy tail, capped (:data:`REALISTIC_CPU`, :data:`REALISTIC_GPU`: the sizes the
  benchmarks use); :func:`growing_runs` — the same with the median rising 10x over runs.
* :func:`grpo_rollout` — one GRPO step's prompts (tokens) and per-sample response lengths.
* Length profiles: the prompt and response lengths of a sequence of RL generation steps, replayed
  against every generation system by the suite (``python -m bench suite --only trace``).
* :func:`reasoning` — RL on long chain-of-thought traces: log-normal prompts and heavy-tailed
  log-normal responses truncated at a generation cap (:data:`REASONING_CAPS`), prompt and
  response lengths correlated; :func:`reasoning_growing` — the same with the median rising 10x
  over a run (:func:`reasoning_median`); :func:`length_stats` — what a request realised.

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

Reasoning lengths, and what the sources do and do not say. Silvestre & Pietzuch, "Systems
Opportunities for LLM Fine-Tuning using Reinforcement Learning", EuroMLSys '25
(``/work/shared/seeds/002``): §2.3 lists prompt sizes that vary, response sizes set by when EOS is
generated, and an average response length that changes during training — for DeepSeek-R1 it
"increases by over an order of magnitude". Its Tab. 2 gives the correlation of prompt and
response length, estimated from 0.5M samples (~180K per model): DeepSeek-R1 0.22, GPT-4 Turbo
0.24, Llama 3 0.44, mean 0.30 (§4.2 calls it a "mean weighted correlation"; DeepSeek-R1's
responses include its reasoning traces). It does not say Pearson or Spearman, raw or log
lengths; we impose 0.3 as the Pearson correlation of log lengths (Gaussian copula). Its Fig. 3 is
the JAX/XLA decoding microbenchmark (a static padded cache costs 4.1x / 7.5x the memory of a
dynamic one, full / windowed attention): why padding to the cap is costly, not a length
distribution. Neither it nor the RLVR study (seeds/003, a summary: GPU idling from skewed
sequence lengths, workloads varying across training steps) gives a shape, median, tail or
truncated share, so the log-normal, its median and sigma are ours (see :data:`REASONING_SIGMA`).
DeepSeek-R1 (Guo et al. 2025, arXiv:2501.12948, Fig. 3; Nature 2025, Fig. 1b) plots
R1-Zero's average response length on the training set rising steadily over RL training.

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


def reasoning_rollout(*, prompts: int, group: int, cap: int, vocab: int, seed: int = 0,
                      median: float | None = None) -> tuple[list[np.ndarray], list[int]]:
    """One GRPO step's request on :func:`reasoning` lengths: ``prompts`` prompts (random tokens
    below ``vocab``) and ``prompts * group`` response lengths (prompt-major). The rows are one
    :func:`reasoning` draw of ``prompts * group``; a group's samples share its first row's
    prompt (GRPO samples one prompt G times), so the prompt/response correlation holds between
    a group's prompt and its first response."""
    step = reasoning(prompts * group, cap=cap, median=median, seed=seed)
    rng = np.random.default_rng([seed, 1])
    tokens = [rng.integers(0, vocab, size=step.prompt_lens[g * group], dtype=np.int32)
              for g in range(prompts)]
    return tokens, list(step.response_lens)


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


# Reasoning profile (issue 47): the generation caps long chain-of-thought RL runs use.
REASONING_CAPS: tuple[int, ...] = (4096, 8192, 16384, 32768)
# Responses: log-normal with median ``cap / 16`` by default (1024 at 16k: far below the cap) and
# sigma 1.2, so the 99th percentile, ``median * exp(2.326 * 1.2) = 16.3 * median``, sits at the
# cap: about 1% truncated at every cap, a heavier tail than TASKS["math"] (sigma 1.0).
REASONING_SIGMA = 1.2
REASONING_CORRELATION = 0.3  # Tab. 2's mean over three models (see the module docstring)
# Prompts: log-normal, median 150 tokens, sigma 0.6 (99th percentile ~600), capped at 2048
# (a share ~1e-5 clipped): a math/reasoning prompt is a short problem statement.
REASONING_PROMPT: tuple[float, float, int] = (150.0, 0.6, 2048)


def reasoning_tail(median: float, sigma: float, cap: int) -> float:
    """The share of a log-normal(``median``, ``sigma``) above ``cap``, P(Z > ln(cap/median)/sigma):
    what a generation limit truncates, so benchmarks can report the intended truncated share next
    to the realised one (rounding also moves lengths in [cap - 0.5, cap) onto the cap)."""
    return 0.5 * math.erfc(math.log(cap / median) / (sigma * math.sqrt(2.0)))


def _check_reasoning(cap: int, median: float, sigma: float, correlation: float,
                     prompt: tuple[float, float, int]) -> None:
    """Refuse parameters the copula or the log-normals cannot take, naming the argument."""
    if cap < 1 or prompt[2] < 1:
        raise InputError(f"cap {cap} / prompt cap {prompt[2]}: caps must be >= 1")
    if not (median > 0 and prompt[0] > 0):
        raise InputError(f"median {median} / prompt median {prompt[0]}: medians must be > 0")
    if not (sigma > 0 and prompt[1] > 0):
        raise InputError(f"sigma {sigma} / prompt sigma {prompt[1]}: sigmas must be > 0")
    if not -1.0 <= correlation <= 1.0:
        raise InputError(f"correlation {correlation}: must be in [-1, 1]")


def _reasoning_rows(rng: np.random.Generator, n: int, *, median: float, sigma: float, cap: int,
                    correlation: float, prompt: tuple[float, float, int]) -> Step:
    """``n`` rows whose log prompt and log response lengths are standard normals with correlation
    ``correlation`` (a Gaussian copula: the response's normal is ``rho * z_prompt +
    sqrt(1 - rho^2) * noise``), scaled to the two log-normals, rounded and clipped to
    [1, cap]. One ``(2, n)`` draw keeps a seed's rows identical whatever reads them."""
    z_prompt, noise = rng.standard_normal((2, n))
    z_response = correlation * z_prompt + math.sqrt(1.0 - correlation**2) * noise
    p_median, p_sigma, p_cap = prompt
    prompts = np.clip(np.round(p_median * np.exp(p_sigma * z_prompt)), 1, p_cap)
    responses = np.clip(np.round(median * np.exp(sigma * z_response)), 1, cap)
    return Step(tuple(int(x) for x in prompts), tuple(int(x) for x in responses))


def reasoning(n: int, *, cap: int = 16384, median: float | None = None,
              sigma: float = REASONING_SIGMA, correlation: float = REASONING_CORRELATION,
              prompt: tuple[float, float, int] = REASONING_PROMPT, seed: int = 0) -> Step:
    """One long chain-of-thought request of ``n`` rows, from ``np.random.default_rng(seed)``.

    Responses are log-normal with ``median`` (default ``cap / 16``) and ``sigma``, clipped to
    ``cap``: the share :func:`reasoning_tail` puts above the cap lands on it (truncated, as a
    generation limit truncates a trace that has not reached EOS). Prompts are log-normal,
    ``prompt = (median, sigma, cap)`` (:data:`REASONING_PROMPT`). The Pearson correlation of
    the log lengths is ``correlation`` before rounding and clipping (0.3: the paper's Tab. 2
    mean; on raw lengths the defaults give about 0.2, and Spearman ``6/pi asin(rho/2)`` ~0.29)."""
    median = cap / 16 if median is None else median
    _check_reasoning(cap, median, sigma, correlation, prompt)
    return _reasoning_rows(np.random.default_rng(seed), n, median=median, sigma=sigma, cap=cap,
                           correlation=correlation, prompt=prompt)


def reasoning_median(step: int, steps: int, *, median_start: float,
                     growth: float = 10.0) -> float:
    """The median response length at ``step`` (0-based) of ``steps``: geometric from
    ``median_start`` to ``growth * median_start`` at the last step, because response length grows
    multiplicatively over reasoning RL (DeepSeek-R1: over an order of magnitude)."""
    if not 0 <= step < steps:
        raise InputError(f"step {step}: must be in [0, {steps})")
    if not (median_start > 0 and growth > 0):
        raise InputError(f"median_start {median_start}, growth {growth}: must be > 0")
    return median_start * growth ** (step / max(1, steps - 1))


def reasoning_growing(*, batch: int, steps: int, cap: int = 16384,
                      median_start: float | None = None, growth: float = 10.0,
                      sigma: float = REASONING_SIGMA, correlation: float = REASONING_CORRELATION,
                      prompt: tuple[float, float, int] = REASONING_PROMPT,
                      seed: int = 0) -> Profile:
    """``steps`` reasoning requests of ``batch`` rows whose median follows
    :func:`reasoning_median`; ``median_start`` defaults to ``cap / 16 / growth`` so the last step
    reaches :func:`reasoning`'s default median (``growth=1`` gives a static profile). Other
    arguments as :func:`reasoning`; step k draws from ``default_rng([seed, k, 47])``."""
    start = cap / 16 / growth if median_start is None else median_start
    medians = [reasoning_median(k, steps, median_start=start, growth=growth)
               for k in range(steps)]
    out = []
    for k, median in enumerate(medians):
        _check_reasoning(cap, median, sigma, correlation, prompt)
        out.append(_reasoning_rows(np.random.default_rng([seed, k, 47]), batch, median=median,
                                   sigma=sigma, cap=cap, correlation=correlation, prompt=prompt))
    end = medians[-1] if medians else start
    return Profile("reasoning", f"reasoning: median {start:g} -> {end:g} over {steps} steps, "
                                f"sigma {sigma}, cap {cap}, correlation {correlation}",
                   tuple(out))


@dataclass(frozen=True)
class LengthStats:
    """What one request realised: response ``median``, ``mean`` and ``p99``; ``truncated``, the
    share of responses at ``cap``; ``correlation``, Pearson of log prompt and log response lengths
    (NaN when either is constant). Tests assert these; benchmarks report them beside results."""

    rows: int
    median: float
    mean: float
    p99: float
    truncated: float
    correlation: float


def length_stats(step: Step, *, cap: int) -> LengthStats:
    """The realised statistics of ``step`` against the generation cap ``cap``."""
    p = np.asarray(step.prompt_lens, dtype=np.float64)
    r = np.asarray(step.response_lens, dtype=np.float64)
    if r.size == 0:
        raise InputError("length_stats: the step has no rows")
    lp, lr = np.log(p), np.log(r)
    corr = (float("nan") if lp.std() == 0 or lr.std() == 0
            else float(np.corrcoef(lp, lr)[0, 1]))
    return LengthStats(rows=int(r.size), median=float(np.median(r)), mean=float(r.mean()),
                       p99=float(np.percentile(r, 99)), truncated=float(np.mean(r >= cap)),
                       correlation=corr)

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
