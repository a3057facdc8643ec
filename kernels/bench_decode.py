"""Decode-attention kernel benchmark: achieved KV bandwidth vs the device's copy bandwidth.

Run on a GPU machine with jax-triton: ``python -m kernels.bench_decode``. Decode attention is
memory-bound (~1 FLOP per byte of K/V), so the figure of merit is the bandwidth it achieves on the
*live* K/V bytes, next to what a plain device copy reaches: a kernel near the copy bandwidth cannot
get much faster; one far below it is latency- or occupancy-bound (at batch 1 that is what split-K
is for). Default shape is the field notes' example (16 heads, head dim 64, bf16).

Timing: the jitted op is dispatched ``--iters`` times back to back and synchronised once, so the
per-call time includes dispatch only where dispatch is slower than the kernel itself.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np


def _time(fn: Callable[[], jax.Array], iters: int, reps: int = 5) -> float:
    """Median seconds per call over ``reps`` runs of ``iters`` back-to-back calls."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = None
        for _ in range(iters):
            out = fn()
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / iters)
    return statistics.median(times)


def copy_bandwidth(nbytes: int = 1 << 30, iters: int = 20) -> float:
    """Device bandwidth of a large elementwise copy (read + write bytes / time), bytes/s."""
    x = jnp.zeros((nbytes // 2,), jnp.bfloat16)
    f = jax.jit(lambda a: a + jnp.asarray(1, a.dtype))  # x + 1: not folded away like x * 1
    t = _time(lambda: f(x), iters)
    return 2 * x.nbytes / t


def bench(
    lengths: list[int], batches: list[int], hq: int, hkv: int, d: int, iters: int,
    capacity: int | None,
) -> None:
    from jaxrl_sym.backends import triton_ops
    from jaxrl_sym.ops.attention import Causal

    dtype = jnp.bfloat16
    itemsize = jnp.dtype(dtype).itemsize
    copy_bw = copy_bandwidth()
    print(f"device: {jax.devices()[0].device_kind}; copy bandwidth {copy_bw / 1e9:.0f} GB/s")
    print(f"shape: Hq={hq} Hkv={hkv} D={d} bf16, causal; capacity = "
          f"{capacity if capacity else 'length'}")
    print(f"{'B':>4} {'length':>7} {'splits':>6} {'time us':>9} {'KV MB':>8} {'GB/s':>7} "
          f"{'% copy':>7}")
    rng = np.random.default_rng(0)
    for b in batches:
        for length in lengths:
            cap = max(capacity or length, length)
            q = jnp.asarray(rng.standard_normal((b, hq, d)), dtype)
            k = jnp.asarray(rng.standard_normal((b, cap, hkv, d)), dtype)
            v = jnp.asarray(rng.standard_normal((b, cap, hkv, d)), dtype)
            kv_pos = jnp.where(jnp.arange(cap) < length, jnp.arange(cap), -1).astype(jnp.int32)
            kv_pos = jnp.broadcast_to(kv_pos, (b, cap))
            q_pos = jnp.full((b,), length - 1, jnp.int32)
            n_live = jnp.full((b,), length, jnp.int32)
            splits = triton_ops._num_splits(b, hkv, cap, 64)
            f = jax.jit(lambda *a: triton_ops.decode_attention(*a, pattern=Causal()))
            t = _time(lambda f=f, a=(q, k, v, kv_pos, q_pos, n_live): f(*a), iters)
            kv_bytes = 2 * b * length * hkv * d * itemsize
            bw = kv_bytes / t
            print(f"{b:>4} {length:>7} {splits:>6} {t * 1e6:>9.1f} {kv_bytes / 1e6:>8.1f} "
                  f"{bw / 1e9:>7.0f} {100 * bw / copy_bw:>6.0f}%")
            del q, k, v


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    p.add_argument("--hq", type=int, default=16)
    p.add_argument("--hkv", type=int, default=16)
    p.add_argument("--d", type=int, default=64)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--capacity", type=int, default=None,
                   help="store capacity (default: equal to the length)")
    args = p.parse_args(argv)
    from jaxrl_sym.backends import backend_name

    if backend_name() != "gpu":
        print(f"bench_decode: needs a GPU with jax-triton (backend here: {backend_name()}); "
              "the interpreter is for correctness, not speed", file=sys.stderr)
        return 0
    bench(args.lengths, args.batches, args.hq, args.hkv, args.d, args.iters, args.capacity)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
