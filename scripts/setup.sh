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

# Debian's venv links bin/python before ensurepip fails (no python3-venv), and leaves the rest
if [ -x .venv/bin/python ] && ! .venv/bin/python -m pip --version >/dev/null 2>&1; then
    echo "setup: .venv has no pip (its creation failed halfway): making it again" >&2
    rm -rf .venv
fi
if [ ! -x .venv/bin/python ]; then
    python="$(pick_python)"
    if ! "$python" -c 'import ensurepip' >/dev/null 2>&1; then
        echo "setup: $python cannot make a virtual environment with pip (no ensurepip):" \
             "install python3-venv (apt install python3-venv) or set FTMASTER_PYTHON" >&2
        exit 1
    fi
    echo "setup: creating .venv with $python ($("$python" -c 'import sys; print(sys.version.split()[0])'))" >&2
    "$python" -m venv .venv
fi
py=.venv/bin/python

if ! "$py" -c "import torch" >/dev/null 2>&1; then
    echo "setup: installing torch==2.13.0 (CPU build on machines without CUDA)" >&2
    "$py" -m pip install --quiet torch==2.13.0
fi

stamp=.venv/.ftmaster-setup-stamp
# The refill's C loop is built when a compiler and Python's headers (python3-dev) are there:
# one installed since builds it then. Without the headers the optional build fails quietly,
# and is not tried again at every run.
built() { compgen -G "megatron/training/_stream_copy*.so" >/dev/null; }
can_build() {
    command -v cc >/dev/null && "$py" -c 'import os, sys, sysconfig
sys.exit(not os.path.isfile(os.path.join(sysconfig.get_paths()["include"], "Python.h")))'
}
if [ ! -f "$stamp" ] || [ setup.py -nt "$stamp" ] || [ megatron/training/stream_copy.c -nt "$stamp" ] \
        || { ! built && can_build; }; then
    echo "setup: installing ftmaster and its dependencies" >&2
    "$py" -m pip install --quiet -e ".[test,tensorboard]"
    touch "$stamp"
fi
