#!/usr/bin/env bash
# Create ./.venv (once) and install the package with its training and test extras.
# torch is pinned to the CPU build that lies on disk here (a bare `pip install torch` would download
# a multi-GB CUDA build); the package itself only requires torch>=2.11.
# Re-running repairs what an interrupted run left: a .venv without a working pip, or one made by a Python
# older than 3.10 (pyproject's requires-python), is made again.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
py_ok() {   # $1: an interpreter; true when it runs, is 3.10+ and has pip
    "$1" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null && "$1" -m pip --version >/dev/null 2>&1
}
if [ ! -x .venv/bin/python ] || ! py_ok .venv/bin/python; then
    if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
        echo "bootstrap.sh: $PY is not Python 3.10 or newer ($("$PY" --version 2>&1 || echo 'not found')); set PYTHON=" \
             "to one that is" >&2
        exit 1
    fi
    [ -e .venv ] && echo "bootstrap.sh: .venv is unusable (interrupted or made by another Python): making it again" >&2
    rm -rf .venv
    "$PY" -m venv .venv
    py_ok .venv/bin/python || { echo "bootstrap.sh: $PY -m venv made a .venv without pip (install python3-venv)" >&2; exit 1; }
fi
stamp=.venv/.dsv41-installed
installed() {   # the package imports from outside the checkout (a manual pip uninstall leaves the stamp behind)
    (cd / && "$OLDPWD/.venv/bin/python" -c "import functional_dsv41.train" >/dev/null 2>&1)
}
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || ! installed; then
    .venv/bin/python -m pip install -q --upgrade pip
    # is there a local wheel for this Python (--no-index: find-links only)? else say that PyPI's build is coming
    if ! .venv/bin/python -m pip install -q --dry-run --no-index --no-deps "torch==2.13.0" >/dev/null 2>&1; then
        echo "bootstrap.sh: no local torch 2.13.0 wheel for $(.venv/bin/python --version): installing PyPI's" \
             "(several GB, with CUDA; for the CPU build alone run .venv/bin/python -m pip install torch==2.13.0" \
             "--index-url https://download.pytorch.org/whl/cpu first)" >&2
    fi
    .venv/bin/python -m pip install -q "torch==2.13.0"
    .venv/bin/python -m pip install -q -e ".[train,test]"
    touch "$stamp"
fi
