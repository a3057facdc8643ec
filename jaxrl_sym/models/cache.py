"""Functional KV caches for the baselines (pytrees, so they flow through jit/scan as arguments).

The baselines keep them *outside* the model (:mod:`jaxrl_sym.models.traced` gives every
``attend`` call of any contract model one cache, shaped from that call's traced keys/values with
:meth:`PaddedKVCache.like` / :meth:`ExactKVCache.like`). No model takes them as arguments, the
library's own :class:`~jaxrl_sym.models.lm.DecoderLM` included, so they are built from traced
keys/values rather than from any model config. Two layouts, matching what JAX decoding code does
today:

* :class:`PaddedKVCache` is preallocated at ``MAX_LEN`` slots and written in place with
  ``lax.dynamic_update_slice``; one compiled program serves every step, but every step attends over
  all ``MAX_LEN`` slots (empty ones masked by ``pos = -1``). That masked work and memory is the
  padded baseline's cost.
* :class:`ExactKVCache` grows by concatenation, so its length is always exact; the price is a new
  shape (an XLA recompile) at every length. That is the per-shape baseline's cost.

Both store keys *after* RoPE, together with each slot's token position and segment id: attention
masks by positions, never by slot index, so left-padded rows and unfilled slots need no extra
bookkeeping.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxrl_sym.errors import InputError


def _empty_like(k: Any, v: Any, length: int) -> tuple[jax.Array, ...]:
    """Empty k/v/pos/seg of ``length`` slots for keys ``k`` [B, T, Hkv, D] and values ``v``
    [B, T, Hkv, Dv] (arrays, tracers or shape structs: only shape and dtype are read)."""
    b = k.shape[0]
    return (
        jnp.zeros((b, length, *k.shape[2:]), k.dtype),
        jnp.zeros((b, length, *v.shape[2:]), v.dtype),
        jnp.full((b, length), -1, jnp.int32),
        jnp.zeros((b, length), jnp.int32),
    )


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class PaddedKVCache:
    """Fixed-size cache: k/v [B, L, Hkv, D], pos [B, L] int32 (-1 = empty), seg [B, L] int32."""

    k: jax.Array
    v: jax.Array
    pos: jax.Array
    seg: jax.Array

    @staticmethod
    def like(k: Any, v: Any, max_len: int) -> PaddedKVCache:
        """An empty cache of ``max_len`` slots for one attention call's keys ``k`` and values
        ``v`` (head count, head dims and dtypes taken from them, so no model config is needed).
        Every position is -1, so every slot is masked until written."""
        return PaddedKVCache(*_empty_like(k, v, max_len))

    def update(
        self,
        k_new: jax.Array,
        v_new: jax.Array,
        pos_new: jax.Array,
        seg_new: jax.Array,
        index: jax.Array | int | None,
    ) -> PaddedKVCache:
        """Write T_new entries at slots ``index .. index+T_new-1`` (``index`` may be traced).

        Like ``lax.dynamic_update_slice`` itself, an out-of-range index is clamped, so callers
        must size the cache to hold every write (the baselines do).
        """
        if index is None:
            raise InputError(
                "PaddedKVCache.update needs the slot index to write at; pass cache_index= to "
                "TracedForward.__call__ (jaxrl_sym.models.traced)"
            )
        i = jnp.asarray(index, jnp.int32)
        z = jnp.zeros((), jnp.int32)
        return PaddedKVCache(
            k=lax.dynamic_update_slice(self.k, k_new.astype(self.k.dtype), (z, i, z, z)),
            v=lax.dynamic_update_slice(self.v, v_new.astype(self.v.dtype), (z, i, z, z)),
            pos=lax.dynamic_update_slice(self.pos, pos_new.astype(jnp.int32), (z, i)),
            seg=lax.dynamic_update_slice(self.seg, seg_new.astype(jnp.int32), (z, i)),
        )

    @property
    def length(self) -> int:
        """Number of slots (the static MAX_LEN)."""
        return int(self.pos.shape[1])


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class ExactKVCache:
    """Growing cache: same fields as :class:`PaddedKVCache`, length = tokens written so far."""

    k: jax.Array
    v: jax.Array
    pos: jax.Array
    seg: jax.Array

    @staticmethod
    def like(k: Any, v: Any) -> ExactKVCache:
        """An empty cache for one attention call's keys ``k`` and values ``v`` (see
        :meth:`PaddedKVCache.like`)."""
        return ExactKVCache(*_empty_like(k, v, 0))

    def update(
        self,
        k_new: jax.Array,
        v_new: jax.Array,
        pos_new: jax.Array,
        seg_new: jax.Array,
        index: jax.Array | int | None = None,
    ) -> ExactKVCache:
        """Append T_new entries (``index`` is ignored: the write slot is always the end)."""
        del index
        return ExactKVCache(
            k=jnp.concatenate([self.k, k_new.astype(self.k.dtype)], axis=1),
            v=jnp.concatenate([self.v, v_new.astype(self.v.dtype)], axis=1),
            pos=jnp.concatenate([self.pos, pos_new.astype(jnp.int32)], axis=1),
            seg=jnp.concatenate([self.seg, seg_new.astype(jnp.int32)], axis=1),
        )

    @property
    def length(self) -> int:
        """Number of entries written so far."""
        return int(self.pos.shape[1])
