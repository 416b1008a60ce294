#!/usr/bin/env bash
# Device run for pipeline parallelism (issue 29), from the repo root: env, build, then per rank count in CE_PIPE_RANKS
# (each rank its own GPU; a count above the GPUs is skipped, said so):
#   check-N   tests/runtime/backend_worker.py pipeline: GPipe, 1F1B, interleaved 1F1B, interleaved zero bubble, 4 and
#             8 microbatches, over the ce_overlap backend and over NCCL, each bit-identical (losses, gradients) to a
#             host-staged gloo transport
#   bench-N   bench/pipeline.py: NCCL vs ce_overlap side by side for CE_PIPE_SCHEDULES at Llama-3-8B widths
#             (CE_TRAIN_LAYERS layers, seq 4096, CE_PIPE_MICROBATCHES microbatches)
# and, with 4 GPUs, pipelining combined with FSDP2 (2 stages x 2-way FSDP2):
#   fsdp-check  tests/pipeline_fsdp/worker.py over NCCL and over ce_overlap: gradients = the unsharded model's
#   fsdp-bench  bench/pipeline.py --dp 2 (1f1b and interleaved-1f1b)
# Results: $OUT/*.log, pipeline-N.json, summary.txt, one archive pipeline.tgz. Knobs: bench/README.md.
#
#   bash bench/pipeline_device.sh
#   CE_PIPE_STAGES=bench CE_PIPE_RANKS=4 CE_PIPE_SCHEDULES=1f1b bash bench/pipeline_device.sh
set -o pipefail
cd "$(dirname "$0")/.."

BUDGET_S=${CE_DEVICE_BUDGET_S:-570}
source bench/_device_lib.sh

select_stages CE_PIPE_STAGES "check bench fsdp" check bench fsdp
LAYERS=${CE_TRAIN_LAYERS:-32}

stage env 30 env_info
stage build 240 build
for n in ${CE_PIPE_RANKS:-2 4}; do
  if ((GPUS < n)); then
    echo "== [check-$n bench-$n] skipped: $GPUS GPU(s); NCCL needs a GPU per rank (tests/runtime: ranks sharing one)"
    STATUS+=("check-$n bench-$n: SKIPPED ($GPUS GPUs)")
    continue
  fi
  want check && stage check-$n 150 env CE_OVERLAP_TIMEOUT_S=20 "$PY" -m torch.distributed.run --standalone \
    --nproc-per-node "$n" tests/runtime/backend_worker.py pipeline
  want bench && stage bench-$n 300 "$PY" -m torch.distributed.run --standalone --nproc-per-node "$n" \
    bench/pipeline.py --model llama3-8b --layers "$LAYERS" --seq-len 4096 \
    --microbatches "${CE_PIPE_MICROBATCHES:-8}" --steps "${CE_TRAIN_STEPS:-8}" --warmup 2 \
    --schedules "${CE_PIPE_SCHEDULES-1f1b,interleaved-1f1b,zero-bubble}" \
    ${CE_PIPE_COPY_RATES:+--copy-rates "$CE_PIPE_COPY_RATES"} --out "$OUT/pipeline-$n.json"
done
if want fsdp && ((GPUS >= 4)); then
  for t in default ce_overlap; do
    stage fsdp-check-$t 120 "$PY" -m torch.distributed.run --standalone --nproc-per-node 4 \
      tests/pipeline_fsdp/worker.py --pp 2 --transport "$t"
  done
  stage fsdp-bench 300 "$PY" -m torch.distributed.run --standalone --nproc-per-node 4 bench/pipeline.py \
    --model llama3-8b --layers "$LAYERS" --seq-len 4096 --microbatches "${CE_PIPE_MICROBATCHES:-8}" \
    --steps "${CE_TRAIN_STEPS:-8}" --warmup 2 --dp 2 --schedules 1f1b,interleaved-1f1b --out "$OUT/pipeline-fsdp.json"
elif want fsdp; then
  echo "== [fsdp] skipped: $GPUS GPU(s); 2 stages x 2-way FSDP needs 4"
  STATUS+=("fsdp: SKIPPED ($GPUS GPUs)")
fi

finish "ce_overlap pipeline device run" pipeline
