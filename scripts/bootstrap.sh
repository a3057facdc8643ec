#!/usr/bin/env bash
# Create .venv with Python 3.12 and install the project (editable) with test + interpreter extras
# and the Tunix peer (light install).
# Idempotent: re-installs only when pyproject.toml changed since the last install.
set -euo pipefail
cd "$(dirname "$0")/.."

find_python() {
  for c in python3.12 "$HOME/.pyenv/versions/3.12.1/bin/python" /root/.pyenv/versions/3.12*/bin/python \
           /usr/local/bin/python3.12 /usr/bin/python3.12; do
    if command -v "$c" >/dev/null 2>&1 && "$c" 2>/dev/null -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))'; then
      command -v "$c"; return 0
    fi
  done
  if command -v pyenv >/dev/null 2>&1; then
    v=$(pyenv versions --bare | grep -E '^3\.12' | head -n1 || true)
    if [ -n "$v" ]; then PYENV_VERSION="$v" pyenv which python; return 0; fi
  fi
  return 1
}

if [ ! -x .venv/bin/python ]; then
  py=$(find_python) || { echo "error: Python 3.12 not found (jax 0.11.2 needs >= 3.12); install it or put python3.12 on PATH" >&2; exit 1; }
  echo "creating .venv with $py"
  "$py" -m venv .venv
fi
stamp=.venv/.installed-$(sha1sum pyproject.toml | cut -c1-12)
if [ ! -f "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e ".[dev,interp,peers-light,track]"
  # The Tunix peer (tests/test_tunix.py, decode --systems tunix) without its trainer stack's
  # dependencies: see the peers / peers-light extras in pyproject.toml.
  .venv/bin/python -m pip install -q --no-deps google-tunix==0.1.7
  rm -f .venv/.installed-*; touch "$stamp"
fi
