"""Experiment trackers: every step's metrics to TensorBoard, Weights & Biases or MLflow.

Why here and not a callback the user writes: the trackers people already watch are where a run
is judged (TRL's ``report_to``, NeMo RL, Tunix and AReaL all log to them), and a run that logs
only to a JSONL file is one more thing to plot by hand. ``--report-to tensorboard,wandb,mlflow``
(:class:`ReportConfig`) logs what the metrics file holds — every numeric field of a step's
metrics, nested dicts (per-stage seconds, peak bytes) as ``outer/inner``, named as
:func:`tag` says — plus, every
``completions_every`` steps, a table of the step's sampled completions with their rewards.

Each tracker is an optional dependency, imported only when asked for, and a missing one is an
error before any work that names the flag and the install line. Importing this module imports
neither JAX nor any tracker. W&B runs in offline mode unless an API key is configured
(``WANDB_API_KEY`` or ``wandb login``) or ``WANDB_MODE`` says otherwise: a run on a machine
without network must not stop on a login prompt. MLflow logs to a SQLite store,
``<log_dir>/mlflow.db``, unless ``MLFLOW_TRACKING_URI`` names a server or store (MLflow 3 refuses
its old ``mlruns`` file store unless told otherwise; its own recommendation is a database). A
tracker that fails to start is an error naming ``--report-to`` and the tracker, before any work.
"""

from __future__ import annotations

import importlib.util
import math
import numbers
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from jaxrl_sym.errors import InputError
from jaxrl_sym.rl.step.rollout import BatchReward

# name -> (module to import, what to install)
PACKAGES: dict[str, tuple[str, str]] = {
    "tensorboard": ("tensorboardX", "pip install -e '.[track]' (tensorboardX)"),
    "wandb": ("wandb", "pip install wandb"),
    "mlflow": ("mlflow", "pip install mlflow"),
}
SAMPLES_SHOWN = 8  # completions per table: enough to read, few enough to scroll past


@dataclass(frozen=True)
class ReportConfig:
    """Where a run's metrics go besides ``--metrics``.

    report_to: tracker names (``--report-to``; empty: none, the default). log_dir: the
      trackers' directory (``--log-dir``; None: ``runs/<start time>``, printed at the start).
    completions_every: log a table of sampled completions every this many steps
      (``--log-completions-every``; 0: never). run_name: the run's name in the tracker (None:
      the log directory's name).
    """

    report_to: tuple[str, ...] = ()
    log_dir: str | None = None
    completions_every: int = 0
    run_name: str | None = None

    def __post_init__(self) -> None:
        names = tuple(self.report_to)
        object.__setattr__(self, "report_to", names)
        for n in names:
            if n not in PACKAGES:
                raise InputError(f"--report-to {n!r}: not a tracker; choose from "
                                 f"{', '.join(PACKAGES)} (comma-separated)")
        if len(set(names)) != len(names):
            raise InputError(f"--report-to {','.join(names)}: a tracker is named twice")
        if isinstance(self.completions_every, bool) or not isinstance(
                self.completions_every, int) or self.completions_every < 0:
            raise InputError(f"--log-completions-every {self.completions_every!r}: give a "
                             "whole number of steps >= 0 (0: never)")

    @staticmethod
    def parse(report_to: str | None, **fields: Any) -> ReportConfig:
        """From ``--report-to a,b`` (None or ``none``: no tracker)."""
        names = () if report_to in (None, "", "none") else tuple(
            s.strip() for s in str(report_to).split(","))
        return ReportConfig(names, **fields)

    def check_installed(self) -> None:
        """Each named tracker's package importable, else an error naming the install line
        (called before any work: a run must not fail at its first step for a tracker)."""
        for n in self.report_to:
            module, install = PACKAGES[n]
            if importlib.util.find_spec(module) is None:
                raise InputError(f"--report-to {n}: the {module} package is not installed; "
                                 f"{install}, or drop {n} from --report-to")

    def directory(self) -> Path:
        """The log directory (``runs/<start time>`` when not given)."""
        if self.log_dir is not None:
            return Path(self.log_dir)
        return Path("runs") / time.strftime("%Y%m%d-%H%M%S")


_NOT_IN_TAGS = re.compile(r"[^-/\w.]")


