"""A draft model for speculative decoding: a smaller NNX model that proposes the tokens.

Why a model: prompt lookup (the ``ngram`` draft) proposes well only where the output copies its
context; a small model of the same vocabulary proposes what the target would likely say anywhere
(RLHFSpec, ``../shared/seeds/004``). The draft follows the same contract as the target (it is
traced, planned and run by the same runtime) and runs on device inside the verify tile
(:func:`~jaxrl_sym.runtime.speculative_tile.model_draft`), so a verify tile is still one
dispatch.

Its stores keep the target group's row layout (row b's slot is its position plus the same
per-row offset), so they follow the target group through the prefill (the same packed prompts)
and every compaction (the same row gather). They are allocated at the group's final size when
the group starts — the draft is small, and no growth program is compiled for it.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import jax
from flax import nnx

from jaxrl_sym.errors import InputError

if TYPE_CHECKING:
    from jaxrl_sym.runtime.engine import SymbolicLM


@dataclasses.dataclass
class DraftModel:
    """The draft's traced program and weights (a :class:`SymbolicLM` of its own, whose
    ring/block stores are planned ``speculate`` slots larger, as the target's are)."""

    lm: SymbolicLM
    name: str

    @staticmethod
    def build(model: nnx.Module, target: SymbolicLM, speculate: int) -> DraftModel:
        """Trace ``model`` as a draft for ``target``; refuse what cannot draft for it."""
        from jaxrl_sym.runtime.engine import SymbolicLM

        name = type(model).__name__
        lm = SymbolicLM(model, mesh=target.mesh, min_capacity=target.min_capacity)
        if lm.vocab_size != target.vocab_size:
            raise InputError(
                f"draft model {name} has a vocabulary of {lm.vocab_size} tokens, the target "
                f"{target.vocab_size}: a draft must share the target's tokenizer (same vocab)")
        kinds = {s.kind.name for s in lm.specs.values()}
        if "state" in kinds:
            raise InputError(
                f"draft model {name} has linear attention: its recurrent state cannot take "
                "back a rejected draft; use a draft with softmax attention or draft='ngram'")
        lm.specs = {n: dataclasses.replace(s, capacity=s.kind.speculative_capacity(s, speculate))
                    for n, s in lm.specs.items()}
        lm.builder = dataclasses.replace(lm.builder, specs=lm.specs)
        return DraftModel(lm, name)

    def hoisted(self) -> tuple[jax.Array, ...]:
        return self.lm._hoist()

    @staticmethod
    def capacity(total: int, speculate: int) -> int:
        """Slots of the draft's growing stores for a group that can need ``total``: a verify
        writes up to ``speculate`` + 1 past the last emitted token (later writes drop)."""
        return total + speculate + 1

    def init(self, cache: Any, rows: int, capacity: int) -> dict:
        build = lambda: jax.jit(self.lm.builder.init_stores, static_argnums=(0, 1)).lower(
            rows, capacity).compile()
        return cache.run(("draft_init", self.name, rows, capacity), build)

    def prefill(self, cache: Any, stores: dict, arrays: tuple[Any, ...], *, chunk_rows: int,
                shared: bool) -> dict:
        """Fill the draft's stores from the target group's packed prompts (``arrays``: tokens,
        positions, rows, slots, last, source, row ids, seed); its sampled token is unused."""
        from functools import partial

        from jaxrl_sym.runtime.prefill import packed_prefill

        args = (self.hoisted(), stores, *arrays)
        fn = partial(packed_prefill, self.lm.builder, temperature=0.0, want_logits=False,
                     chunk_rows=chunk_rows, shared=shared)
        key = ("draft_prefill", self.name, arrays[0].shape, len(arrays[4]), chunk_rows, shared,
               _caps(stores))
        out = cache.run(key, lambda: jax.jit(fn, donate_argnums=(1,)).lower(*args).compile(),
                        *args)
        return out[0]

    def compact(self, cache: Any, stores: dict, keep: Any, filler: Any, pos0: Any,
                row_ids: Any) -> dict:
        """The target's compaction, applied to the draft's stores (same rows kept)."""
        args = (stores, keep, filler, pos0, row_ids)
        key = ("draft_compact", self.name, len(pos0), len(keep), _caps(stores))
        out = cache.run(key, lambda: jax.jit(self.lm.builder.compact).lower(*args).compile(),
                        *args)
        return out[0]


def _caps(stores: dict) -> tuple:
    return tuple(sorted((k, s["pos"].shape[1]) for k, s in stores.items() if "pos" in s))
