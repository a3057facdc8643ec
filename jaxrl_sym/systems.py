"""The generation systems compared side by side, by name: one place that maps a name to a
``generate(prompts, GenerationConfig) -> GenerationResult`` on a given model.

``sym`` (or ``sym-xla`` / ``sym-triton`` / ``sym-auto``: the symbolic runtime with that backend),
``padded`` (padded/masked XLA baseline) and ``pershape`` (re-jitted per length).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from jaxrl_sym.errors import InputError
from jaxrl_sym.generation import GenerationConfig, GenerationResult

SYSTEMS = ("sym", "padded", "pershape")

Generate = Callable[[Sequence[Any], GenerationConfig], GenerationResult]


def generator(system: str, model: Any, *, backend: str = "xla",
              progress: Callable[[int], None] | None = None) -> Generate:
    """The generate function of ``system`` on ``model`` (``sym-<backend>`` overrides
    ``backend``). ``progress(tokens_so_far)`` is called as the symbolic runtime reads tokens
    back; the padded and per-shape baselines run one program per call and cannot report."""
    name, _, sub = system.partition("-")
    if name == "sym":
        from jaxrl_sym.runtime.engine import SymbolicLM

        lm = SymbolicLM(model, backend=sub or backend)
        return lambda p, c: lm.generate(p, c, on_progress=progress)
    if name == "padded" and not sub:
        from jaxrl_sym.baselines.padded import padded_generate

        return lambda p, c: padded_generate(model, p, c)
    if name == "pershape" and not sub:
        from jaxrl_sym.baselines.pershape import pershape_generate

        return lambda p, c: pershape_generate(model, p, c)
    raise InputError(f"unknown system {system!r}; choose from {', '.join(SYSTEMS)} "
                     "(sym may name a backend: sym-xla, sym-triton, sym-auto)")
