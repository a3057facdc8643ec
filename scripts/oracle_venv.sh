#!/usr/bin/env bash
# Create .venv-oracle: transformers + peft on torch's CPU build, the oracle that
# tests/hf_oracle.py runs in a process of its own (it shares no code with jaxrl_sym).
# Why a second interpreter: the CPU build of torch this machine kind carries on disk is for
# Python 3.11 (PyPI's for 3.12 is a CUDA build of several GB); the project itself is 3.12.
# Idempotent: re-installs only when the pins below change. `make test HF_ORACLE=skip` skips it.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=.venv-oracle
PINS="torch==2.13.0 transformers==5.24.0 peft==0.21.2 accelerate==1.15.0 gguf==0.19.0 \
tokenizers==0.23.3 safetensors==0.8.0 numpy==2.4.6"

find_python() {
  for c in python3.11 /root/.pyenv/versions/3.11*/bin/python /usr/bin/python3.11; do
    if command -v "$c" >/dev/null 2>&1 && "$c" 2>/dev/null -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
      command -v "$c"; return 0
    fi
  done
  return 1
}

if [ -x "$VENV/bin/python" ] && [ "$(cat "$VENV/.pins" 2>/dev/null)" = "$PINS" ]; then
  exit 0
fi
py=$(find_python) || {
  echo "error: the transformers/peft oracle needs Python 3.11 (torch's CPU wheel); install it," \
       "or run the tests without the oracle: make test HF_ORACLE=skip" >&2; exit 1; }
echo "creating $VENV with $py (torch CPU, transformers, peft)"
rm -rf "$VENV"
"$py" -m venv "$VENV"
# shellcheck disable=SC2086
# (pip's "Location ... is ignored" lines about this machine's empty local indexes are dropped)
"$VENV/bin/python" -m pip install -q --disable-pip-version-check $PINS 2>&1 | grep -v "is ignored" || true
"$VENV/bin/python" -c "import torch, transformers, peft"
echo "$PINS" > "$VENV/.pins"
