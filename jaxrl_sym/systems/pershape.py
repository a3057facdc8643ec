"""``pershape``: the per-shape baseline (:func:`~jaxrl_sym.baselines.pershape.
pershape_generate`: exact caches, one compile per length, a host check after every step) as a
bound system."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxrl_sym.baselines.pershape import pershape_generate
from jaxrl_sym.generation import GenerationConfig, GenerationResult
from jaxrl_sym.runtime.memory.estimate import Estimate, estimate_pershape
from jaxrl_sym.systems.bound import BoundSystem, block_work, max_limit
from jaxrl_sym.systems.spec import BindOptions, SystemSpec


class PershapeBound(BoundSystem):
    """The per-shape baseline on one model."""

    def generate(self, prompts: Sequence[np.ndarray], cfg: GenerationConfig) -> GenerationResult:
        return pershape_generate(self.model, prompts, cfg)

    def estimate(self, prompt_lens: Sequence[int], cfg: GenerationConfig) -> Estimate:
        return estimate_pershape(self.model, len(prompt_lens), int(max(prompt_lens)),
                                 max_limit(cfg, len(prompt_lens)), cfg, name=self.name)

    def work(self, prompt_lens: Sequence[int], response_lens: Sequence[int],
             cfg: GenerationConfig) -> dict[str, Any]:
        """The left-padded prompt block, then every row until the last one ends (its host
        check stops the loop there)."""
        return block_work(prompt_lens, response_lens, prompt_block=int(max(prompt_lens)),
                          steps=int(max(response_lens)) - 1)


def bind(spec: SystemSpec, model: Any, options: BindOptions) -> PershapeBound:
    return PershapeBound(spec, model, options)
