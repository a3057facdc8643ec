#!/usr/bin/env bash
# The GPU plan on a lent H100/H200 (bench/experiments/gpu_plan.py), in one device command:
#   bash bench/gpu_plan.sh --budget-min 8.5 --commit <sha>        (carry .wheels; results: $OUT)
# The device image has jax 0.11.2, triton 3.6, flax, optax, orbax, sympy, rich and no network;
# jax-triton and gguf travel as wheels: `bash scripts/gpu_wheels.sh` here first (.wheels/).
set -euo pipefail
cd "$(dirname "$0")/.."
ls .wheels/*.whl >/dev/null 2>&1 || { echo "no .wheels/: run scripts/gpu_wheels.sh here and carry .wheels" >&2; exit 2; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .wheels/*.whl
export PYTHONPATH="/tmp/site:$PWD" XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
out=${OUT:-bench/results/gpu_plan}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
exec python3 -m bench gpu_plan --preset gpu --out "$out" "$@"
