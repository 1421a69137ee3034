#!/usr/bin/env bash
# The main job on any machine, CPU only included: set up, train a small GPT at TP2 x PP2 on
# 4 processes with a checkpoint at iteration 10, then resume it resharded at TP1 x PP2 on 2.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/setup.sh"
cd "$root"
py=.venv/bin/python
run_dir="${DEMO_RUN_DIR:-$root/demo_run}"
rm -rf "$run_dir"
mkdir -p "$run_dir"

model=(--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 64
       --mock-data --vocab-size 100 --make-vocab-size-divisible-by 64
       --micro-batch-size 2 --global-batch-size 8 --train-iters 20 --lr 1e-2 --min-lr 1e-4
       --lr-warmup-iters 2 --lr-decay-style cosine --log-interval 2 --eval-iters 0
       --save "$run_dir/checkpoints" --save-interval 10)

echo "== training at TP2 x PP2 on 4 processes, saving at iteration 10 =="
"$py" -m torch.distributed.run --standalone --nproc-per-node 4 pretrain_gpt.py "${model[@]}" \
    --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --exit-interval 10 \
    2>&1 | tee "$run_dir/train_tp2pp2.log" | grep -E "^(iteration|saved|exiting|loaded|error)"

echo "== resuming the same checkpoint at TP1 x PP2 on 2 processes =="
"$py" -m torch.distributed.run --standalone --nproc-per-node 2 pretrain_gpt.py "${model[@]}" \
    --tensor-model-parallel-size 1 --pipeline-model-parallel-size 2 --load "$run_dir/checkpoints" \
    2>&1 | tee "$run_dir/resume_tp1pp2.log" | grep -E "^(iteration|saved|exiting|loaded|error)"

echo "== done: logs and checkpoints in $run_dir =="
