#!/usr/bin/env bash
# The main job on any machine, CPU only included: set up, then rehearse a GPU failure under
# ftmaster. 4 ranks train a small GPT at TP2 x PP2 on simulated GPUs; GPU 1's telemetry degrades
# at iteration 8 (the monitor alerts, training takes an emergency checkpoint) and its rank is
# killed at iteration 16; ftmaster replans for the 3 GPUs left and resumes from that checkpoint.
# Then the recovery report (RTO/RPO) and the monitoring analysis of the same run directory.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/setup.sh"
cd "$root"
py=.venv/bin/python
run_dir="${DEMO_RUN_DIR:-$root/demo_run}"
marker="$run_dir/.ftmaster-demo"
# Only a folder an earlier demo made (it holds the marker) is cleared; never a user's folder.
if [ -e "$run_dir" ] && [ ! -e "$marker" ]; then
    echo "demo: $run_dir exists and is not an earlier demo run; set DEMO_RUN_DIR to a new folder" >&2
    exit 2
fi
rm -rf "$run_dir"
mkdir -p "$run_dir"
touch "$marker"

model=(--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2
       --num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32
       --max-position-embeddings 32 --mock-data --vocab-size 100 --make-vocab-size-divisible-by 64
       --micro-batch-size 2 --global-batch-size 24 --train-iters 30 --lr 1e-2 --min-lr 1e-4
       --lr-warmup-iters 2 --lr-decay-style cosine --log-interval 1 --eval-iters 0
       --save "$run_dir/checkpoints" --save-interval 100 --emergency-save-gap-frac 0.05
       --distributed-timeout-minutes 0.5)

# The kill waits for the emergency save the alert asks for (after=emergency_save), so the
# rehearsal shows the whole chain on a machine of any speed.
echo "== ftmaster launch: 4 simulated GPUs, degrade GPU 1 at iteration 8, kill it at 16 once saved =="
"$py" -m ftmaster.cli launch --nproc-per-node 4 --monitor-backend sim --monitor-interval 0.2 \
    --seed 2 --run-dir "$run_dir/run" --progress-interval 3 \
    --inject degrade:gpu=1,at=iter:8 --inject fail:gpu=1,at=iter:16,after=emergency_save \
    -- pretrain_gpt.py "${model[@]}"

echo "== what it cost: ftmaster report =="
"$py" -m ftmaster.cli report "$run_dir/run"

echo "== what the GPUs did: ftmaster analyze =="
"$py" -m ftmaster.cli analyze "$run_dir/run" --out "$run_dir/analysis"
echo "== done: logs in $run_dir/run/logs, checkpoints in $run_dir/checkpoints, plots in $run_dir/analysis/report.html =="
