#!/usr/bin/env bash
# Device run of the compute side of the cost model, on one GPU (any box): build, `ce-overlap calibrate` on one GPU
# with its raw measurements (square and transformer-shaped GEMMs, causal attention, a memory-bound add), then
# bench/train.py's no-comm step (the compute a training step runs, no communication) with the GPU kernel time per
# class (--kernel-profile) and the cost model's prediction beside it. bench/step_prediction.py compares the two on
# CPU afterwards. Every stage logs to $OUT/<stage>.log; $OUT/summary.txt lists exit codes and durations.
#
#   bash bench/compute_device.sh                     # about 5 minutes (+ the build)
#   CE_COMPUTE_LAYERS=8 CE_DEVICE_BUDGET_S=400 OUT=/tmp/out bash bench/compute_device.sh
set -o pipefail
cd "$(dirname "$0")/.."

BUDGET_S=${CE_DEVICE_BUDGET_S:-400}
source bench/_device_lib.sh

LAYERS=${CE_COMPUTE_LAYERS:-8}
stage env 30 env_info
stage build 240 build
stage calibrate_1gpu 240 env CUDA_VISIBLE_DEVICES=0 "$PY" -m ce_overlap.cli calibrate -o "$OUT/calibrated-1gpu.json" \
  --measurements "$OUT/calibration_measurements-1gpu.json"
stage train_1gpu 300 env CUDA_VISIBLE_DEVICES=0 "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 \
  bench/train.py --layers "$LAYERS" --seq-len 4096 --steps 10 --warmup 3 --modes no-comm --kernel-profile 3 \
  --predict --out "$OUT/train-1gpu.json"

summary "ce_overlap compute device run"
[ "${CE_DEVICE_PACK:-1}" = 1 ] && pack compute