def tag(name: str) -> str:
    """A metric's name as every tracker shows it: TensorBoard's tag characters (letters,
    digits, ``_ - . /``), anything else as ``_`` — so ``reward/mymod:score`` is
    ``reward/mymod_score`` in TensorBoard, W&B and MLflow alike (TensorBoard would rename it
    on its own, the others not)."""
    return _NOT_IN_TAGS.sub("_", name)


def scalars(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """The numeric fields of a metrics dict as ``name -> float``; nested dicts become
    ``outer/inner``; bools count 0/1; strings, lists and None are not scalars. Non-finite
    values are kept (a NaN loss is exactly what a tracker should show)."""
    out: dict[str, float] = {}
    for k, v in metrics.items():
        name = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(scalars(v, f"{name}/"))
        elif isinstance(v, bool) or (isinstance(v, numbers.Real) and not isinstance(v, str)):
            out[name] = float(v)
        elif hasattr(v, "dtype") and getattr(v, "shape", None) == ():
            out[name] = float(v)  # a NumPy or JAX scalar
    return out


@dataclass(frozen=True)
class Sample:
    """One sampled completion of a step, as the reward saw it."""

    prompt: str
    completion: str
    reward: float


def markdown_table(samples: Sequence[Sample]) -> str:
    """The samples as a Markdown table (TensorBoard's text plugin and MLflow render it)."""
    cell = lambda s: s.replace("|", "\\|").replace("\n", "<br>")
    rows = [f"| {cell(s.prompt)} | {cell(s.completion)} | {s.reward:g} |" for s in samples]
    return "\n".join(["| prompt | completion | reward |", "|---|---|---:|", *rows])


class Tracker(Protocol):
    def log(self, step: int, values: dict[str, float]) -> None: ...
    def samples(self, step: int, samples: Sequence[Sample]) -> None: ...
    def close(self) -> None: ...


class TensorBoard:
    """Event files under ``<dir>/tensorboard`` (tensorboardX: no TensorFlow needed)."""

    def __init__(self, directory: Path, config: Mapping[str, Any], name: str) -> None:
        from tensorboardX import SummaryWriter

        self.writer = SummaryWriter(str(directory / "tensorboard"))
        self.writer.add_text("config", markdown_config(config), 0)

    def log(self, step: int, values: dict[str, float]) -> None:
        for k, v in values.items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def samples(self, step: int, samples: Sequence[Sample]) -> None:
        self.writer.add_text("completions", markdown_table(samples), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandB:
    """A W&B run in ``<dir>`` (offline unless a key is configured, module docstring)."""

    def __init__(self, directory: Path, config: Mapping[str, Any], name: str) -> None:
        import wandb

        keyed = bool(os.environ.get("WANDB_API_KEY")) or (Path.home() / ".netrc").exists()
        mode = os.environ.get("WANDB_MODE") or ("online" if keyed else "offline")
        directory.mkdir(parents=True, exist_ok=True)
        self.wandb = wandb
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "jaxrl-sym"), name=name,
                              dir=str(directory), mode=mode, config=dict(config))

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def samples(self, step: int, samples: Sequence[Sample]) -> None:
        table = self.wandb.Table(columns=["prompt", "completion", "reward"],
                                 data=[[s.prompt, s.completion, s.reward] for s in samples])
        self.run.log({"completions": table}, step=step)

    def close(self) -> None:
        self.run.finish()


class MLflow:
    """An MLflow run (``<dir>/mlflow.db`` unless ``MLFLOW_TRACKING_URI`` is set)."""

    def __init__(self, directory: Path, config: Mapping[str, Any], name: str) -> None:
        import mlflow

        if not os.environ.get("MLFLOW_TRACKING_URI"):
            directory.mkdir(parents=True, exist_ok=True)
            mlflow.set_tracking_uri(f"sqlite:///{(directory / 'mlflow.db').resolve()}")
        self.mlflow = mlflow
        self.run = mlflow.start_run(run_name=name)
        mlflow.log_params({k: str(v)[:500] for k, v in config.items()})

    def log(self, step: int, values: dict[str, float]) -> None:
        self.mlflow.log_metrics({k: v for k, v in values.items() if math.isfinite(v)}, step=step)

    def samples(self, step: int, samples: Sequence[Sample]) -> None:
        self.mlflow.log_text(markdown_table(samples), f"completions/step_{step:06d}.md")

    def close(self) -> None:
        self.mlflow.end_run()


