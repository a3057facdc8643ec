#!/usr/bin/env bash
# The wheels a lent GPU machine needs beside its image (jax 0.11.2, triton 3.6, flax, optax,
# orbax, sympy, rich; no network there): jax-triton and gguf, pure-Python, the versions this
# .venv pins. Into .wheels/ (git-ignored); the device tool carries it (carry: [".wheels"]).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || { echo "run 'make setup' first (.venv)" >&2; exit 2; }
v() { .venv/bin/python -c "import importlib.metadata as m; print(m.version('$1'))"; }
mkdir -p .wheels
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: -d .wheels \
  "jax-triton==0.3.1" "gguf==$(v gguf)"
ls .wheels
