"""Kernel backends behind the runtime's backend seam.

``triton_ops`` holds the JAX-facing Triton operations (decode attention over a slot store, packed
varlen attention with a custom VJP, linear attention decode and packed forms); ``launch`` is the one
place that runs a Triton kernel, through jax-triton on a GPU or Triton's interpreter on the CPU.
``pallas_ops`` holds the decode attention as a Pallas kernel (XLA's own Triton: captured in CUDA
graphs); ``decode`` picks a store's decode kernel by backend; ``operands`` holds the operand checks
they share. Importing this package imports
neither triton nor jax-triton.
"""

from __future__ import annotations

from jaxrl_sym.backends.launch import backend_name, triton_available

__all__ = ["backend_name", "triton_available"]
