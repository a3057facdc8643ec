#!/usr/bin/env bash
# The optional packages bench/lib/projection/xla_gpu.py needs to compile for an H100 on a machine without a
# GPU (never imported by the library, not in .venv): jax's CUDA PJRT plugin matching jaxlib, and
# the CUDA 12.9 nvcc wheel for ptxas and libdevice. ~590 MB into .gpu-compile/.
set -euo pipefail
cd "$(dirname "$0")/.."
ver=$(.venv/bin/python -c "import jaxlib; print(jaxlib.__version__)")
.venv/bin/pip install -q --target .gpu-compile --no-deps \
  "jax-cuda12-plugin==$ver" "jax-cuda12-pjrt==$ver" "nvidia-cuda-nvcc-cu12==12.9.86"
echo "installed into .gpu-compile/ (jax-cuda12 $ver, nvcc 12.9.86)"
