"""``padded``: the padded/masked XLA baseline (:func:`~jaxrl_sym.baselines.padded.
padded_generate`) as a system — :class:`PaddedBound` generates and gives the RL step its forward
(``padded_forward`` over right-padded rows), :class:`PaddedSystem` is the RL half's value —
with its speculative form
(:func:`~jaxrl_sym.baselines.padded_speculative.padded_speculative_generate`: the same prompt
lookup draft and acceptance rule as sym's, on left-padded MAX_LEN caches).

Its work is arithmetic: ``batch × max prompt`` prefill positions, then ``max_new - 1`` decode
steps for every row (finished rows keep decoding).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import jax
import numpy as np
from flax import nnx

from jaxrl_sym.baselines.padded import padded_forward, padded_generate
from jaxrl_sym.baselines.padded_ledger import padded_ledger
from jaxrl_sym.baselines.padded_speculative import padded_speculative_generate
from jaxrl_sym.errors import InputError
from jaxrl_sym.generation import GenerationConfig, GenerationResult, row_limits
from jaxrl_sym.runtime.memory.estimate import Estimate, estimate_padded
from jaxrl_sym.runtime.memory.ledger_generation import GenerationLedger
from jaxrl_sym.systems.bound import block_work, max_limit
from jaxrl_sym.systems.forward import LogitsFn
from jaxrl_sym.systems.layout import Layout, padded_layout
from jaxrl_sym.systems.spec import BindOptions, SystemSpec
from jaxrl_sym.systems.sym import check_draft
from jaxrl_sym.systems.trainable import TrainableSystem, TrainBound
from jaxrl_sym.tracer.position_limit import PositionLimit
from jaxrl_sym.tracer.trace import model_position_limit

NO_DRAFT_MODEL = "none: the padded baseline has no draft model (plain decoding)"


class PaddedSystem(TrainableSystem):
    """The padded/masked baseline's RL half: one right-padded row per sample for every forward
    (``padded_forward``; a padded library repeats every prompt G times). It ignores
    ``pack_row_len``."""

    input_fill: ClassVar[tuple[int, ...]] = (0, 0)  # tokens, lengths (0: every slot padding)

    def bind(self, model: nnx.Module, options: BindOptions) -> PaddedBound:
        if options.speculate_adaptive:
            raise InputError(f"speculate_adaptive (--speculate-adaptive) picks k per verify on "
                             f"the symbolic runtime; system {self.name!r} verifies a fixed k "
                             "(--speculate K): drop --speculate-adaptive")
        bound = super().bind(model, options)
        assert isinstance(bound, PaddedBound)
        return bound

    def build_layout(self, prompts: Sequence[np.ndarray], responses: Sequence[np.ndarray], *,
                     row_len: int | None, share_prompts: bool = False) -> Layout:
        return padded_layout(prompts, responses)


class PaddedBound(TrainBound):
    """The padded baseline on one model (the policy's current weights, in an RL step). With
    ``speculate`` and the prompt-lookup draft it speculates as sym does, at a fixed k; with a
    draft *model* it has none and decodes plainly (its stats' ``draft`` says so), so a
    comparison against sym's draft model still runs."""

    def generate(self, prompts: Sequence[np.ndarray], cfg: GenerationConfig) -> GenerationResult:
        self._check_positions(prompts, cfg)
        k, draft = self.options.speculate, self.options.draft
        if k and isinstance(draft, str):
            return padded_speculative_generate(self.model, prompts, cfg, speculate=k)
        res = padded_generate(self.model, prompts, cfg)
        if k:
            res.stats["draft"] = NO_DRAFT_MODEL
        return res

    @functools.cached_property
    def position_limit(self) -> PositionLimit | None:
        """How far the model's position tables reach, read once per bound model (the tables'
        extents do not change with the weights)."""
        return model_position_limit(self.model)

    def _check_positions(self, prompts: Sequence[np.ndarray], cfg: GenerationConfig) -> None:
        """Refuse rows that would read past the model's position table, as sym's engine does."""
        if self.position_limit is not None:
            lens = [len(np.asarray(p).reshape(-1)) for p in prompts]
            self.position_limit.check(type(self.model).__qualname__, lens,
                                      row_limits(cfg, len(lens)))

    def estimate(self, prompt_lens: Sequence[int], cfg: GenerationConfig) -> Estimate:
        return estimate_padded(self.model, len(prompt_lens), int(max(prompt_lens)),
                               max_limit(cfg, len(prompt_lens)), cfg, name=self.name)

    def ledger(self, prompts: Sequence[np.ndarray], cfg: GenerationConfig, *,
               compiler: Callable[[Any], Any] | None = None) -> GenerationLedger | None:
        """Its one program per call at the request's shapes
        (:func:`~jaxrl_sym.baselines.padded_ledger.padded_ledger`); None when it speculates."""
        if self.options.speculate:
            return None
        return padded_ledger(self.model, prompts, cfg, compiler=compiler)

    def work(self, prompt_lens: Sequence[int], response_lens: Sequence[int],
             cfg: GenerationConfig) -> dict[str, Any]:
        return block_work(prompt_lens, response_lens, prompt_block=int(max(prompt_lens)),
                          steps=max_limit(cfg, len(prompt_lens)) - 1)


    def logits_fn(self) -> LogitsFn:
        graphdef, treedef = self.graphdef, self.treedef

        def padded_logits(leaves: list[jax.Array], inputs: tuple[jax.Array, ...]) -> jax.Array:
            model = nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, leaves))
            return padded_forward(model, inputs[0], inputs[1])

        def padded_features(leaves: list[jax.Array], inputs: tuple[jax.Array, ...]
                            ) -> jax.Array:
            model = nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, leaves))
            # padded_forward calls its model with (tokens, positions, segment ids) only
            return padded_forward(model.features, inputs[0], inputs[1])

        return self.split_forward(padded_logits, lambda: padded_features)


def bind(spec: SystemSpec, model: Any, options: BindOptions) -> PaddedBound:
    check_draft(options.draft)
    return PaddedBound(spec, model, options)
