#!/usr/bin/env bash
# Device run of the compute side of the cost model, on one GPU (any box), from the repo root: env, build,
# `ce-overlap calibrate` on one GPU with its raw measurements (square and transformer-shaped GEMMs, causal attention,
# memory-bound kernels, a compiled training step), then bench/train.py's no-comm step (the compute of a training
# step, no communication) with GPU kernel time per class and the cost model's prediction beside it. Afterwards, on
# CPU: python bench/step_prediction.py --train-json <out>/train-1gpu.json. Logs, JSON and summary.txt in $OUT, one
# archive compute.tgz. bench/README.md has every knob.
#
#   bash bench/compute_device.sh                     # about 5 minutes (+ the build)
#   CE_TRAIN_LAYERS=8 CE_DEVICE_BUDGET_S=400 OUT=/tmp/out bash bench/compute_device.sh
set -o pipefail
cd "$(dirname "$0")/.."

BUDGET_S=${CE_DEVICE_BUDGET_S:-400}
source bench/_device_lib.sh

stage env 30 env_info
stage build 240 build
stage calibrate_1gpu 240 env CUDA_VISIBLE_DEVICES=0 "$PY" -m ce_overlap.cli calibrate -o "$OUT/calibrated-1gpu.json" \
  --measurements "$OUT/calibration_measurements-1gpu.json"
stage train_1gpu 300 env CUDA_VISIBLE_DEVICES=0 "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 \
  bench/train.py --layers "${CE_TRAIN_LAYERS:-8}" --seq-len 4096 --steps 10 --warmup 3 --modes no-comm \
  --kernel-profile 3 --predict --out "$OUT/train-1gpu.json"

finish "ce_overlap compute device run" compute
