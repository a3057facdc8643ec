"""Registers and spill bytes per thread of the decode split kernel, as an H100 would run it.

No GPU needed: each configuration the GPU plan's kernel item times (``bench decode_kernel
--variants ...``, batch 1) is compiled for sm_90a by Triton here and its PTX assembled with
Triton's bundled ``ptxas -v``. Registers bound occupancy (65,536 per SM: at 255 per thread a
4-warp program leaves room for 2 programs per SM) and spills turn register traffic into local
memory traffic — for a memory-bound kernel both decide how many bytes are in flight.

    .venv/bin/python scripts/kernel_registers.py [--out FILE.md]

The kernel launches are captured by replacing ``launch.launch`` for the duration of the call
(as ``tests/test_kernels_interpret.py``'s sm_90 compile test does): nothing runs.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.pop("TRITON_INTERPRET", None)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from bench.experiments.decode_kernel import VARIANTS, variant_op  # noqa: E402
from jaxrl_sym.backends import launch as L  # noqa: E402

PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
TYPES = {"float32": "fp32", "bfloat16": "bf16", "int32": "i32"}


def split_kernel_call(variant: str, dtype: str, heads: str, length: int) -> tuple:
    """The split kernel's launch (kernel, dtypes, constexprs, warps, stages) at batch 1."""
    hq, hkv, d = (int(x) for x in heads.split("/"))
    calls = []

    def record(kernel, *, grid, inputs, out_shapes, constexprs, num_warps=4, num_stages=2, **kw):
        calls.append((kernel, [x.dtype for x in inputs] + [s.dtype for s in out_shapes],
                      dict(constexprs), num_warps, num_stages))
        return tuple(jnp.zeros(s.shape, s.dtype) for s in out_shapes)

    dt = jnp.dtype(dtype)
    f = lambda *s: jax.ShapeDtypeStruct(s, dt)
    i = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
    with mock.patch.object(L, "launch", record), \
            mock.patch.object(L, "backend_name", lambda: "gpu"), \
            mock.patch.object(L, "import_kernels",
                              lambda n: importlib.import_module("kernels." + n)):
        op, splits = variant_op(variant, 1, hkv, length)
        jax.eval_shape(op, f(1, hq, d), f(1, length, hkv, d), f(1, length, hkv, d),
                       i(1, length), i(1), i(1))
    return (*calls[0], splits)


def registers(kernel, dtypes, consts, warps, stages) -> tuple[int, int]:
    """(registers per thread, spill-store bytes) from ``ptxas -v`` for sm_90a."""
    ptrs = [a for a in kernel.arg_names if a not in consts]
    sig = {a: "constexpr" if a in consts else "*" + TYPES[jnp.dtype(dtypes[ptrs.index(a)]).name]
           for a in kernel.arg_names}
    c = triton.compile(ASTSource(kernel, sig, consts), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": warps, "num_stages": stages})
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "k.ptx"
        ptx.write_text(c.asm["ptx"])
        info = subprocess.run([str(PTXAS), "-v", "--gpu-name", "sm_90a", str(ptx), "-o",
                               str(Path(tmp) / "k.cubin")], capture_output=True, text=True,
                              check=True).stderr
    regs = re.search(r"Used (\d+) registers", info)
    spill = re.search(r"(\d+) bytes spill stores", info)
    return int(regs.group(1)) if regs else -1, int(spill.group(1)) if spill else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="also write the table here (markdown)")
    args = p.parse_args()
    lines = ["| dtype | heads q/kv/d | length | variant | splits | registers | spill B |",
             "|---|---|---:|---|---:|---:|---:|"]
    for dtype in ("bfloat16", "float32"):
        for heads in ("16/16/64", "32/8/128", "14/2/64"):
            for length in (4096, 32768):
                for variant in VARIANTS:
                    *call, splits = split_kernel_call(variant, dtype, heads, length)
                    regs, spill = registers(*call)
                    lines.append(f"| {dtype} | {heads} | {length} | {variant} | {splits} | "
                                 f"{regs} | {spill} |")
                    print(lines[-1], flush=True)
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
