#!/usr/bin/env bash
# Create ./.venv (once) and install the package with its training and test extras.
# torch is pinned to the CPU build that lies on disk here (a bare `pip install torch` would download
# a multi-GB CUDA build); the package itself only requires torch>=2.11.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
stamp=.venv/.dsv41-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q "torch==2.13.0"
    .venv/bin/python -m pip install -q -e ".[train,test]"
    touch "$stamp"
fi
