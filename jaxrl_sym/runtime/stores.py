"""Exact-size stores for attention keys/values, chosen by the storage plan.

Layouts (per attention node, pytrees of arrays; batch axis first so rows can be compacted):

- growing / fixed: ``k, v [B, C, Hkv, D]``, ``pos [B, C]`` (-1 = empty). Chunk written at slot
  ``write_index``; capacity C doubles (geometric) when full — a new XLA program per capacity, not
  per length.
- ring (window w) / block (b): the same arrays with C = w (resp. b) slots; step ``s`` goes to slot
  ``s mod C``. Slots are out of order; attention masks by stored *position*, so order is
  irrelevant and no contiguous copy (Tempo's 2×window trick) is needed.
- state (linear attention): ``S [B, Hkv, D, Dv]``, ``z [B, Hkv, D]`` — the recurrence of Eq. 2.

Every function here runs inside a jitted step program.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxrl_sym.ops.attention import Pattern, phi, reference_attention

Store = dict[str, jax.Array]


@dataclass(frozen=True)
class StoreSpec:
    """Concrete store layout for one attention node (static: part of the compile key)."""

    node: int
    kind: str
    capacity: int | None  # slots for ring/block/fixed; None for growing (runtime picks)
    hkv: int
    d: int
    dv: int
    dtype: Any
    pattern: Pattern
    scale: float
    softcap: float = 0.0  # attention-logit soft-capping (0 = none)
    backend: str = "xla"  # "xla" | "triton": who computes single-token decode attention

    def scoring(self) -> dict[str, Any]:
        """The attention op's keyword arguments (pattern, scale, softcap) for this store."""
        return {"pattern": self.pattern, "scale": self.scale, "softcap": self.softcap}


def init_store(spec: StoreSpec, batch: int, capacity: int) -> Store:
    if spec.kind == "state":
        return {
            "S": jnp.zeros((batch, spec.hkv, spec.d, spec.dv), jnp.float32),
            "z": jnp.zeros((batch, spec.hkv, spec.d), jnp.float32),
        }
    return {
        "k": jnp.zeros((batch, capacity, spec.hkv, spec.d), spec.dtype),
        "v": jnp.zeros((batch, capacity, spec.hkv, spec.dv), spec.dtype),
        "pos": jnp.full((batch, capacity), -1, jnp.int32),
    }


def grow_store(store: Store, capacity: int) -> Store:
    """Pad a growing store to a larger capacity (empty slots get position -1)."""
    if "pos" not in store:
        return store
    extra = capacity - store["pos"].shape[1]
    pad4 = ((0, 0), (0, extra), (0, 0), (0, 0))
    return {
        "k": jnp.pad(store["k"], pad4),
        "v": jnp.pad(store["v"], pad4),
        "pos": jnp.pad(store["pos"], ((0, 0), (0, extra)), constant_values=-1),
    }


def take_rows(store: Store, rows: jax.Array) -> Store:
    """Keep only the given rows (batch compaction when rows finish)."""
    return {k: jnp.take(v, rows, axis=0) for k, v in store.items()}


def _zeros_seg(pos: jax.Array) -> jax.Array:
    return jnp.zeros_like(pos)


def _linear_chunk(
    spec: StoreSpec, store: Store, q: jax.Array, k: jax.Array, v: jax.Array,
    q_pos: jax.Array, k_pos: jax.Array,
) -> tuple[jax.Array, Store]:
    """Linear attention for a chunk: the state covers the past, a masked sum the chunk."""
    b, c, hq, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    pq = phi(q.reshape(b, c, hkv, g, d).astype(jnp.float32))
    kvalid = (k_pos >= 0)[..., None, None]
    pk = jnp.where(kvalid, phi(k.astype(jnp.float32)), 0.0)  # b c h d
    vf = jnp.where(kvalid, v.astype(jnp.float32), 0.0)
    mask = (k_pos[:, None, :] <= q_pos[:, :, None]) & (k_pos[:, None, :] >= 0)  # b q k
    w = jnp.einsum("bqhgd,bkhd->bhgqk", pq, pk) * mask[:, None, None]
    num = jnp.einsum("bhgqk,bkhe->bqhge", w, vf) + jnp.einsum("bqhgd,bhde->bqhge", pq, store["S"])
    den = jnp.einsum("bhgqk->bqhg", w) + jnp.einsum("bqhgd,bhd->bqhg", pq, store["z"])
    den = den[..., None]
    out = jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), 0.0)
    out = jnp.where((q_pos >= 0)[:, :, None, None, None], out, 0.0)
    new = {
        "S": store["S"] + jnp.einsum("bkhd,bkhe->bhde", pk, vf),
        "z": store["z"] + jnp.sum(pk, axis=1),
    }
    return out.reshape(b, c, hq, v.shape[-1]).astype(q.dtype), new


