#!/usr/bin/env bash
# Runs the whole test suite (unit, multi-process gloo, end to end; GPU tests skip without CUDA).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/setup.sh"
cd "$root"
exec .venv/bin/python -m pytest "${@:-tests}"
