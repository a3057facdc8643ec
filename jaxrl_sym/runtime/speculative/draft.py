"""A draft model for speculative decoding: a smaller NNX model that proposes the tokens.

Why a model: prompt lookup (the ``ngram`` draft) proposes well only where the output copies its
context; a small model of the same vocabulary proposes what the target would likely say anywhere
(RLHFSpec, ``../shared/seeds/004``). The draft follows the same contract as the target (it is
traced, planned and run by the same runtime) and runs on device inside the verify tile
(:func:`~jaxrl_sym.runtime.speculative.tile.model_draft`), so a verify tile is still one
dispatch.

Its stores keep the target group's row layout (row b's slot is its position plus the same
per-row offset), so they follow the target group through the prefill (the same packed prompts)
and every compaction (the same row gather). They are allocated at the group's final size when
the group starts — the draft is small, and no growth program is compiled for it.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import jax
from flax import nnx

from jaxrl_sym.errors import InputError
from jaxrl_sym.models.contract import check_model
from jaxrl_sym.passes.stores import CannotSpeculate
from jaxrl_sym.runtime.options import EngineOptions
from jaxrl_sym.runtime.plan import GenerationPlan, compile_generation
from jaxrl_sym.runtime.prefill import packed_prefill
from jaxrl_sym.runtime.programs import ProgramCache
from jaxrl_sym.tracer.trace import trace_model


@dataclasses.dataclass
class DraftModel:
    """The draft's generation plan (planned for the target's speculation: its ring/block
    stores ``speculate`` slots larger, as the target's are) and its weights."""

    plan: GenerationPlan
    leaves: list[Any]
    name: str
    cache: ProgramCache = dataclasses.field(default_factory=ProgramCache)  # its hoisting
    _hoisted: tuple[jax.Array, ...] | None = None

    @staticmethod
    def build(model: nnx.Module, target: GenerationPlan) -> DraftModel:
        """Trace and plan ``model`` as a draft for ``target`` (its mesh, its initial store
        capacity, its speculation); refuse what cannot draft for it."""
        name = type(model).__name__
        check_model(model)
        program, _, state = trace_model(model)
        vocab = int(program.pdg.node(program.pdg.outputs[0]).shape[-1])
        if vocab != target.vocab_size:
            raise InputError(
                f"draft model {name} has a vocabulary of {vocab} tokens, the target "
                f"{target.vocab_size}: a draft must share the target's tokenizer (same vocab)")
        options = EngineOptions(min_capacity=target.options.min_capacity)
        try:
            plan = compile_generation(program, options, mesh=target.mesh,
                                      speculation=target.speculation)
        except CannotSpeculate:
            raise InputError(
                f"draft model {name} has linear attention: its recurrent state cannot take "
                "back a rejected draft; use a draft with softmax attention or draft='ngram'"
            ) from None
        return DraftModel(plan, plan.place(jax.tree_util.tree_leaves(state)), name)

    def hoisted(self) -> tuple[jax.Array, ...]:
        if self._hoisted is None:
            self._hoisted = self.plan.hoist(self.cache, self.leaves)[0]
        return self._hoisted

    @staticmethod
    def capacity(total: int, speculate: int) -> int:
        """Slots of the draft's growing stores for a group that can need ``total``: a verify
        writes up to ``speculate`` + 1 past the last emitted token (later writes drop)."""
        return total + speculate + 1

    def init(self, cache: ProgramCache, rows: int, capacity: int) -> dict:
        build = lambda: jax.jit(self.plan.builder.init_stores, static_argnums=(0, 1)).lower(
            rows, capacity).compile()
        return cache.run(("draft_init", self.name, rows, capacity), build)

    def prefill(self, cache: ProgramCache, stores: dict, arrays: tuple[Any, ...], *,
                chunk_rows: int) -> dict:
        """Fill the draft's stores from the target group's packed prompts (``arrays``: tokens,
        positions, rows, slots, last, copies, row ids, seed); its sampled token is unused."""
        args = (self.hoisted(), stores, *arrays)
        fn = partial(packed_prefill, self.plan.builder, temperature=0.0, want_logits=False,
                     chunk_rows=chunk_rows)
        key = ("draft_prefill", self.name, arrays[0].shape, arrays[5].shape, chunk_rows,
               _caps(stores))
        out = cache.run(key, lambda: jax.jit(fn, donate_argnums=(1,)).lower(*args).compile(),
                        *args)
        return out[0]

    def compact(self, cache: ProgramCache, stores: dict, keep: Any, filler: Any, pos0: Any,
                row_ids: Any) -> dict:
        """The target's compaction, applied to the draft's stores (same rows kept)."""
        args = (stores, keep, filler, pos0, row_ids)
        key = ("draft_compact", self.name, len(pos0), len(keep), _caps(stores))
        out = cache.run(key, lambda: jax.jit(self.plan.builder.compact).lower(*args).compile(),
                        *args)
        return out[0]


def _caps(stores: dict) -> tuple:
    return tuple(sorted((k, s["pos"].shape[1]) for k, s in stores.items() if "pos" in s))
