#!/usr/bin/env bash
# Device run of the training benchmark (bench/train.py) on every GPU of the box, all modes back to back in one
# process: the 8-layer Llama-3-8B-width shape at sequence 4096 (CE_TRAIN_LAYERS to change), with GPU kernel time by
# class for CE_TRAIN_KERNEL_PROFILE steps per mode (default 2; bench/step_prediction.py compares it with the model),
# then the pass's own GPU check (tests/pass_gpu/run_pass_gpu.py) when CE_TRAIN_PASS_CHECK=1. Results:
# $OUT/train.json, logs, one archive (the device tool returns few files).
#
#   bash bench/train_device.sh
#   CE_TRAIN_LAYERS=32 CE_TRAIN_MODES=compile,compile+inductor-overlap,ce_overlap,no-comm bash bench/train_device.sh
#   CE_TRAIN_CE=on CE_TRAIN_MODES=ce_overlap,ce_overlap-rs-kernel bash bench/train_device.sh   # every bucket on CE
set -o pipefail
cd "$(dirname "$0")/.."

BUDGET_S=${CE_DEVICE_BUDGET_S:-560}
source bench/_device_lib.sh

LAYERS=${CE_TRAIN_LAYERS:-8}
MODES=${CE_TRAIN_MODES:-compile,compile+inductor-overlap,ce_overlap,ce_overlap-rs-kernel,no-comm,ce_overlap-nccl,eager}
STEPS=${CE_TRAIN_STEPS:-25}

stage env 30 env_info
stage build 240 build
if [ "${CE_TRAIN_PASS_CHECK:-0}" = 1 ]; then
  stage pass_gpu 150 torchrun2 tests/pass_gpu/run_pass_gpu.py --models "${CE_TRAIN_PASS_MODELS:-llama3-tiny}" \
    ${CE_TRAIN_PASS_VARIANTS:+--variants "$CE_TRAIN_PASS_VARIANTS"} \
    --out "$OUT/pass_gpu.json"
fi
stage train 540 torchrun_all bench/train.py --layers "$LAYERS" --seq-len 4096 --steps "$STEPS" --warmup 5 \
  --modes "$MODES" --predict --kernel-profile "${CE_TRAIN_KERNEL_PROFILE:-2}" ${CE_TRAIN_CE:+--ce "$CE_TRAIN_CE"} \
  --out "$OUT/train.json"

summary "ce_overlap training benchmark device run"
[ "${CE_DEVICE_PACK:-1}" = 1 ] && pack train
