#!/usr/bin/env bash
# Device run for the copy-engine collectives beyond two ranks (issue 30), from the repo root: env, build, then per
# rank count in CE_COLL_RANKS (default "4 2"; each rank its own GPU, the first N; a count above the GPUs is skipped):
#   tests-N   tests/runtime/gpu_worker.py correctness,reduce_scatter,a2a_bcast on N ranks (random peer lanes per
#             rank, broadcast segment counts, multi-round sizes with a 1 MiB staging region): bit-exact vs NCCL
#   coll-N    bench/collectives.py all -b 16M -e 256M -f 4 with every ce_overlap variant once per peer-lane setting
#             (CE_COLL_LANES, default "1,0") and the broadcast once per segment count (CE_COLL_SEGMENTS, default
#             "0,2,4,8"), peer signalling mode (CE_COLL_SYNC) and pull split (CE_COLL_SPLIT; both default to the
#             runtime's): busbw side by side with NCCL; CE_COLL_SIZES="16M-64M" narrows the sizes, CE_COLL_COLLS
#             the collectives (default: all four)
#   probe-N   bench/collectives.py probe --parts reducescatter: the reduce-scatter's reduction CTAs x round size x
#             peer lanes (CE_COLL_LANES)
#   rate-N    bench/collectives.py overlap --sustain-ms 1000 --compute gemm: a GEMM beside NCCL and beside the push
#             all-gather / the reduce-scatter at each copy rate of CE_COLL_RATES (GB/s, 0 = unlimited), with SM clock
#             and board power: the copy rate against the compute's slowdown (opt-in: CE_COLL_STAGES=rate)
#   trace-N   bench/collectives.py all --colls CE_COLL_TRACE_COLLS (all_gather,all_to_all) at CE_COLL_TRACE_SIZE (256M)
#             with --trace-dir: one torch.profiler trace per rank, variant (nccl and CE_COLL_TRACE_VARIANTS; broadcasts
#             per CE_COLL_TRACE_SEGMENTS) and mode (paced, ahead), then bench/copy_timeline.py over rank 0's (opt-in:
#             CE_COLL_STAGES=trace)
#   faults-N  bench/fault_repeats.py --ranks N: every fault of RELIABILITY.md, CE_DEVICE_FAULT_REPEATS times (opt-in:
#             CE_COLL_STAGES=faults; ~450 s for 10 repeats at 4 ranks)
# and, once, on GPU 0 only:
#   shared8   the tests-N modes (and parts) on 8 ranks sharing one GPU (references over gloo): 8-rank correctness
#             before 8-GPU machines are lent
# Results: $OUT/*.log, coll-N.json, probe-N.json, summary.txt, one archive collectives.tgz. Knobs: bench/README.md.
#
#   bash bench/collectives_device.sh
#   CE_COLL_STAGES=coll CE_COLL_RANKS=4 CE_COLL_LANES=0 bash bench/collectives_device.sh
set -o pipefail
cd "$(dirname "$0")/.."

BUDGET_S=${CE_DEVICE_BUDGET_S:-570}
source bench/_device_lib.sh

select_stages CE_COLL_STAGES "tests coll probe shared8" tests coll probe shared8 rate trace faults

