"""Any contract model as a cached decoder: the traced forward the baselines decode with.

The contract gives the library a model called as ``model(tokens, positions, segment_ids)`` and
nothing more: no config to read the layer count or head shapes from, no cache arguments. A
baseline that decodes token by token still has to keep each attention call's keys and values
between calls. It does so the way Flax decode examples and Tunix do (one cache per attention call,
masked by the cached positions), but without touching the model:

1. :func:`trace_forward` traces the unmodified model once at a concrete ``[B, T]``, its weights as
   jaxpr *inputs* (so no parameter is baked into the program as a constant, and new weights need
   no re-trace).
2. :meth:`TracedForward.__call__` evaluates that jaxpr with
   :func:`jaxrl_sym.tracer.flatten.eval_jaxpr`, which inlines calls and unrolls ``lax.scan`` /
   ``fori_loop`` over layers and hands every ``attend`` call, in execution order, to a hook. The
   hook writes the call's keys, values, positions and segment ids into that call's cache and
   attends over the whole cache instead. The cache's own ``update`` decides the layout: a
   :class:`~jaxrl_sym.models.cache.PaddedKVCache` writes at a slot (MAX_LEN slots, the padded
   baseline), an :class:`~jaxrl_sym.models.cache.ExactKVCache` appends (the per-shape baseline).

Caches are shaped from the traced keys/values of each call, so any head count, head dim or dtype
per layer works, and they are carried functionally (passed in, returned), so a decode loop around
them stays one ``lax.scan`` in one compiled program.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.extend import core as jcore

from jaxrl_sym.errors import InputError, source_line
from jaxrl_sym.models.cache import ExactKVCache, PaddedKVCache
from jaxrl_sym.models.contract import check_model
from jaxrl_sym.ops.attention import attention_p
from jaxrl_sym.tracer.flatten import eval_jaxpr

KVCache = PaddedKVCache | ExactKVCache
CacheFactory = Callable[[jax.Array, jax.Array], KVCache]
"""``new_cache(k, v)``: an empty cache for one attention call's keys [B, T, Hkv, D] and values."""


@dataclass(frozen=True)
class TracedForward:
    """A model's forward traced at one concrete ``[batch, length]``, weights as inputs.

    jaxpr: inputs are the leaves of ``nnx.split(model)[1]`` followed by tokens, positions and
      segment ids; its one output is the logits [batch, length, vocab].
    """

    jaxpr: jcore.ClosedJaxpr
    model_name: str

    @property
    def vocab_size(self) -> int:
        """The last dimension of the traced logits (the model's vocabulary)."""
        return int(self.jaxpr.out_avals[0].shape[-1])

    def __call__(
        self,
        state: Any,
        tokens: jax.Array,
        positions: jax.Array,
        segment_ids: jax.Array,
        caches: Sequence[KVCache] | None,
        *,
        new_cache: CacheFactory,
        cache_index: jax.Array | int | None = None,
    ) -> tuple[jax.Array, tuple[KVCache, ...]]:
        """Logits and the updated caches, one per attention call in execution order.

        state: the model's ``nnx.State`` (same structure as when traced). caches: ``None`` on the
        first call (prefill): each attention call then starts from ``new_cache(k, v)``.
        cache_index: slot of this call's first entry in a padded cache (ignored when appending).
        Pure JAX: runs eagerly, under ``jax.jit`` and inside ``lax.scan``.
        """
        written: list[KVCache] = []

        def cached_attend(index: int, eqn: Any, invals: list[Any]) -> jax.Array:
            q, k, v, q_pos, k_pos, q_seg, k_seg = invals
            if k.shape[1] != q.shape[1]:
                raise InputError(
                    f"{self.model_name}: attend at {source_line(eqn)} reads {k.shape[1]} "
                    f"keys for {q.shape[1]} queries; a cached decoder stores each call's own "
                    "keys, so keys and values must come from the same tokens as the queries")
            if caches is None:
                cache = new_cache(k, v)
            elif index < len(caches):
                cache = caches[index]
            else:
                raise self._count_error(len(caches), index + 1)
            cache = cache.update(k, v, k_pos, k_seg, cache_index)
            written.append(cache)
            # Every param of the call (pattern, scale, any the primitive gains) passes through.
            return attention_p.bind(q, cache.k, cache.v, q_pos, cache.pos, q_seg, cache.seg,
                                    **eqn.params)

        args = [*jax.tree_util.tree_leaves(state), tokens, positions, segment_ids]
        (logits,) = eval_jaxpr(self.jaxpr, args, cached_attend)
        if caches is not None and len(written) != len(caches):
            raise self._count_error(len(caches), len(written))
        return logits, tuple(written)

    def _count_error(self, cached: int, called: int) -> InputError:
        shape = tuple(self.jaxpr.in_avals[-1].shape)
        return InputError(
            f"{self.model_name} called attend {called}{'+' if called > cached else ''} times on "
            f"{list(shape)} tokens but {cached} times in the forward that filled its caches; the "
            "cached baselines keep one cache per attention call, so the number of attend calls "
            "must not depend on the batch or sequence length")


def trace_forward(model: nnx.Module, batch: int, length: int) -> TracedForward:
    """Trace ``model`` at ``[batch, length]`` (no FLOPs, no compile), checking the contract
    first (:func:`~jaxrl_sym.models.contract.check_model`: errors name the model's class)."""
    info = check_model(model)
    graphdef, state = nnx.split(model)
    spec = jax.ShapeDtypeStruct((batch, length), jnp.int32)
    fn = lambda st, t, p, s: nnx.merge(graphdef, st)(t, p, s)
    return TracedForward(jax.make_jaxpr(fn)(state, spec, spec, spec), info.name)


def vocab_size(model: nnx.Module) -> int:
    """The model's vocabulary, read from an abstract evaluation of its logits (no compile)."""
    return check_model(model).vocab_size
