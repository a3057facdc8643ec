#!/usr/bin/env bash
# Issues 4 and 5 on an H100/H200: the full-size RL step (Qwen2.5-0.5B shape, 16 prompts x 8,
# prompts 64-512, responses log-normal median 275 capped at 1024) and the full benchmark suite
# (GPT-2-small shape, batch 64, window 512, N 512..16384; sym-xla, sym-triton, padded, per-shape).
#
# The GPU image has jax/jaxlib 0.11.2, triton 3.6, flax, optax, orbax, matplotlib, rich, sympy
# and no network; only jax-triton must be carried. Here, before sending the tree:
#   .venv/bin/pip download jax-triton==0.3.1 --no-deps -d .wheels      (.wheels is git-ignored)
# then, carrying .wheels:   bash bench/gpu_rl_suite.sh [rlft|suite|all] [--only decode ...]
#
# The suite is resumable: finished configurations live in bench/results/<device>/suite/
# results.jsonl and are skipped, so a run cut short by a per-command time limit continues where it
# stopped when that file comes back with the tree (it is copied to $OUT when the device tool sets
# one). Results land in bench/results/<device>/.
set -euo pipefail
cd "$(dirname "$0")/.."
part=${1:-all}; shift || true
python -m pip install -q --no-deps --no-index .wheels/jax_triton-0.3.1-*.whl 2>/dev/null || true
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
if [ "$part" = rlft ] || [ "$part" = all ]; then
  python -m bench rlft_step --preset gpu || true
fi
if [ "$part" = suite ] || [ "$part" = all ]; then
  python -m bench suite --preset gpu "$@" || true
fi
[ -n "${OUT:-}" ] && (cd bench/results && tar czf "$OUT/gpu_results.tgz" --exclude cpu .) || true
