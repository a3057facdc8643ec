#!/usr/bin/env bash
# Issue 3's GPU checks in one command, for an H100/H200 machine with jax 0.11.2 + triton 3.6
# preinstalled and no network. Before sending the tree there, fetch the jax-triton wheel here:
#   .venv/bin/pip download jax-triton==0.3.1 --no-deps -d .wheels      (.wheels is git-ignored)
# then run, carrying .wheels:   bash bench/gpu_kernels.sh
# Results land in bench/results/<device>/ (and in $OUT when the device tool provides one).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q --no-deps --no-index .wheels/jax_triton-0.3.1-*.whl 2>/dev/null || true
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null
dev=$(python -c 'import jax; print(jax.devices()[0].device_kind.replace(" ", "_"))')
out=bench/results/$dev; mkdir -p "$out"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
python -m pytest -q -m gpu tests/test_kernels_interpret.py | tee "$out/gpu_tests.txt"
python -m bench decode_kernel --preset gpu | tee "$out/kernel_bandwidth.txt"
for n in 512 1024 2048 4096 8192 16384; do
  for a in window full; do
    jaxrl-sym decode --backend triton --preset gpt2-small --attention "$a" --window 512 \
      --batch 64 --tokens "$n" --prompt-len 16:64 --systems sym,padded --json \
      > "$out/decode_${a}_${n}_b64_triton.json" || true
  done
done
[ -n "${OUT:-}" ] && cp -r "$out" "$OUT/" || true
