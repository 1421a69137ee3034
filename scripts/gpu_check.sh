#!/usr/bin/env bash
# Every CUDA and NVML check ftmaster has, in one command, for a GPU owner:
#   tests/gpu: bf16 save and resume, the distributed optimizer and its resharded checkpoint
#   (TP2xPP2 -> TP1xPP1 and DP3 on 4 GPUs, TP2 -> DP2 on 2), overlapped gradient reduce and
#   parameter gather, --no-load-optim keeping bf16 weights, the asynchronous save (a stuck
#   persistent writer given up at its deadline, or under ftmaster before its hang timeout), a CPU
#   checkpoint resumed on a GPU, an XID-free health read, NVML against nvidia-smi (GPUs,
#   UUIDs, memory), ftmaster launch relaunching a killed rank on GPUs named by UUID, the same
#   relaunch on warm workers (neither ftmaster nor a waiting worker loads libcuda), and
#   replica recovery on 4 GPUs (NCCL survivors dump, the relaunch loads the merge; also with
#   the distributed optimizer in two instances, its shards put together), the
#   memory tier's refill from device memory into its pinned slot, and its checkpoint resumed,
#   the same refill of odd-sized tensors at unaligned records (in /dev/shm and on disk), a
#   slot the driver refuses to pin refilled through the host (CUDA working after it), a
#   disk save's records written from device tensors, the CUDA RNG streams saved and
#   restored (a replica dump's from its rank's GPU), prefetched batches pinned and copied
#   to the GPU, the stragglers' compute timed between CUDA events (0 while the device has
#   not reached them; the compute so far drains the device) and a GPU slowed 2x named on 4
#   GPUs;
#   then benchmarks/nvml_vs_smi.py (NVML under load, one sample's cost against nvidia-smi's).
# Ends with a summary table naming every test. Without CUDA and without an NVIDIA driver it
# says no GPU test ran and exits 0 (nothing to check); with a driver listing GPUs that torch
# cannot use, or a torch that does not import, it fails.
#   scripts/gpu_check.sh [pytest options]     e.g. -k distributed_optimizer
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/setup.sh" || exit 1
cd "$root"
py=.venv/bin/python

if ! torch_version="$("$py" -c 'import torch; print(torch.__version__)')"; then
    echo "gpu_check: FAILED: torch does not import in $py" >&2
    exit 1
fi
if ! "$py" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    # A driver that lists GPUs while torch sees none is a broken set-up, not a CPU machine:
    # passing there would tell the GPU owner their GPUs were checked.
    if command -v nvidia-smi >/dev/null && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
        echo "gpu_check: FAILED: nvidia-smi lists GPUs but torch $torch_version sees no CUDA" \
             "device (a CPU build of torch, or CUDA_VISIBLE_DEVICES hides them all)" >&2
        exit 1
    fi
    # An installed driver that fails (a driver/library version mismatch after an upgrade
    # without a reboot, no access to /dev/nvidia*) is a GPU host that was not checked.
    if command -v nvidia-smi >/dev/null && ! smi_error="$(nvidia-smi -L 2>&1)"; then
        echo "gpu_check: FAILED: nvidia-smi is installed but fails:" \
             "$(printf '%s' "$smi_error" | head -n 1)" >&2
        exit 1
    fi
    echo "gpu_check: SKIPPED: no GPU test ran (tests/gpu, benchmarks/nvml_vs_smi.py):" \
         "torch $torch_version sees no CUDA device and no NVIDIA driver lists a GPU" \
         "(nothing to check on this machine)"
    exit 0
fi

work="$(mktemp -d -t ftmaster-gpu-check.XXXXXX)"
trap 'rm -rf "$work"' EXIT
"$py" -m pytest tests/gpu -m gpu -p no:cacheprovider -q --junitxml "$work/junit.xml" "$@"
tests_status=$?

bench_status=skipped
if command -v nvidia-smi >/dev/null; then
    if "$py" benchmarks/nvml_vs_smi.py --seconds 20 --repeats 20 | tee "$work/bench.txt"; then
        bench_status=passed
    else
        bench_status=failed
    fi
fi

"$py" - "$work/junit.xml" "$work/bench.txt" "$bench_status" <<'EOF'
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import torch

junit, bench, bench_status = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
print(f"\n== gpu_check: {torch.cuda.device_count()} GPU(s): {names}; torch {torch.__version__}, "
      f"CUDA {torch.version.cuda} ==")
rows = []  # (check, outcome, seconds or None, why skipped)
if junit.exists():
    for case in ElementTree.parse(junit).iter("testcase"):
        outcome, why = "passed", ""
        for tag, label in (("failure", "FAILED"), ("error", "ERROR"), ("skipped", "skipped")):
            found = case.find(tag)
            if found is not None:
                outcome, why = label, found.get("message", "") if tag == "skipped" else ""
        rows.append((case.get("name"), outcome, float(case.get("time", 0)), why))
rows.append(("benchmarks/nvml_vs_smi.py", bench_status, None, ""))
width = max(len(row[0]) for row in rows)
for name, outcome, seconds, why in rows:
    took = "" if seconds is None else f"{seconds:.1f} s"
    print(f"{name:{width}s}  {outcome:8s} {took:>8s}  {why}".rstrip())
if bench.exists():
    timing = [line for line in bench.read_text().splitlines() if line.startswith("nvml ")]
    print("\n".join(timing))
EOF

[ "$tests_status" -eq 0 ] && [ "$bench_status" != failed ]
