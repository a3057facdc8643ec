"""A system bound to a model: what every binder returns, and the token-position accounting the
fixed-shape systems share.

Why a base class: callers (the decode CLI, bench, RL) hold a :class:`BoundSystem` and never ask
which system it is; each system overrides what it can do. ``estimate`` and ``work`` return None
where a system has no shape model (peers run another library's buffers).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from jaxrl_sym.generation import GenerationConfig, GenerationResult, row_limits
from jaxrl_sym.runtime.metrics import WorkLog
from jaxrl_sym.systems.spec import BindOptions, SystemSpec

if TYPE_CHECKING:
    from jaxrl_sym.runtime.memory.estimate import Estimate
    from jaxrl_sym.runtime.memory.ledger_generation import GenerationLedger


class BoundSystem:
    """``spec`` on ``model`` with ``options``. Subclasses implement :meth:`generate`; a trainable
    system's bound class (``spec.capabilities.trains``) is also a
    :class:`~jaxrl_sym.systems.trainable.TrainBound`: the same object generates for the decode
    command and for an RL step, so it is bound once per trainer."""

    def __init__(self, spec: SystemSpec, model: Any, options: BindOptions) -> None:
        self.spec, self.options, self._model = spec, options, model

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def model(self) -> Any:
        """The model this system runs (a trainable system's: with the policy's current
        weights, see :class:`~jaxrl_sym.systems.trainable.TrainBound`)."""
        return self._model

    def generate(self, prompts: Sequence[np.ndarray], cfg: GenerationConfig) -> GenerationResult:
        """A response per prompt (tokens, log-probs, logits if asked, stats)."""
        raise NotImplementedError

    def __call__(self, prompts: Sequence[np.ndarray], cfg: GenerationConfig) -> GenerationResult:
        return self.generate(prompts, cfg)

    def estimate(self, prompt_lens: Sequence[int], cfg: GenerationConfig) -> Estimate | None:
        """Bytes this request will need, from shapes alone (every prompt at the longest length,
        every row to its limit), before it runs; None: no shape model (the memory check skips
        the system)."""
        return None

    def ledger(self, prompts: Sequence[np.ndarray], cfg: GenerationConfig, *,
               compiler: Callable[[Any], Any] | None = None) -> GenerationLedger | None:
        """The generation's memory ledger for ``prompts`` with ``cfg``, every row running to its
        own limit (``cfg.max_new_tokens`` per row: rows that end early free what they held, as
        they do when they run): the buffers alive at each dispatch, the system's own programs
        compiled — never run — by ``compiler(build)`` (a
        :class:`~jaxrl_sym.runtime.programs.Build`; None: for this machine). Unlike
        :meth:`estimate` (every row to the longest limit) it follows the lengths. None: not
        modelled (peers run another library's buffers)."""
        return None

    def work(self, prompt_lens: Sequence[int], response_lens: Sequence[int],
             cfg: GenerationConfig) -> dict[str, Any] | None:
        """Token positions this system computes for a request whose rows end at
        ``response_lens``: ``token_positions``, ``needed_positions``, ``waste_fraction`` and
        ``waste_by_cause`` (shares of the computed positions, as the engine's own log reports
        them). None: not modelled."""
        return None


def needed(prompt_lens: Sequence[int], response_lens: Sequence[int]) -> int:
    """Positions any system must compute: each prompt, and every emitted token after the first
    (each is fed back once)."""
    return sum(int(p) + max(int(n) - 1, 0) for p, n in zip(prompt_lens, response_lens,
                                                          strict=True))


def block_work(prompt_lens: Sequence[int], response_lens: Sequence[int], *, prompt_block: int,
               steps: int) -> dict[str, Any]:
    """A fixed-shape system: every row's prompt left-padded to ``prompt_block``, then ``steps``
    decode steps for every row (finished rows keep decoding)."""
    log = WorkLog()
    b = len(prompt_lens)
    log.computed = b * prompt_block + b * steps
    log.needed = needed(prompt_lens, response_lens)
    log.add("prompt_alignment", sum(prompt_block - int(p) for p in prompt_lens))
    log.add("finished_rows", b * steps - sum(max(int(n) - 1, 0) for n in response_lens))
    return token_report(log)


def token_report(log: WorkLog) -> dict[str, Any]:
    """The token-position half of :meth:`WorkLog.report` (key slots need the model's stores)."""
    keys = ("token_positions", "needed_positions", "waste_fraction", "waste_by_cause")
    report = log.report()
    return {k: report[k] for k in keys}


def max_limit(cfg: GenerationConfig, rows: int) -> int:
    """The largest per-row token limit of ``cfg`` for ``rows`` rows."""
    return int(np.max(row_limits(cfg, rows)))
