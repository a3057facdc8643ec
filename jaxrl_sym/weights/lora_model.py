"""A contract model that runs LoRA unmerged: the frozen base and the adapters are its weights,
every targeted ``x @ W`` is ``x @ W + scale · (x @ A) @ B``.

Why: with the adapters merged (``W + scale · A @ B``), every forward — generation's decode steps,
the reference, scoring — reads a merged copy of the model beside the frozen base: at Qwen2.5-0.5B
in bf16 that is 0.99 GB held through generation, the stage where both systems' RL-step peaks sit
on the H100 (``bench/results/nvidia-h100-80gb-hbm3/2026-11-27/README.md``). A runtime that takes
*this* model instead holds the base once and the adapters (a few MB); a decode step pays two
``[tokens, rank]`` products per target, nothing against reading the weights.

How, for any contract model: :class:`LoraModel` is itself a contract model (``model(tokens,
positions, segment_ids) -> logits``; ``features``/``head`` when the base has them) whose call
runs the base model through :func:`~jaxrl_sym.weights.lora_apply.lora_call` — the base's own
jaxpr with each targeted product rewritten — so the symbolic tracer, the padded baseline and
the update's gradient all see the low-rank path as ordinary operations. Its leaves are
:func:`lora_leaves`: the adapters' ``a``, ``b`` in target order, then the base's leaves.
With ``B = 0`` it equals the base model exactly (the reference: adapters off).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl_sym.weights.lora import Adapter, LoraPlan
from jaxrl_sym.weights.lora_apply import lora_call

__all__ = ["LoraModel", "lora_leaves", "lora_model", "zero_adapters"]


def lora_leaves(adapters: Sequence[Adapter], base_leaves: Sequence[Any]) -> list[Any]:
    """The flat leaves of a :class:`LoraModel` (``nnx.split``'s order: ``adapters`` sorts
    before ``base``; each adapter's ``a`` before its ``b``)."""
    return [x for ad in adapters for x in (ad["a"], ad["b"])] + list(base_leaves)


def zero_adapters(plan: LoraPlan, dtype: Any) -> list[Adapter]:
    """Adapters that add exactly nothing (``A = B = 0``): the base model's own forward."""
    return [{"a": jnp.zeros((n_in, plan.rank), dtype), "b": jnp.zeros((plan.rank, n_out), dtype)}
            for n_in, n_out in plan.shapes]


class LoraModel(nnx.Module):
    """``base`` with ``adapters`` on ``plan``'s targets, unmerged (see the module docstring).
    ``dtype``: the compute dtype every floating leaf is cast to first (None: as they are)."""

    def __init__(self, base: nnx.Module, plan: LoraPlan, adapters: Sequence[Adapter],
                 dtype: Any = None) -> None:
        self.adapters = nnx.List([nnx.Dict(a=nnx.Param(ad["a"]), b=nnx.Param(ad["b"]))
                                  for ad in adapters])
        self.base = base
        self.plan = plan
        self.compute_dtype = None if dtype is None else jnp.dtype(dtype).name

    def _run(self, method: str, *args: Any) -> Any:
        graphdef, state = nnx.split(self.base)
        leaves, treedef = jax.tree_util.tree_flatten(state)
        adapters = [{"a": d["a"][...], "b": d["b"][...]} for d in self.adapters]

        def fn(lv: list[Any], *a: Any) -> Any:
            model = nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, lv))
            return getattr(model, method)(*a)

        return lora_call(fn, self.plan, self.compute_dtype)(leaves, adapters, *args)

    def __call__(self, tokens: jax.Array, positions: jax.Array,
                 segment_ids: jax.Array) -> jax.Array:
        return self._run("__call__", tokens, positions, segment_ids)


class LoraSplitModel(LoraModel):
    """A :class:`LoraModel` over a base with the contract's ``features``/``head`` split."""

    def features(self, tokens: jax.Array, positions: jax.Array,
                 segment_ids: jax.Array) -> jax.Array:
        return self._run("features", tokens, positions, segment_ids)

    def head(self, features: jax.Array) -> jax.Array:
        return self._run("head", features)


def lora_model(base: nnx.Module, plan: LoraPlan, adapters: Sequence[Adapter],
               dtype: Any = None) -> LoraModel:
    """The unmerged LoRA model over ``base`` (with the split where ``base`` has it)."""
    split = callable(getattr(base, "features", None)) and callable(getattr(base, "head", None))
    cls = LoraSplitModel if split else LoraModel
    return cls(base, plan, adapters, dtype)
