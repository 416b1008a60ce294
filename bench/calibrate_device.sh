#!/usr/bin/env bash
# Device run of `ce-overlap calibrate` and the cost-model validation, from the repo root on a 2-GPU box: env, build,
# calibrate on 1 GPU (the single-GPU path), calibrate on 2 GPUs (writes $OUT/calibrated.json), analyze a model with
# that profile, then bench/cost_model_validation.py scoring the built-in profile (the targets) and the calibrated
# one against the same measurements. Logs, JSON and summary.txt in $OUT, one archive calibrate.tgz. bench/README.md
# has every knob.
#
#   bash bench/calibrate_device.sh                  # about 2-3 minutes when already built (+ the build otherwise)
#   CE_DEVICE_BUDGET_S=300 OUT=/tmp/out bash bench/calibrate_device.sh
set -o pipefail
cd "$(dirname "$0")/.."

BUDGET_S=${CE_DEVICE_BUDGET_S:-300}
source bench/_device_lib.sh

stage env 30 env_info
stage build 240 build
stage calibrate_1gpu 60 env CUDA_VISIBLE_DEVICES=0 "$PY" -m ce_overlap.cli calibrate -o "$OUT/calibrated-1gpu.json"
stage calibrate 150 torchrun2 -m ce_overlap.cli calibrate -o "$OUT/calibrated.json" \
  --measurements "$OUT/calibration_measurements.json"
stage analyze 90 "$PY" -m ce_overlap.cli analyze llama3-tiny --world-size 2 --profile "$OUT/calibrated.json"
also=()  # the calibrated profile too, when the 2-GPU calibration wrote one (a dry run shows it)
if [ -f "$OUT/calibrated.json" ] || dry_run; then also=(--also-profile "$OUT/calibrated.json"); fi
stage validation 150 torchrun2 bench/cost_model_validation.py --out "$OUT" "${also[@]}"

finish "ce_overlap calibrate device run" calibrate
