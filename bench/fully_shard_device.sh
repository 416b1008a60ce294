#!/usr/bin/env bash
# Device run for ce_overlap.fully_shard (issue 28), from the repo root: env, build, then per rank count in
# CE_FS_RANKS (each rank its own GPU, NCCL):
#   check-N   tests/fully_shard/worker.py check: state dicts, equivalence with the unsharded model (eager, compiled),
#             clip_grad_norm_'s global norm, errors
#   resume-N  10 steps uninterrupted vs 5 steps, a DCP checkpoint, 5 more in fresh processes: bit-identical losses
#             and parameters (compiled with ce_overlap's pass, bf16 gathers); the checkpoint loaded into FSDP2 and an
#             FSDP2 checkpoint loaded into ce_overlap (the parameters as written, bit for bit)
# then bench/train.py (only with 2+ GPUs) with CE_TRAIN_MODES side by side. Results: $OUT/*.log, train.json,
# summary.txt, fully_shard.tgz. Knobs: bench/README.md.
#
#   bash bench/fully_shard_device.sh
#   CE_FS_STAGES="check resume" CE_FS_RANKS="2 4" bash bench/fully_shard_device.sh
#   CE_FS_STAGES=train CE_TRAIN_LAYERS=32 CE_TRAIN_STEPS=10 CE_TRAIN_MODES=compile+inductor-overlap,ce_overlap,no-comm \
#     bash bench/fully_shard_device.sh          # at 32 layers a compiled mode takes 2.5-3 min on 4x H200 (compile
#   ... CE_TRAIN_MODES=fsdp2,fsdp2+ac,ce_overlap+ac ...  # 110-160 s): four modes no longer fit one call: split them
set -o pipefail
cd "$(dirname "$0")/.."

BUDGET_S=${CE_DEVICE_BUDGET_S:-570}
source bench/_device_lib.sh

select_stages CE_FS_STAGES "check resume train" check resume train
LAYERS=${CE_TRAIN_LAYERS:-8}
MODES=${CE_TRAIN_MODES:-compile+inductor-overlap,ce_overlap,no-comm,fsdp2}
W=tests/fully_shard/worker.py

# resume N: the checkpoint sequence at N ranks, every comparison printed PASS / FAIL. The records (full parameters) and
# checkpoints stay in /tmp: the archive of $OUT must stay under the transfer limit.
resume() {
  local n=$1 r="/tmp/ce_fs_records_$1" ck="/tmp/ce_fs_ck_$1" fails=0
  local run=("$PY" -m torch.distributed.run --standalone --nproc-per-node "$n" "$W" train --compile --ce --bf16)
  rm -rf "$r" "$ck" && mkdir -p "$r"
  "${run[@]}" --steps 10 --record "$r/ref10.pt" || return 1
  "${run[@]}" --steps 5 --save "$ck/ce" --record "$r/ce5.pt" || return 1
  "${run[@]}" --load "$ck/ce" --steps 5 --record "$r/ce10.pt" || return 1
  "$PY" "$W" compare "$r/ref10.pt" "$r/ce10.pt" || fails=1
  # ce_overlap -> FSDP2: the parameters as written
  "$PY" -m torch.distributed.run --standalone --nproc-per-node "$n" "$W" train --impl fsdp2 --bf16 \
    --load "$ck/ce" --steps 0 --record "$r/fsdp2_loaded.pt" || return 1
  "$PY" "$W" compare "$r/ce5.pt" "$r/fsdp2_loaded.pt" || fails=1
  # FSDP2 -> ce_overlap
  "$PY" -m torch.distributed.run --standalone --nproc-per-node "$n" "$W" train --impl fsdp2 --bf16 \
    --steps 5 --save "$ck/fsdp2" --record "$r/fsdp2_5.pt" || return 1
  "${run[@]}" --load "$ck/fsdp2" --steps 0 --record "$r/ce_from_fsdp2.pt" || return 1
  "$PY" "$W" compare "$r/fsdp2_5.pt" "$r/ce_from_fsdp2.pt" || fails=1
  rm -rf "$r" "$ck"
  return $fails
}
export -f resume
export PY OUT W

stage env 30 env_info
stage build 240 build
for n in ${CE_FS_RANKS:-2 4}; do
  if ((GPUS < n)); then
    echo "== [check-$n resume-$n] skipped: $GPUS GPU(s); NCCL needs a GPU per rank (CPU: tests/test_fully_shard.py)"
    STATUS+=("check-$n resume-$n: SKIPPED ($GPUS GPUs)")
    continue
  fi
  want check && stage check-$n 150 "$PY" -m torch.distributed.run --standalone --nproc-per-node "$n" "$W" check \
    --compile
  want resume && stage resume-$n 240 resume "$n"
done
if want train && ((GPUS >= 2)); then
  stage train 540 torchrun_all bench/train.py --layers "$LAYERS" --seq-len 4096 --steps "${CE_TRAIN_STEPS:-20}" \
    --warmup 5 --modes "$MODES" --kernel-profile "${CE_TRAIN_KERNEL_PROFILE:-0}" --out "$OUT/train.json"
elif want train; then
  echo "== [train] skipped: $GPUS GPU(s); the speed comparison needs 2 or more" | tee "$OUT/train.log"
  STATUS+=("train: SKIPPED (one GPU)")
fi

finish "ce_overlap fully_shard device run" fully_shard
