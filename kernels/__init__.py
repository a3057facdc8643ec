"""Triton kernels behind :mod:`jaxrl_sym.backends.triton_ops`.

The kernel modules (``decode_attention``, ``packed_attention``, ``linear_attention``) import
``triton`` at import time and decorate with ``@triton.jit``. Triton decides *at decoration time*
whether a kernel is compiled (``JITFunction``) or interpreted on the CPU (``InterpretedFunction``,
when ``TRITON_INTERPRET=1``), so those modules must only be imported through
:func:`jaxrl_sym.backends.launch.import_kernels`, which picks the mode first. This package file
itself imports nothing from Triton, so ``import kernels`` is always safe.

Conventions shared by every kernel here (WHY they look the way they do):

* Run-time lengths (live slots, query positions, ``cu_seqlens``) are *pointers* to int32 device
  arrays read with ``tl.load``. jax-triton bakes Python scalars into the compiled XLA program, so a
  per-step length passed as an int would recompile every step.
* Shapes (capacity, heads, head dim) and block sizes are ``tl.constexpr``: they are static in XLA
  anyway, and making them compile-time lets Triton fold the address arithmetic.
* Grids are sized from capacities (static) and programs exit early / loop over a run-time range.
* Inputs may be fp32 or bf16; every reduction accumulates in fp32. ``F32_DOT`` selects fp32
  ``tl.dot`` operands at ``tf32x3`` precision (three TF32 tensor-core products: ~fp32 accuracy,
  where plain TF32's 10-bit mantissa would miss a 1e-4 tolerance, and without the huge unrolled
  FMA code an "ieee" dot of a 64x128 tile compiles to). It is used for fp32 inputs and under
  Triton's CPU interpreter, whose ``tl.dot`` multiplies bf16 inputs as raw uint16 bits (the
  interpreter ignores the precision and multiplies in fp32). Otherwise bf16 operands go to the
  tensor cores with fp32 accumulation.
"""

from __future__ import annotations

LOG2E = 1.4426950408889634
"""log2(e): the kernels run their softmax in base 2 (``exp2`` is a single MUFU instruction)."""

__all__ = ["LOG2E"]