stage env 30 env_info
stage build 240 build
for n in ${CE_COLL_RANKS:-4 2}; do
  if ((GPUS < n)); then
    echo "== [$n-rank stages] skipped: $GPUS GPU(s)"
    STATUS+=("$n-rank stages: SKIPPED ($GPUS GPUs)")
    continue
  fi
  devices=$(seq -s, 0 $((n - 1)))
  want tests && stage tests-$n 150 env CUDA_VISIBLE_DEVICES="$devices" CE_OVERLAP_POOL_MB=128 CE_OVERLAP_STAGING_MB=1 \
    CE_OVERLAP_P2P_MB=1 "$PY" -m torch.distributed.run --standalone --nproc-per-node "$n" tests/runtime/gpu_worker.py \
    correctness,reduce_scatter,a2a_bcast --cases 200 --rs-cases 200 --a2a-cases 300
  want coll && stage coll-$n 200 env CUDA_VISIBLE_DEVICES="$devices" "$PY" -m torch.distributed.run --standalone \
    --nproc-per-node "$n" bench/collectives.py all -b 16M -e 256M -f 4 --peer-lanes "${CE_COLL_LANES:-1,0}" \
    --bcast-segments "${CE_COLL_SEGMENTS:-0,2,4,8}" ${CE_COLL_SYNC:+--peer-sync "$CE_COLL_SYNC"} \
    ${CE_COLL_SPLIT:+--pull-split "$CE_COLL_SPLIT"} ${CE_COLL_SIZES:+-b ${CE_COLL_SIZES%-*} -e ${CE_COLL_SIZES#*-}} \
    ${CE_COLL_COLLS:+--colls "$CE_COLL_COLLS"} \
    --out "$OUT/coll-$n.json"
  want probe && stage probe-$n 90 env CUDA_VISIBLE_DEVICES="$devices" "$PY" -m torch.distributed.run --standalone \
    --nproc-per-node "$n" bench/collectives.py probe --parts reducescatter --reduce-sms 32,64 --rs-round-mb 16,32,64 \
    --peer-lanes "${CE_COLL_LANES:-1,0}" \
    --out "$OUT/probe-$n.json"
  want rate && stage rate-$n 200 env CUDA_VISIBLE_DEVICES="$devices" "$PY" -m torch.distributed.run --standalone \
    --nproc-per-node "$n" bench/collectives.py overlap --sustain-ms 1000 --compute gemm --variants nccl,ce_symm_push \
    --rs-variants nccl,ce --copy-rates "${CE_COLL_RATES:-0,50,100,150,200,300}" --out "$OUT/rate-$n.json"
  want trace && stage trace-$n 200 env CUDA_VISIBLE_DEVICES="$devices" "$PY" -m torch.distributed.run --standalone \
    --nproc-per-node "$n" bench/collectives.py all --colls "${CE_COLL_TRACE_COLLS:-all_gather,all_to_all}" \
    --variants "nccl,${CE_COLL_TRACE_VARIANTS:-ce_symm_push}" -b "${CE_COLL_TRACE_SIZE:-256M}" \
    -e "${CE_COLL_TRACE_SIZE:-256M}" --peer-lanes 1 ${CE_COLL_SYNC:+--peer-sync "$CE_COLL_SYNC"} \
    ${CE_COLL_TRACE_SEGMENTS:+--bcast-segments "$CE_COLL_TRACE_SEGMENTS"} --trace-dir "$OUT/traces-$n" \
    --out "$OUT/trace-$n.json"
  want trace && stage trace-summary-$n 60 bash -c "'$PY' bench/copy_timeline.py '$OUT/traces-$n'/*rank0.json.gz \
    --json '$OUT/traces-$n/summary.json'"
  want faults && stage faults-$n "${CE_DEVICE_FAULTS_S:-500}" "$PY" bench/fault_repeats.py --ranks "$n" \
    --repeats "${CE_DEVICE_FAULT_REPEATS:-10}" --parallel 5 --out "$OUT/faults-$n.json"
done
want shared8 && stage shared8 200 env CUDA_VISIBLE_DEVICES=0 CE_TEST_SHARED_GPU=1 CE_OVERLAP_POOL_MB=128 \
  CE_OVERLAP_STAGING_MB=1 CE_OVERLAP_P2P_MB=1 "$PY" -m torch.distributed.run --standalone --nproc-per-node 8 \
  tests/runtime/gpu_worker.py correctness,reduce_scatter,parts,a2a_bcast --cases 60 --rs-cases 60 --parts-cases 30 \
  --a2a-cases 100
finish "collectives_device" collectives
