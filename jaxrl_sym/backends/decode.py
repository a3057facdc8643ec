"""Single-token decode attention by backend: which kernel a store's decode step runs, and the
call that reads only the store's live slots.

Why one table: the stores (:mod:`jaxrl_sym.passes.stores`) ask "does my backend have a kernel
for this store?" and call it the same way whatever the backend; the XLA backend has none and
runs the masked reference over every slot instead (same result).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxrl_sym.backends import pallas_ops, triton_ops
from jaxrl_sym.ops.attention import Pattern

KERNELS: dict[str, Callable[..., jax.Array]] = {
    "triton": triton_ops.decode_attention,  # jax-triton (legacy custom call on a GPU)
    "pallas": pallas_ops.here(pallas_ops.decode_attention),  # XLA's own Triton: captured
}
"""Single-token decode attention by backend name."""

WRITING: dict[str, Callable[..., Any]] = {
    "pallas": pallas_ops.here(pallas_ops.decode_attention_write),
}
"""Backends whose kernel also writes the step's entry into the store (the keys, values and
positions that are otherwise three XLA updates a layer, before the kernel reads the store)."""


def kernel_for(backend: str, pattern: Pattern, d: int, dv: int
               ) -> Callable[..., jax.Array] | None:
    """The kernel a store of ``pattern`` with head dims ``d``/``dv`` runs under ``backend``, or
    None (the masked XLA path): the backend has one, the pattern's mask is in the kernels'
    family, and (Pallas) the head dims are Triton dot tiles."""
    kernel = KERNELS.get(backend)
    if kernel is None or pattern.kernel_mask() is None:
        return None
    if backend == "pallas" and not pallas_ops.supports(d, dv):
        return None
    return kernel


def writes_entry(spec: Any) -> bool:
    """``spec``'s decode kernel writes the step's entry itself (:data:`WRITING`)."""
    return spec.decode_kernel is not None and spec.backend in WRITING


def _n_live(spec: Any, write_index: jax.Array, rows: int, capacity: int) -> jax.Array:
    """The plan's live-count expression (``spec.live``, compiled from sympy once) of the
    device-side ``write_index``, per row: one compiled program serves every step of a capacity
    bucket; a wrapped growing store (refill) holds live keys in every slot."""
    if spec.live is None:
        raise ValueError(f"store of attention node %{spec.node}: no live-count function planned")
    (live,) = spec.live(write_index)
    return jnp.full((rows,), jnp.minimum(live, capacity), jnp.int32)


def write_and_attend(spec: Any, store: dict[str, jax.Array], q: jax.Array, k: jax.Array,
                     v: jax.Array, q_pos: jax.Array, k_pos: jax.Array, slot: jax.Array,
                     write_index: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    """One decode step's write of ``k, v, k_pos`` (``[B, 1, ...]``) at ``slot`` and its
    attention over the live slots, in the backend's one kernel (:data:`WRITING`); returns
    ``([B, 1, Hq, Dv], the store)``."""
    b, cap = store["pos"].shape
    out, k2, v2, p2 = WRITING[spec.backend](
        q[:, 0], k[:, 0].astype(store["k"].dtype), v[:, 0].astype(store["v"].dtype),
        k_pos[:, 0], store["k"], store["v"], store["pos"], slot.astype(jnp.int32),
        q_pos[:, 0], _n_live(spec, write_index, b, cap), **spec.scoring())
    return out[:, None], {"k": k2, "v": v2, "pos": p2}


def live_slots(spec: Any, new: dict[str, jax.Array], q: jax.Array, q_pos: jax.Array,
               write_index: jax.Array) -> jax.Array:
    """Single-token decode through ``spec``'s kernel (a
    :class:`~jaxrl_sym.passes.stores.StoreSpec`), reading only the live slots: the plan's
    live-count expression (``spec.live``, compiled from sympy once) of the device-side
    ``write_index``, so one compiled program serves every step of a capacity bucket. ``new``
    already holds this step's entry; returns ``[B, 1, Hq, Dv]``."""
    n_live = _n_live(spec, write_index, q.shape[0], new["pos"].shape[1])
    out = spec.decode_kernel(q[:, 0], new["k"], new["v"], new["pos"], q_pos[:, 0], n_live,
                             **spec.scoring())
    return out[:, None]
