#!/usr/bin/env bash
# Device run for FSDP2 + copy engines (ce_overlap.fsdp, issue 27), from the repo root: env, build, the runtime's
# multi-tensor checks the direct path rests on (gpu_worker.py reduce_scatter,parts: widening reduce-scatters and
# all-gathers from a symmetric slot into given outputs), the FSDP2 GPU harness at each of CE_FSDP2_RANKS (ranks share
# one GPU where there are fewer GPUs; against NCCL where every rank has its own), then bench/train.py's FSDP2 modes
# side by side with per-mode kernel tables and traces (only with 2+ GPUs: speed needs real GPUs). Results: $OUT/*.log,
# train.json, traces/, summary.txt, one archive fsdp2.tgz. Knobs: bench/README.md.
#
#   bash bench/fsdp2_device.sh
#   CE_FSDP2_STAGES="harness" CE_FSDP2_RANKS="2 3 4" bash bench/fsdp2_device.sh     # correctness only
#   CE_FSDP2_STAGES=train CE_TRAIN_LAYERS=32 bash bench/fsdp2_device.sh
set -o pipefail
cd "$(dirname "$0")/.."

BUDGET_S=${CE_DEVICE_BUDGET_S:-570}
source bench/_device_lib.sh

select_stages CE_FSDP2_STAGES "runtime harness train" runtime harness train
LAYERS=${CE_TRAIN_LAYERS:-8}
MODES=${CE_TRAIN_MODES:-fsdp2,fsdp2-ce,fsdp2-ce-hooks,fsdp2-no-comm}

stage env 30 env_info
stage build 240 build
want runtime && stage runtime 150 env CE_OVERLAP_POOL_MB=128 CE_OVERLAP_STAGING_MB=1 CE_OVERLAP_P2P_MB=1 \
  CE_OVERLAP_TIMEOUT_S=20 CE_TEST_SHARED_GPU=$((GPUS < 2)) "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 \
  tests/runtime/gpu_worker.py reduce_scatter,parts --rs-cases 120 --parts-cases 300
for n in ${CE_FSDP2_RANKS:-2}; do
  want harness && stage harness-$n "${CE_DEVICE_FSDP2_S:-240}" env CE_TEST_SHARED_GPU=$((GPUS < n)) "$PY" -m \
    torch.distributed.run --standalone --nproc-per-node "$n" tests/fsdp2_gpu/run_fsdp2_gpu.py \
    --models "${CE_FSDP2_MODELS:-llama3-tiny}" --modes "${CE_FSDP2_MODES:-eager,compiled}" \
    --setups "${CE_FSDP2_SETUPS:-default,torchtitan-wrap,bf16-reduce,grad-accum,explicit-prefetch,no-reshard,reshard-2}" \
    --paths "${CE_FSDP2_PATHS:-direct,hooks}"
done
if want train && ((GPUS >= 2)); then
  stage train 540 torchrun_all bench/train.py --layers "$LAYERS" --seq-len 4096 --steps "${CE_TRAIN_STEPS:-20}" \
    --warmup 5 --modes "$MODES" --kernel-profile "${CE_TRAIN_KERNEL_PROFILE:-3}" --trace-dir "$OUT/traces" \
    --out "$OUT/train.json"
elif want train; then
  echo "== [train] skipped: $GPUS GPU(s); the speed comparison needs 2 or more" | tee "$OUT/train.log"
  STATUS+=("train: SKIPPED (one GPU)")
fi

finish "ce_overlap FSDP2 device run" fsdp2