def _write(store: Store, k: jax.Array, v: jax.Array, pos: jax.Array, slot: jax.Array) -> Store:
    """Write a contiguous run of entries at ``slot`` (in place when the store is donated)."""
    zero = jnp.zeros((), jnp.int32)
    return {
        "k": lax.dynamic_update_slice(store["k"], k.astype(store["k"].dtype),
                                      (zero, slot, zero, zero)),
        "v": lax.dynamic_update_slice(store["v"], v.astype(store["v"].dtype),
                                      (zero, slot, zero, zero)),
        "pos": lax.dynamic_update_slice(store["pos"], pos, (zero, slot)),
    }


def attend_with_store(
    spec: StoreSpec,
    store: Store,
    args: list[jax.Array],
    write_index: jax.Array,
    *,
    fresh: bool = False,
) -> tuple[jax.Array, Store]:
    """One attention node in a step program: read the store, add the chunk, return new store.

    args are the primitive's operands for the chunk: q, k, v, q_pos, k_pos, q_seg, k_seg
    ([B, c, …]); ``write_index`` is the slot of the chunk's first element (a device scalar, so
    one program serves every step). ``fresh`` (static) says the store is empty (the prompt
    chunk): attention then needs only the chunk, and the store is written in place from slot 0.
    """
    q, k, v, q_pos, k_pos = args[:5]
    c = q.shape[1]
    if spec.backend == "triton" and c == 1 and not fresh:
        return _triton_decode(spec, store, q, k, v, q_pos, k_pos, write_index)
    if spec.kind == "state":
        return _linear_chunk(spec, store, q, k, v, q_pos, k_pos)
    cap = store["pos"].shape[1]
    ring = spec.kind in ("ring", "block")
    if fresh and (not ring or c <= cap):
        out = reference_attention(q, k, v, q_pos, k_pos, _zeros_seg(q_pos), _zeros_seg(k_pos),
                                  **spec.scoring())
        m = min(c, cap)
        return out, _write(store, k[:, c - m:], v[:, c - m:], k_pos[:, c - m:],
                           jnp.zeros((), jnp.int32))
    if not ring:
        # Growing/fixed: write first, then one masked pass over the capacity.
        new = _write(store, k, v, k_pos, write_index)
        out = reference_attention(q, new["k"], new["v"], q_pos, new["pos"], _zeros_seg(q_pos),
                                  _zeros_seg(new["pos"]), **spec.scoring())
        return out, new
    if c == 1:
        new = _write(store, k, v, k_pos, write_index % cap)
        out = reference_attention(q, new["k"], new["v"], q_pos, new["pos"], _zeros_seg(q_pos),
                                  _zeros_seg(new["pos"]), **spec.scoring())
        return out, new
    # Chunk longer than one step (prefill): attend over ring ∪ chunk, then keep the chunk's tail.
    kk = jnp.concatenate([store["k"], k.astype(store["k"].dtype)], axis=1)
    vv = jnp.concatenate([store["v"], v.astype(store["v"].dtype)], axis=1)
    pp = jnp.concatenate([store["pos"], k_pos], axis=1)
    out = reference_attention(q, kk, vv, q_pos, pp, _zeros_seg(q_pos), _zeros_seg(pp),
                              **spec.scoring())
    m = min(c, cap)
    slots = (write_index + (c - m) + jnp.arange(m, dtype=jnp.int32)) % cap
    new = {
        "k": store["k"].at[:, slots].set(k[:, c - m:].astype(store["k"].dtype)),
        "v": store["v"].at[:, slots].set(v[:, c - m:].astype(store["v"].dtype)),
        "pos": store["pos"].at[:, slots].set(k_pos[:, c - m:]),
    }
    return out, new


def _triton_decode(
    spec: StoreSpec, store: Store, q: jax.Array, k: jax.Array, v: jax.Array,
    q_pos: jax.Array, k_pos: jax.Array, write_index: jax.Array,
) -> tuple[jax.Array, Store]:
    """Single-token decode through the Triton kernels: only live slots are read.

    The live count is a device value derived from ``write_index`` (growing: t+1; ring/block:
    min(t+1, capacity) — the planner's live-count expression), so one compiled program serves
    every step of a capacity bucket.
    """
    from jaxrl_sym.backends import triton_ops  # imported only when this backend is chosen

    b = q.shape[0]
    if spec.kind == "state":
        out, s_new, z_new = triton_ops.linear_decode(q[:, 0], k[:, 0], v[:, 0], store["S"],
                                                     store["z"])
        return out[:, None], {"S": s_new, "z": z_new}
    cap = store["pos"].shape[1]
    ring = spec.kind in ("ring", "block")
    new = _write(store, k, v, k_pos, write_index % cap if ring else write_index)
    live = jnp.minimum(write_index + 1, cap) if ring else write_index + 1
    n_live = jnp.full((b,), live, jnp.int32)
    out = triton_ops.decode_attention(q[:, 0], new["k"], new["v"], new["pos"], q_pos[:, 0],
                                      n_live, **spec.scoring())
    return out[:, None], new
