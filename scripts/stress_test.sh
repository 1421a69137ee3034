#!/usr/bin/env bash
# Runs the test suite, or a named part of it, N times, idle or with every core kept busy by a
# CPU hog, and summarises the failures per test. A test that fails in any run races the
# machine: its outcome depends on how fast training runs against the monitor, the supervisor's
# poll or a timeout.
#
#   scripts/stress_test.sh [-n N] [--load] [--out DIR] [PYTEST ARGS]
#
#   -n N       runs (default 3)
#   --load     one busy process per core for the whole of every run (stress-ng when
#              installed, else a shell busy loop), at the tests' own priority
#   --out DIR  where each run's log and JUnit XML go (default: a new folder under /tmp)
#
# Examples:
#   scripts/stress_test.sh -n 10 tests/e2e/test_multinode.py::test_uneven_nodes_after_a_gpu_loss_and_an_emergency_save_on_every_node
#   scripts/stress_test.sh -n 2 --load
# Exit status: 0 when every run passed, 1 otherwise, 2 on bad arguments.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

runs=3 load=0 out=""
usage() { echo "usage: scripts/stress_test.sh [-n N] [--load] [--out DIR] [PYTEST ARGS]" >&2; exit 2; }
while [ $# -gt 0 ]; do
    case "$1" in
        -n) [ $# -ge 2 ] || usage; runs="$2"; shift 2 ;;
        --load) load=1; shift ;;
        --out) [ $# -ge 2 ] || usage; out="$2"; shift 2 ;;
        -h|--help) sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) break ;;
    esac
done
case "$runs" in ''|*[!0-9]*|0) echo "stress_test: -n needs a whole number >= 1, got '$runs'" >&2; exit 2 ;; esac
[ $# -gt 0 ] || set -- tests

"$root/scripts/setup.sh"
cd "$root"
out="${out:-$(mktemp -d /tmp/ftmaster-stress.XXXXXX)}"
mkdir -p "$out"

hog_pids=()
start_hog() {
    local cores; cores="$(nproc)"
    if command -v stress-ng >/dev/null 2>&1; then
        stress-ng --cpu "$cores" --quiet >/dev/null 2>&1 &
        hog_pids+=("$!")
    else
        for _ in $(seq "$cores"); do
            bash -c 'while :; do :; done' &
            hog_pids+=("$!")
        done
    fi
}
stop_hog() {
    [ "${#hog_pids[@]}" -gt 0 ] || return 0
    kill "${hog_pids[@]}" 2>/dev/null || true
    wait "${hog_pids[@]}" 2>/dev/null || true
    hog_pids=()
}
trap stop_hog EXIT INT TERM

# CPU and gloo runs, as in test.sh: on a GPU host their ranks would take the real GPUs
case " $* " in *tests/gpu*) ;; *) export CUDA_VISIBLE_DEVICES= ;; esac
mode=$([ "$load" = 1 ] && echo "under load ($(nproc) busy processes)" || echo "idle")
echo "stress_test: $runs run(s) $mode of: $*; results in $out" >&2
status=0
for i in $(seq "$runs"); do
    [ "$load" = 1 ] && start_hog
    started=$(date +%s)
    if .venv/bin/python -m pytest -q -p no:cacheprovider --junitxml="$out/run_$i.xml" "$@" \
            >"$out/run_$i.log" 2>&1; then code=0; else code=$?; fi
    stop_hog
    echo "$(( $(date +%s) - started ))" >"$out/run_$i.seconds"
    [ "$code" = 0 ] || status=1
    echo "stress_test: run $i/$runs exit $code in $(cat "$out/run_$i.seconds") s: $(tail -n 1 "$out/run_$i.log")" >&2
done
.venv/bin/python "$root/scripts/stress_summary.py" "$out"
exit "$status"
