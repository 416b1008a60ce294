#!/usr/bin/env bash
# Device run of the training benchmark (bench/train.py) on every GPU of the box, from the repo root: env, build, the
# pass's GPU check when CE_TRAIN_PASS_CHECK=1, then all modes of CE_TRAIN_MODES back to back (each in its own
# process per rank) at the 8-layer Llama-3-8B-width shape, sequence 4096, with the cost model's prediction and GPU
# kernel time by class for CE_TRAIN_KERNEL_PROFILE steps per mode. Results: $OUT/train.json, logs, $OUT/summary.txt,
# one archive train.tgz. bench/README.md: every knob, and bench/step_prediction.py / plot_train.py for afterwards.
#
#   bash bench/train_device.sh
#   CE_TRAIN_LAYERS=32 CE_TRAIN_MODES=compile,compile+inductor-overlap,ce_overlap,no-comm bash bench/train_device.sh
#   CE_TRAIN_CE=on CE_TRAIN_MODES=ce_overlap,ce_overlap-rs-kernel bash bench/train_device.sh   # every bucket on CE
#   CE_TRAIN_TRACES=1 CE_TRAIN_CALIBRATE=1 CE_TRAIN_MODES=ce_overlap,compile+inductor-overlap,no-comm,compile \
#     CE_TRAIN_STEPS=12 CE_TRAIN_KERNEL_PROFILE=1 bash bench/train_device.sh   # step prediction: traces + calibration
#   CE_TRAIN_MEMORY_HISTORY=1 CE_TRAIN_MODES=ce_overlap,ce_overlap-rs-kernel bash bench/train_device.sh  # what is live
#     at each mode's peak of allocated memory (slows the host: these step times are not for comparison)
#   CE_TRAIN_CLOCKS=1 CE_TRAIN_KERNEL_PROFILE=1 bash bench/train_device.sh   # + clocks.csv: python bench/clocks.py OUT
set -o pipefail
cd "$(dirname "$0")/.."

BUDGET_S=${CE_DEVICE_BUDGET_S:-560}
source bench/_device_lib.sh

LAYERS=${CE_TRAIN_LAYERS:-8}
MODES=${CE_TRAIN_MODES:-compile,compile+inductor-overlap,ce_overlap,ce_overlap-rs-kernel,no-comm,ce_overlap-nccl,eager}
STEPS=${CE_TRAIN_STEPS:-25}

stage env 30 env_info
stage build 240 build
if [ "${CE_TRAIN_PASS_CHECK:-0}" = 1 ]; then pass_gpu_stage llama3-tiny 150; fi
# CE_TRAIN_CLOCKS=1: every GPU's SM clock, power and temperature sampled beside the run (bench/clocks.py reads them in
# each mode's timed and profiled windows: whether the timed steps ran at the clocks the kernel profile saw).
if [ "${CE_TRAIN_CLOCKS:-0}" = 1 ] && ! dry_run; then
  (while :; do
     nvidia-smi --query-gpu=index,clocks.sm,power.draw,temperature.gpu --format=csv,noheader,nounits |
       sed "s/^/$(date +%s.%N), /"
     sleep 0.2
   done) > "$OUT/clocks.csv" 2>/dev/null &
  CLOCKS_PID=$!
fi
stage train 540 torchrun_all bench/train.py --layers "$LAYERS" --seq-len 4096 --steps "$STEPS" --warmup 5 \
  --modes "$MODES" $([ "${CE_TRAIN_PREDICT:-1}" = 1 ] && echo --predict) --kernel-profile "${CE_TRAIN_KERNEL_PROFILE:-2}" \
  ${CE_TRAIN_CE:+--ce "$CE_TRAIN_CE"} ${CE_TRAIN_FSDP2_WRAP:+--fsdp2-wrap "$CE_TRAIN_FSDP2_WRAP"} \
  $([ "${CE_TRAIN_TRACES:-0}" = 1 ] && echo --trace-dir "$OUT/traces") \
  $([ "${CE_TRAIN_VOCAB_PARALLEL:-0}" = 1 ] && echo --vocab-parallel-embeddings) \
  ${CE_TRAIN_IN_GRAPH_WRAP:+--in-graph-wrap "$CE_TRAIN_IN_GRAPH_WRAP"} ${CE_TRAIN_GC:+--gc "$CE_TRAIN_GC"} \
  ${CE_TRAIN_LOSS_REDUCE:+--loss-reduce "$CE_TRAIN_LOSS_REDUCE"} \
  $([ "${CE_TRAIN_MEMORY_HISTORY:-0}" = 1 ] && echo --memory-history) --out "$OUT/train.json"
if [ -n "${CLOCKS_PID:-}" ]; then kill "$CLOCKS_PID" 2>/dev/null; fi
# The same board calibrated right after (CE_TRAIN_CALIBRATE=1): its profile predicts these runs on the CPU afterwards
# (bench/step_prediction.py --train-json train.json --profile calibrated.json).
if [ "${CE_TRAIN_CALIBRATE:-0}" = 1 ]; then
  stage calibrate 170 torchrun_all -m ce_overlap.cli calibrate -o "$OUT/calibrated.json" \
    --measurements "$OUT/calibration_measurements.json"
fi

finish "ce_overlap training benchmark device run" train
