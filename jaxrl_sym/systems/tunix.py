"""The Tunix peers (``google-tunix``, optional) as bound systems:

* ``tunix``: our weights in Tunix's Qwen2, its Sampler with the smallest cache for the request;
* ``tunix-defaults``: the same at Tunix's rollout defaults (1,024-slot cache);
* ``tunix-gemma4``: Tunix's ring-cached Gemma 4 at our model's shape, its own random weights
  (:mod:`jaxrl_sym.baselines.tunix_gemma4`: speed at equal shape, tokens not comparable).

Where the package is missing, binding fails with the spec's install hint before anything runs.
Work: Tunix pads the prompts to the next power of two of the longest (:func:`geometry`) and
decodes every row until all have ended.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jaxrl_sym.baselines.tunix import PeerMissingError, TunixSystem, geometry
from jaxrl_sym.baselines.tunix_gemma4 import TunixGemma4System
from jaxrl_sym.generation import GenerationConfig, GenerationResult
from jaxrl_sym.systems.bound import BoundSystem, block_work
from jaxrl_sym.systems.spec import BindOptions, SystemSpec


class TunixBound(BoundSystem):
    """A Tunix Sampler system on one model (``peer``: no shape estimate)."""

    def __init__(self, spec: SystemSpec, model: Any, options: BindOptions,
                 build: Callable[[], TunixSystem], *, defaults: bool) -> None:
        super().__init__(spec, model, options)
        missing = spec.unavailable()
        if missing:
            raise PeerMissingError(f"system {spec.name!r} {missing}")
        try:
            self.peer = build()
        except PeerMissingError as err:
            raise PeerMissingError(f"{err}; {spec.install}") from err
        self.defaults = defaults

    def generate(self, prompts: Sequence[np.ndarray], cfg: GenerationConfig) -> GenerationResult:
        return self.peer(prompts, cfg)

    def work(self, prompt_lens: Sequence[int], response_lens: Sequence[int],
             cfg: GenerationConfig) -> dict[str, Any]:
        steps = int(max(response_lens))
        geo = geometry(prompt_lens, steps, defaults=self.defaults)
        return block_work(prompt_lens, response_lens, prompt_block=geo.prompt_len, steps=steps)


def bind(spec: SystemSpec, model: Any, options: BindOptions) -> TunixBound:
    return TunixBound(spec, model, options, lambda: TunixSystem(model), defaults=False)


def bind_defaults(spec: SystemSpec, model: Any, options: BindOptions) -> TunixBound:
    return TunixBound(spec, model, options, lambda: TunixSystem(model, defaults=True),
                      defaults=True)


def bind_gemma4(spec: SystemSpec, model: Any, options: BindOptions) -> TunixBound:
    return TunixBound(spec, model, options, lambda: TunixGemma4System(model), defaults=False)
