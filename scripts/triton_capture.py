"""Does XLA:GPU put a jax-triton call inside a CUDA graph? Compiled for an H100 on this machine.

A loop whose body calls a Triton kernel three times between XLA fusions is compiled for the H100
without a GPU (``bench/lib/projection/xla_gpu.py``) and XLA's thunk sequence is read
(``bench/lib/projection/thunks.py``): are the custom calls inside a ``kCommandBuffer``, and what is
the custom call target? jax-triton 0.3.x lowers to the legacy ``triton_kernel_call``, 0.4.x to the
FFI target ``triton_kernel_call_ffi`` (registered command-buffer compatible by jaxlib). Which one
this process gets is whatever is first on ``sys.path``: run it once per installation, e.g.

    pip install --no-deps --target /tmp/jt31 jax-triton==0.3.1
    pip install --no-deps --target /tmp/jt41 jax-triton==0.4.1 triton==3.7.1
    PYTHONPATH=/tmp/jt31 .venv/bin/python scripts/triton_capture.py
    PYTHONPATH=/tmp/jt41 .venv/bin/python scripts/triton_capture.py

jax-triton builds the kernel at lowering time for the device it would run on; there is none
here, so the compute capability (9.0, the H100) is passed explicitly.
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(1, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    from bench.lib.projection import thunks, xla_gpu

    why = xla_gpu.unavailable()
    if why is not None:
        print(why, file=sys.stderr)
        return 2
    import jax
    import jax.numpy as jnp
    import jax_triton as jt
    import triton
    import triton.language as tl

    @triton.jit
    def add(x_ptr, y_ptr, n, o_ptr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        tl.store(o_ptr + offs, tl.load(x_ptr + offs, mask=m) + tl.load(y_ptr + offs, mask=m),
                 mask=m)

    def call(x: jax.Array, y: jax.Array) -> jax.Array:
        return jt.triton_call(x, y, x.size, kernel=add, grid=(x.size // 128,), BLOCK=128,
                              compute_capability=90,
                              out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))

    def loop(x: jax.Array, y: jax.Array) -> jax.Array:
        def body(_: int, c: jax.Array) -> jax.Array:
            c = call(c, y) * 1.5
            c = call(c, y) * 0.5 + jnp.sin(c)
            return call(c, y) * 1.5 + jnp.cos(c)
        return jax.lax.fori_loop(0, 8, body, x)

    s = jax.ShapeDtypeStruct((1024,), jnp.float32)
    with tempfile.TemporaryDirectory() as dump:
        exe = xla_gpu.compile_for(jax.jit(loop), s, s, dump_to=dump)
        tree, _ = thunks.load(dump)
    targets = sorted(set(re.findall(r'custom_call_target="([^"]+)"', exe.as_text())))
    calls = thunks.custom_calls(tree)
    print(json.dumps({"jax_triton": getattr(jt, "__version__", "?"),
                      "triton": triton.__version__, "custom_call_targets": targets,
                      "custom_calls": len(calls),
                      "inside_cuda_graph": sum(graph for _, graph in calls),
                      "counts_per_loop_iteration": vars(thunks.count(tree, 1.0))}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
