"""The checks every backend's kernels share: operands refused by name before a kernel sees them
(a wrong dtype or shape inside a Triton or Pallas kernel is a crash or garbage, not an error)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_sym.errors import InputError


def check_float(op: str, **arrays: jax.Array) -> None:
    dtypes = {jnp.dtype(a.dtype) for a in arrays.values()}
    for name, a in arrays.items():
        if not jnp.issubdtype(a.dtype, jnp.floating):
            raise InputError(f"{op}(): {name!r} must be floating (fp32/bf16), got {a.dtype}")
    if len(dtypes) != 1:
        raise InputError(
            f"{op}(): {', '.join(arrays)} must share one dtype, got "
            + ", ".join(f"{n}={a.dtype}" for n, a in arrays.items())
        )


def check_int32(op: str, **arrays: jax.Array) -> None:
    for name, a in arrays.items():
        if a.dtype != jnp.int32:
            raise InputError(
                f"{op}(): {name!r} must be an int32 device array (run-time lengths/positions are "
                f"read by the kernel), got {a.dtype}"
            )


def check_decode_operands(op: str, q: jax.Array, k_store: jax.Array, v_store: jax.Array,
                          kv_pos: jax.Array, q_pos: jax.Array, n_live: jax.Array) -> None:
    """A single-token decode attention's operands (q ``[B,Hq,D]``, heads-major stores, int32
    positions and live counts), refused by name when they cannot be: the one check of every
    backend's decode kernel (this module's and :mod:`jaxrl_sym.backends.pallas_ops`')."""
    check_float(op, q=q, k_store=k_store, v_store=v_store)
    check_int32(op, kv_pos=kv_pos, q_pos=q_pos, n_live=n_live)
    if q.ndim != 3 or k_store.ndim != 4 or v_store.ndim != 4:
        raise InputError(f"{op}(): want q [B,Hq,D], stores [B,Hkv,C,D]; got {q.shape}, "
                         f"{k_store.shape}, {v_store.shape}")
    b, hq, d = q.shape
    _, hkv, cap, dk = k_store.shape
    if k_store.shape[:3] != v_store.shape[:3] or dk != d or k_store.shape[0] != b:
        raise InputError(f"{op}(): shapes q{q.shape} k{k_store.shape} v{v_store.shape} disagree")
    if hq % hkv:
        raise InputError(f"{op}(): {hq} query heads is not a multiple of {hkv} kv heads")
    if kv_pos.shape != (b, cap) or q_pos.shape != (b,) or n_live.shape != (b,):
        raise InputError(f"{op}(): want kv_pos [B,C], q_pos [B], n_live [B]; got "
                         f"{kv_pos.shape}, {q_pos.shape}, {n_live.shape}")
