#!/usr/bin/env bash
# Idempotent set-up: .venv at the repository root, torch (kept if one is importable), then
# this package in editable mode with its test extras.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

if [ ! -x .venv/bin/python ]; then
    echo "setup: creating .venv" >&2
    python3 -m venv .venv
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
