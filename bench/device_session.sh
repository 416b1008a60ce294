#!/usr/bin/env bash
# One device call that runs several drivers back to back into one $OUT, archiving after each so a call cut short by
# its time limit still brings back what finished (the device tool returns only a few files per call):
#   1. bench/train_device.sh into $OUT/train (budget CE_SESSION_TRAIN_S; the pass check first unless
#      CE_TRAIN_PASS_CHECK=0; its modes: CE_TRAIN_MODES, default below),
#   2. bench/cost_model_validation.py on 2 GPUs into $OUT/cal (at most CE_SESSION_VALIDATION_S),
#   3. when CE_DEVICE_FAULTS_S is set: bench/run_device.sh's stage faults into $OUT/faults, that many seconds,
# then the summaries. $OUT/all.tgz holds everything. bench/README.md has every knob.
#
#   bash bench/device_session.sh
#   CE_TRAIN_PASS_CHECK=0 CE_SESSION_TRAIN_S=330 CE_DEVICE_FAULTS_S=180 bash bench/device_session.sh
set -o pipefail
cd "$(dirname "$0")/.."
source bench/_device_lib.sh   # the knob checks and run_cmd; each part below is a driver with its own budget

R=${OUT:-$PWD/out}
mkdir -p "$R"
export CE_DEVICE_PACK=0
archive() { (cd "$R" && tar czf all.tgz --exclude=all.tgz . 2>/dev/null); }
OUT=$R/train CE_DEVICE_BUDGET_S=${CE_SESSION_TRAIN_S:-290} CE_TRAIN_PASS_CHECK=${CE_TRAIN_PASS_CHECK:-1} \
  CE_TRAIN_MODES=${CE_TRAIN_MODES:-compile,compile+inductor-overlap,ce_overlap,ce_overlap-rs-kernel,no-comm} \
  bash bench/train_device.sh > "$R/train.out" 2>&1
archive
mkdir -p "$R/cal"
run_cmd timeout "${CE_SESSION_VALIDATION_S:-70}" "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 \
  bench/cost_model_validation.py --out "$R/cal" > "$R/cal/validation.log" 2>&1
archive
if [ -n "${CE_DEVICE_FAULTS_S:-}" ]; then
  OUT=$R/faults CE_DEVICE_STAGES=faults CE_DEVICE_BUDGET_S=$((CE_DEVICE_FAULTS_S + 20)) \
    CE_DEVICE_FAULTS_S=$CE_DEVICE_FAULTS_S bash bench/run_device.sh > "$R/faults.out" 2>&1
  archive
  tail -n 12 "$R/faults/faults.log"
fi
cat "$R/train/summary.txt"; [ -f "$R/train/pass_gpu.log" ] && grep -E "PASS|FAIL" "$R/train/pass_gpu.log" | tail -14
grep -E "^(eager|compile|ce_overlap|no-comm|# pred|# larg|# compiled)|ce_overlap: " "$R/train/train.log" | tail -16; tail -12 "$R/cal/validation.log"
