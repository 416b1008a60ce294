#!/usr/bin/env bash
# Device run of the CE runtime, from the repo root on a GPU box (no network there; carry .devdeps): env, build, then
# the stages of CE_DEVICE_STAGES in this order, each under its own timeout within CE_DEVICE_BUDGET_S (540 s: one
# device call may run 10 minutes). Logs and JSON in $OUT (<stage>.log, <stage>.json), $OUT/summary.txt, then one
# archive runtime.tgz. bench/README.md: what each stage measures, every knob, where results go.
#
#   collectives        bench/collectives.py all: all-gather (7 variants), reduce-scatter (4), all-to-all (3),
#                      broadcast (3), 64 KiB .. 1 GiB per rank                                     [2 GPUs]
#   p2p                bench/collectives.py p2p: send / recv, NCCL / CE staged / CE direct          [2 GPUs]
#   overlap            bench/collectives.py overlap: GEMM and 1 GiB add beside every all-gather and
#                      reduce-scatter variant, 256 MiB per rank, bursts                             [2 GPUs]
#   overlap_sustained  the same, GEMM only, both arms ~1 s at steady clocks (issue 4's "GEMM <= 3%")
#   gpu_tests          tests/runtime/test_runtime_gpu.py (CE_OVERLAP_REQUIRE_GPU_TESTS=1: no skips), at 2, 3 and 4
#                      ranks
#   backend_tests      tests/runtime/test_backend_gpu.py: the torch.distributed backend at 2, 3 and 4 ranks
#   fsdp2              tests/fsdp2_gpu/run_fsdp2_gpu.py: FSDP2 with copy engines vs without, at 2 and 3 ranks
#   pass_gpu           tests/pass_gpu/run_pass_gpu.py: the pass on real Inductor code vs NCCL
#   probe              bench/collectives.py probe: copy APIs, pull split vs push, RS tuning, reduction kernel
#   cpu_tests          tests/runtime/test_runtime_cpu.py
#   faults             bench/fault_repeats.py: every fault of RELIABILITY.md, 20 times (opt-in, ~250-310 s)
#   sanitizer          compute-sanitizer memcheck, racecheck, synccheck over tests/runtime/gpu_worker.py
# On a 1-GPU box the tests, the pass check, faults and sanitizers run with both ranks sharing the GPU.
#
#   bash bench/run_device.sh
#   CE_DEVICE_STAGES="gpu_tests probe" bash bench/run_device.sh          # only these (env and build always run)
#   CE_DEVICE_BUDGET_S=570 CE_DEVICE_FAULTS_S=330 CE_DEVICE_STAGES="collectives overlap probe faults" bash bench/run_device.sh
#   CE_DEVICE_DRY_RUN=1 CE_DEVICE_PACK=0 bash bench/run_device.sh        # print every stage's command (no GPU)
set -o pipefail
cd "$(dirname "$0")/.."

BUDGET_S=${CE_DEVICE_BUDGET_S:-540}
ALL_STAGES="collectives p2p overlap overlap_sustained gpu_tests backend_tests fsdp2 pass_gpu probe cpu_tests faults sanitizer"
source bench/_device_lib.sh
select_stages CE_DEVICE_STAGES "collectives overlap overlap_sustained p2p gpu_tests backend_tests fsdp2 pass_gpu probe cpu_tests sanitizer" $ALL_STAGES

stage env 30 env_info
stage build 150 build
want collectives && stage collectives 120 torchrun2 bench/collectives.py all --out "$OUT/collectives.json"
want p2p && stage p2p 90 torchrun2 bench/collectives.py p2p --out "$OUT/p2p.json"
want overlap && stage overlap 60 torchrun2 bench/collectives.py overlap --out "$OUT/overlap.json"
want overlap_sustained && stage overlap_sustained 150 torchrun2 bench/collectives.py overlap --sustain-ms 1000 \
  --compute gemm --out "$OUT/overlap-sustained.json"
want gpu_tests && stage gpu_tests "${CE_DEVICE_GPU_TESTS_S:-420}" env CE_OVERLAP_REQUIRE_GPU_TESTS=1 "$PY" -m pytest \
  tests/runtime/test_runtime_gpu.py -v -s -rs
want backend_tests && stage backend_tests "${CE_DEVICE_BACKEND_TESTS_S:-420}" env CE_OVERLAP_REQUIRE_GPU_TESTS=1 "$PY" \
  -m pytest tests/runtime/test_backend_gpu.py -v -s -rs
for n in 2 3; do
  want fsdp2 && stage fsdp2-$n "${CE_DEVICE_FSDP2_S:-240}" "$PY" -m torch.distributed.run --standalone --nproc-per-node $n \
    tests/fsdp2_gpu/run_fsdp2_gpu.py
done
want pass_gpu && pass_gpu_stage llama3-tiny,llama3-1b 240
want probe && stage probe 100 torchrun2 bench/collectives.py probe --out "$OUT/ce_probe.json"
want cpu_tests && stage cpu_tests 90 "$PY" -m pytest tests/runtime/test_runtime_cpu.py tests/runtime/test_runtime_config.py \
  tests/runtime/test_c10d_backend_cpu.py -q -rs
want faults && stage faults "${CE_DEVICE_FAULTS_S:-300}" "$PY" bench/fault_repeats.py \
  --repeats "${CE_DEVICE_FAULT_REPEATS:-20}" --parallel 6 --out "$OUT/faults.json"
# memcheck: every collective; racecheck and synccheck: the reduce-scatters (one- and multi-tensor), whose reduction
# is the runtime's only kernel. Fewer cases: everything runs ~10-100x slower under the sanitizer.
want sanitizer && stage memcheck "${CE_DEVICE_MEMCHECK_S:-240}" sanitize memcheck correctness,a2a_bcast,p2p,reduce_scatter,parts
want sanitizer && stage racecheck 150 sanitize racecheck reduce_scatter,parts
want sanitizer && stage synccheck 150 sanitize synccheck reduce_scatter

finish "ce_overlap runtime device run" runtime
