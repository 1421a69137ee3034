#!/usr/bin/env bash
# Runs the whole test suite (unit, multi-process gloo, end to end; GPU tests skip without CUDA).
#
# With no arguments it runs in two passes. tests/unit and tests/integration go to pytest-xdist
# workers, one per core and one more, up to 4 (FTMASTER_TEST_WORKERS overrides): most of their
# tests keep one core busy or wait on a rendezvous, and with one per core the CPU still idled 8%
# of that pass (2 cores: 874-876 s on 2 workers, 793-804 s on 3, 2026-12-05). tests/e2e and
# tests/gpu (and the warm workers' tests) then run in one process: each launch keeps every core
# busy, and their rehearsals time training against the monitor's interval and the supervisor's
# deadlines. tests/gpu runs last, on its own. The exit status is the first failing pass's.
# Every test but tests/gpu's runs with CUDA_VISIBLE_DEVICES="": they are CPU and gloo runs, and
# on a GPU host the ranks they start would take the real GPUs (NCCL, CUDA's defaults, two
# rehearsed "nodes" on the same devices, several test workers sharing them).
# With arguments it is pytest with those arguments, in one process, and CUDA_VISIBLE_DEVICES=""
# too unless they name tests/gpu.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/setup.sh"
cd "$root"
py=.venv/bin/python
# These machines set PYTHONDONTWRITEBYTECODE: without this, every process a test starts (ranks,
# their guards, torchrun, ftmaster) compiled the project's sources again, 0.15-0.3 s of CPU each.
# A file that does not compile is named here, and failed by the tests that import it.
"$py" -m compileall -q -j 0 tools megatron monitor recovery tests benchmarks pretrain_gpt.py || true
if [ $# -gt 0 ]; then
    case " $* " in *tests/gpu*) exec "$py" -m pytest "$@" ;; esac
    exec env CUDA_VISIBLE_DEVICES= "$py" -m pytest "$@"
fi

cores="$(nproc)"
workers="${FTMASTER_TEST_WORKERS:-$((cores + 1 < 4 ? cores + 1 : 4))}"
case "$workers" in ''|*[!0-9]*|0)
    echo "test.sh: FTMASTER_TEST_WORKERS needs a whole number >= 1, got '$workers'" >&2; exit 2 ;;
esac
# Warm workers wait at the scheduler's least weight (a nice-19 session, as they do beside
# training): beside another worker's tests they took over 120 s to import, so they run alone.
idle_only=tests/integration/test_warm_workers.py
status=0
# loadfile: a file's tests share one worker, so a module-scoped fixture (a reference run) runs once
on_cpu=(env CUDA_VISIBLE_DEVICES= "$py" -m pytest)
"${on_cpu[@]}" -n "$workers" --dist loadfile --ignore="$idle_only" tests/unit tests/integration \
    || status=$?
"${on_cpu[@]}" "$idle_only" tests/e2e || { rc=$?; [ "$status" -ne 0 ] || status=$rc; }
"$py" -m pytest tests/gpu || { rc=$?; [ "$status" -ne 0 ] || status=$rc; }
exit "$status"
