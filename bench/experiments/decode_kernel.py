"""Decode-attention kernel benchmark: bandwidth on live K/V bytes vs the device's copy bandwidth.

Run on a GPU machine with jax-triton: ``python -m bench decode_kernel --preset gpu [--out FILE]``
(elsewhere it says why not and exits 0). Decode
attention is memory-bound (~1 FLOP per byte of K/V), so the figure of merit is the bandwidth it
achieves on the *live* K/V bytes, next to what a plain device copy reaches in the same process: a
kernel near the copy bandwidth cannot get much faster; one far below it is latency- or
occupancy-bound (at batch 1 that is what split-K is for).

Timing (why it is done this way): timing back-to-back Python calls measures JAX's per-call dispatch
(~60 us on the first H100 run, whatever the length) and, for K/V smaller than the 50 MB L2,
reads from L2 instead of HBM. Here one jitted program chains ``n`` iterations of
``flush -> kernel``: the flush rewrites a buffer larger than L2 (evicting K/V) and each kernel's
query depends on the previous flush, so nothing is hoisted, merged or overlapped. The same chain
without the kernel is timed too; the kernel's time is the difference per iteration. Launches are
queued ahead of the GPU, so host dispatch is not in the figure; the kernel launches (split and
combine) are, as they are in a decode step. The op timed is ``triton_ops.decode_attention`` itself:
the runtime's own split policy and launch path.

Variants (``--variants``), each row measured in each, side by side: ``now`` is the kernel as the
runtime calls it (splits of at least 2 blocks, the combine in the split launch, K/V loads not
waiting on positions for a causal store); ``before`` is the layout the first H100 run measured
(splits of at least 4 blocks, a second launch for the combine, every K/V load predicated on its
position), so one run says what the batch-1 work (issue 31, item 4) bought; ``launch``,
``predicated`` and ``wide`` each undo one of the three changes, to say which one did what.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from bench import presets

if TYPE_CHECKING:  # JAX itself only once the flags are read
    import jax

FLUSH_BYTES = 128 << 20
"""Bytes rewritten between launches: 2.5x the H100's 50 MB L2 (and 2x the H200's 60 MB)."""

# heads: Hq/Hkv/D triples: MHA (GPT-2-like), GQA 4:1 (Llama-like), GQA 7:1 (Qwen2.5-0.5B)
_ALL = {"lengths": "1024,2048,4096,8192,16384,32768", "batches": "1,64",
        "dtypes": ("bfloat16", "float32"), "heads": ("16/16/64", "32/8/128", "14/2/64"),
        "iters": 30, "reps": 5, "out": None, "variants": "now,before"}
PRESETS: dict[str, dict[str, Any]] = {
    "quick": {**_ALL, "lengths": "1024", "batches": "1", "dtypes": ("bfloat16",),
              "heads": ("16/16/64",), "iters": 10, "reps": 3, "variants": "now"},
    "full": _ALL,
    "gpu": _ALL,
}


def _median_seconds(fn: Callable[[], object], reps: int) -> float:
    import jax

    jax.block_until_ready(fn())
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(nbytes: int = 1 << 30, n: int = 10, reps: int = 5) -> float:
    """Device bandwidth of a large elementwise update (read + write bytes / time), bytes/s.

    ``n`` updates chained in one program (an optimization barrier between them keeps XLA from
    fusing them into one pass), so host dispatch is not in the figure; ``x + 1`` is not folded
    away like ``x * 1``."""
    import jax
    import jax.numpy as jnp

    x = jnp.zeros((nbytes // 2,), jnp.bfloat16)

    def chain(a: jax.Array) -> jax.Array:
        for _ in range(n):
            a = jax.lax.optimization_barrier(a + jnp.asarray(1, a.dtype))
        return a

    f = jax.jit(chain)
    return 2 * x.nbytes * n / _median_seconds(lambda: f(x), reps)


def chained_seconds(
    op: Callable[..., jax.Array], q: jax.Array, operands: tuple[jax.Array, ...], n: int, reps: int,
) -> float:
    """Seconds per call of ``op(q, *operands)`` with L2 flushed before each call (module docstring).

    The operands are arguments of the timed program, never closed-over constants (a closed-over
    multi-GB store could be embedded in the executable). NaN when the difference is under 2% of
    the chain without the kernel: jitter, not a measurement (the first H100 run printed one such
    row as 0.0 us and an absurd bandwidth)."""
    import jax
    import jax.numpy as jnp

    flush = jnp.zeros((FLUSH_BYTES // 4,), jnp.float32)

    def chain(with_op: bool) -> Callable[[jax.Array, jax.Array], jax.Array]:
        def run(q: jax.Array, flush: jax.Array, *operands: jax.Array) -> jax.Array:
            for _ in range(n):
                qi = q + (flush[0] * 0).astype(q.dtype)  # depends on the previous flush
                dep = op(qi, *operands).reshape(-1)[0] if with_op else qi.reshape(-1)[0]
                flush = flush + 1.0 + dep.astype(jnp.float32) * 0  # waits for the kernel
            return flush
        return jax.jit(run)

    with_k, without = chain(True), chain(False)
    t1 = _median_seconds(lambda: with_k(q, flush, *operands), reps)
    t0 = _median_seconds(lambda: without(q, flush, *operands), reps)
    if t1 - t0 < 0.02 * t0:  # the kernel's share is inside the two medians' jitter
        return float("nan")
    return (t1 - t0) / n


VARIANTS: dict[str, dict[str, Any]] = {
    "now": {},
    "launch": {"combine": "launch"},
    "predicated": {"live_loads": False},
    "wide": {"min_blocks": 4},
    "before": {"combine": "launch", "live_loads": False, "min_blocks": 4},
}
"""``decode_attention`` keywords per variant (``min_blocks`` picks the split count). ``launch``,
``predicated`` and ``wide`` each undo one of the three batch-1 changes (the combine in the split
launch, K/V loads not waiting on positions, splits of 2 blocks): the second H100 run measured
``now`` 1.3-1.8x faster than ``before`` at 4k with many kv heads but up to 1.5x slower at 32k
with 4-7 query heads per kv head, with all three changed at once."""


@dataclass(frozen=True)
class Row:
    variant: str
    dtype: str
    hq: int
    hkv: int
    d: int
    batch: int
    length: int
    splits: int
    us: float
    kv_mb: float
    gbps: float
    pct_copy: float


def variant_op(variant: str, b: int, hkv: int, length: int) -> tuple[Callable[..., Any], int]:
    """``triton_ops.decode_attention`` over a causal store as ``variant`` calls it, and its
    split count (the runtime's own policy, or with ``min_blocks`` the first run's)."""
    from jaxrl_sym.backends import triton_ops
    from jaxrl_sym.ops.attention import Causal

    kw = dict(VARIANTS[variant])
    min_blocks = kw.pop("min_blocks", None)
    splits = (triton_ops._num_splits(b, hkv, length, 64) if min_blocks is None
              else triton_ops._num_splits(b, hkv, length, 64, min_blocks))
    return (lambda *a: triton_ops.decode_attention(*a, pattern=Causal(), num_splits=splits,
                                                   **kw)), splits


def bench_one(b: int, length: int, hq: int, hkv: int, d: int, dtype: str, copy_bw: float,
              n: int, reps: int, variant: str = "now") -> Row:
    import jax
    import jax.numpy as jnp

    dt = jnp.dtype(dtype)
    key = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(key[0], (b, hq, d), dt)
    k = jax.random.normal(key[1], (b, hkv, length, d), dt)  # the stores' heads-major layout
    v = jax.random.normal(key[2], (b, hkv, length, d), dt)
    kv_pos = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (b, length))
    q_pos = jnp.full((b,), length - 1, jnp.int32)
    n_live = jnp.full((b,), length, jnp.int32)
    op, splits = variant_op(variant, b, hkv, length)
    t = chained_seconds(op, q, (k, v, kv_pos, q_pos, n_live), n, reps)
    kv_bytes = 2 * b * length * hkv * d * dt.itemsize
    bw = kv_bytes / t
    del k, v
    return Row(variant, dt.name, hq, hkv, d, b, length, splits, t * 1e6, kv_bytes / 1e6,
               bw / 1e9, 100 * bw / copy_bw)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, every setting of the chosen preset filled in."""
    p = presets.parser("decode_kernel", __doc__, PRESETS)
    p.add_argument("--lengths", default=None, type=presets.ints(1),
                   help="comma-separated K/V lengths")
    p.add_argument("--batches", default=None, type=presets.ints(1),
                   help="comma-separated batch sizes")
    p.add_argument("--variants", default=None, type=presets.names(tuple(VARIANTS), "variant"),
                   help=f"comma-separated kernel variants, of {', '.join(VARIANTS)}")
    p.add_argument("--out", default=None, help="also write rows and the device info here (JSON)")
    return presets.parse(p, PRESETS, argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # XLA groups kernels into CUDA graphs ("command buffers"), and a Triton custom call splits a
    # graph: the chain with the kernel would pay graph launches that the chain without it does
    # not, ~30 us per call on the first H100 run. Off, both chains launch kernel by kernel, queued
    # ahead of the GPU. Must be set before the backend starts (first device query below).
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_gpu_enable_command_buffer=").strip()
    import jax

    from jaxrl_sym.backends import backend_name

    if backend_name() != "gpu":
        print(f"decode_kernel: needs a GPU with jax-triton (backend here: {backend_name()}); "
              "the interpreter is for correctness, not speed", file=sys.stderr)
        return 0
    copy_bw = copy_bandwidth()
    device = jax.devices()[0].device_kind
    print(f"device: {device}; copy bandwidth (read+write) {copy_bw / 1e9:.0f} GB/s; "
          f"L2 flushed ({FLUSH_BYTES >> 20} MiB) before every launch")
    variants = presets.csv(args.variants, str)
    print(f"{'variant':>7} {'dtype':>8} {'heads':>9} {'B':>3} {'length':>6} {'splits':>6} "
          f"{'us':>8} {'KV MB':>8} {'GB/s':>6} {'%copy':>6}")
    rows = []
    for dtype in args.dtypes:
        for heads in args.heads:
            hq, hkv, d = (int(x) for x in heads.split("/"))
            for b in presets.csv(args.batches, int):
                for length in presets.csv(args.lengths, int):
                    for variant in variants:
                        r = bench_one(b, length, hq, hkv, d, dtype, copy_bw, args.iters,
                                      args.reps, variant)
                        rows.append(r)
                        print(f"{variant:>7} {r.dtype:>8} {heads:>9} {b:>3} {length:>6} "
                              f"{r.splits:>6} {r.us:>8.1f} {r.kv_mb:>8.1f} {r.gbps:>6.0f} "
                              f"{r.pct_copy:>5.0f}%", flush=True)
    if args.out:
        info = {"device": device, "copy_gbps": copy_bw / 1e9, "flush_bytes": FLUSH_BYTES,
                "jax": jax.__version__, "date": time.strftime("%Y-%m-%d"),
                "command": presets.command("decode_kernel", argv)}
        with open(args.out, "w") as f:
            json.dump({"info": info, "rows": [asdict(r) for r in rows]}, f, indent=1)
    return 0