TRACKERS: dict[str, Callable[[Path, Mapping[str, Any], str], Tracker]] = {
    "tensorboard": TensorBoard, "wandb": WandB, "mlflow": MLflow}


def _start(name: str, directory: Path, config: Mapping[str, Any], run: str) -> Tracker:
    """The tracker ``name`` started, or an :class:`InputError` naming ``--report-to`` and what
    the tracker said (a store it refuses, a missing extra, a bad environment setting) — the
    library's own exception class and traceback said nothing about which flag set it up."""
    try:
        return TRACKERS[name](directory, config, run)
    except Exception as err:  # any tracker's own failure, mapped at this boundary
        raise InputError(f"--report-to {name}: the tracker did not start in {directory}: "
                         f"{type(err).__name__}: {str(err)[:300]}") from err


def markdown_config(config: Mapping[str, Any]) -> str:
    return "\n".join(f"- `{k}`: `{v}`" for k, v in sorted(config.items()))


@dataclass(frozen=True)
class _Kept:
    """A batch reward whose scored samples are handed to ``keep`` (the completion table)."""

    task: Any
    keep: Callable[[Any, Any, Any], None]

    def score_batch(self, prompts: Any, responses: Any) -> list[float]:
        out = self.task.score_batch(prompts, responses)
        self.keep(prompts, responses, out)
        return out


def _kept_one(reward: Callable[[Any, Any], float], keep: Callable[[Any, Any, Any], None]
              ) -> Callable[[Any, Any], float]:
    """A per-sample reward whose scored samples are handed to ``keep``."""
    def scored(prompt: Any, response: Any) -> float:
        r = reward(prompt, response)
        keep([prompt], [response], [r])
        return r
    return scored


class Report:
    """The trackers of one run: :meth:`step` logs a step's metrics (and its samples when due),
    :meth:`close` flushes them. Built from a :class:`ReportConfig` (nothing when it names no
    tracker), with the run's configuration as the trackers' parameters."""

    def __init__(self, cfg: ReportConfig, config: Mapping[str, Any]) -> None:
        self.cfg, self.trackers = cfg, []
        self.pending: list[Sample] = []
        if cfg.report_to:
            cfg.check_installed()
            self.dir = cfg.directory()
            name = cfg.run_name or self.dir.name
            self.trackers = [_start(n, self.dir, config, name) for n in cfg.report_to]

    def scored(self, task: Any) -> Any:
        """The reward the trainer calls: the task's (its ``score_batch`` where it scores a
        step at once, a :class:`~jaxrl_sym.rl.step.rollout.BatchReward`; else ``task.reward``
        per sample), with the first scored samples kept for the step's completion table when
        one is asked for. A text task shows its decoded text (``response_text``), a token task
        its token ids."""
        batch = isinstance(task, BatchReward)
        if not (self.trackers and self.cfg.completions_every):
            return task if batch else task.reward
        text = getattr(task, "response_text", None) or (lambda ids: " ".join(map(str, ids)))

        def keep(prompts: Any, responses: Any, rewards: Any) -> None:
            ids = lambda xs: [int(t) for t in xs]
            for p, r, v in zip(prompts, responses, rewards, strict=True):
                if len(self.pending) < SAMPLES_SHOWN:
                    self.pending.append(Sample(text(ids(p)), text(ids(r)), float(v)))
        return _Kept(task, keep) if batch else _kept_one(task.reward, keep)

    def log(self, step: int, values: Mapping[str, Any]) -> None:
        """Scalars at ``step`` (the metrics' numeric fields, :func:`scalars`)."""
        flat = {tag(k): v for k, v in scalars(values).items()}
        for t in self.trackers:
            t.log(step, flat)

    def step(self, k: int, metrics: Mapping[str, Any]) -> None:
        """Step ``k``'s metrics, and its completion table when one is due."""
        self.log(k, metrics)
        every = self.cfg.completions_every
        if every and k % every == 0 and self.pending:
            for t in self.trackers:
                t.samples(k, self.pending)
        self.pending = []

    def close(self) -> None:
        for t in self.trackers:
            t.close()
