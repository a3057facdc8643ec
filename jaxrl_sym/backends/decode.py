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
    "pallas": pallas_ops.decode_attention_here,  # XLA's own Triton kernel: CUDA-graph captured
}
"""Single-token decode attention by backend name."""


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


def live_slots(spec: Any, new: dict[str, jax.Array], q: jax.Array, q_pos: jax.Array,
               write_index: jax.Array) -> jax.Array:
    """Single-token decode through ``spec``'s kernel (a
    :class:`~jaxrl_sym.passes.stores.StoreSpec`), reading only the live slots: the plan's
    live-count expression (``spec.live``, compiled from sympy once) of the device-side
    ``write_index``, so one compiled program serves every step of a capacity bucket. ``new``
    already holds this step's entry; returns ``[B, 1, Hq, Dv]``."""
    if spec.live is None:
        raise ValueError(f"store of attention node %{spec.node}: no live-count function planned")
    (live,) = spec.live(write_index)
    # a wrapped growing store (refill) holds live keys in every slot
    n_live = jnp.full((q.shape[0],), jnp.minimum(live, new["pos"].shape[1]), jnp.int32)
    out = spec.decode_kernel(q[:, 0], new["k"], new["v"], new["pos"], q_pos[:, 0], n_live,
                             **spec.scoring())
    return out[:, None]
