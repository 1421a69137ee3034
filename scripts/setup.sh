#!/usr/bin/env bash
# Idempotent set-up: .venv at the repository root, torch (kept if one is importable), then
# this package in editable mode with its test extras.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

# The interpreter: $FTMASTER_PYTHON if set, else the distribution's /usr/bin/python3 when it is
# recent enough and can make a venv, else python3 on PATH. The distribution's first because
# Debian builds it with PGO and LTO, linked statically, while pyenv's default build
# (--enable-shared, no --enable-optimizations; python3 on PATH here) ran pure Python 1.5x
# slower, and a trainer test file (7 launches) took 30-36% more CPU under it (README, Quick start).
pick_python() {
    if [ -n "${FTMASTER_PYTHON:-}" ]; then
        echo "$FTMASTER_PYTHON"
    elif /usr/bin/python3 -c 'import sys, ensurepip; sys.exit(sys.version_info < (3, 10))' \
            >/dev/null 2>&1; then
        echo /usr/bin/python3
    else
        echo python3
    fi
}

if [ ! -x .venv/bin/python ]; then
    python="$(pick_python)"
    echo "setup: creating .venv with $python ($("$python" -c 'import sys; print(sys.version.split()[0])'))" >&2
    "$python" -m venv .venv
fi
py=.venv/bin/python

if ! "$py" -c "import torch" >/dev/null 2>&1; then
    echo "setup: installing torch==2.13.0 (CPU build on machines without CUDA)" >&2
    "$py" -m pip install --quiet torch==2.13.0
fi

stamp=.venv/.ftmaster-setup-stamp
if [ ! -f "$stamp" ] || [ setup.py -nt "$stamp" ] || [ megatron/training/stream_copy.c -nt "$stamp" ]; then
    echo "setup: installing ftmaster and its dependencies" >&2
    "$py" -m pip install --quiet -e ".[test,tensorboard]"
    touch "$stamp"
fi
