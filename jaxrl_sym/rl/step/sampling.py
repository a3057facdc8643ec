"""How an RL step samples: :class:`SamplingConfig`, the one place a step's settings become a
:class:`~jaxrl_sym.generation.GenerationConfig`. JAX-free (the ``train`` CLI checks it first).

Why one place: the step's sampling, partial rollouts' segments and the greedy evaluation each
built their own ``GenerationConfig``, with two seed rules (31-bit mask in the step, the raw seed
in the first partial segment). Now every RL generation request comes from here, with one rule:
:func:`step_seed32`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from jaxrl_sym.errors import InputError
from jaxrl_sym.generation import GenerationConfig, as_int

SEED_BITS = 0x7FFFFFFF


def step_seed32(seed: Any) -> int:
    """The sampling seed of an RL generation call: the low 31 bits of ``seed``. Why 31 and
    not :func:`~jaxrl_sym.generation.seed32`'s 32: derived seeds (partial segments, the
    training loop's per-step seeds) are computed in 31 bits, and a request's seed must be one of
    them whatever path made it, so the plain step and a partial step's first segment sample the
    same tokens for the same seed."""
    return as_int(seed, "seed") & SEED_BITS


@dataclass(frozen=True)
class SamplingConfig:
    """What a step's generation asks for: the sampling knobs of an
    :class:`~jaxrl_sym.rl.knobs.AlgorithmConfig` (:meth:`of`; no defaults of its own: a knob has
    one default, the AlgorithmConfig field's).

    group_size: generations per prompt (G). temperature: sampling temperature (> 0: RL needs
    log-probs of sampled tokens). max_new_tokens: default response limit per row (a row also
    ends at ``eos_id``; a step may give per-row limits).
    """

    group_size: int
    temperature: float
    max_new_tokens: int
    eos_id: int | tuple[int, ...] | None

    def __post_init__(self) -> None:
        if self.group_size < 1:
            raise InputError(f"group_size={self.group_size} (--group) must be >= 1")
        if self.temperature <= 0:
            raise InputError(f"temperature={self.temperature}: RL samples, so it must be "
                             "> 0 (greedy decoding has no log-probs to take a ratio of)")
        if self.max_new_tokens < 1:
            raise InputError(f"max_new_tokens={self.max_new_tokens} must be >= 1")

    @classmethod
    def of(cls, cfg: Any) -> SamplingConfig:
        """The sampling fields of ``cfg`` (an :class:`~jaxrl_sym.rl.knobs.AlgorithmConfig`)."""
        return cls(**{f.name: getattr(cfg, f.name) for f in fields(cls)})

    def generation(self, seed: Any, max_new_tokens: int | tuple[int, ...] | None = None
                   ) -> GenerationConfig:
        """The request for sampling with ``seed`` (:func:`step_seed32`), each row up to
        ``max_new_tokens`` (one for all rows or one per row; default: the config's)."""
        limit = self.max_new_tokens if max_new_tokens is None else max_new_tokens
        return GenerationConfig(max_new_tokens=limit, eos_id=self.eos_id,
                                temperature=self.temperature, seed=step_seed32(seed))

    def greedy(self, max_new_tokens: int) -> GenerationConfig:
        """The request for greedy evaluation (temperature 0: no seed matters)."""
        return GenerationConfig(max_new_tokens=max_new_tokens, eos_id=self.eos_id,
                                temperature=0.0)
