#!/usr/bin/env bash
# One-shot device run of the CE runtime milestone, from the repo root on the 2-GPU box (no network there):
# build (with the runtime ON), the runtime's CPU and GPU tests, then bench/collectives.py and bench/overlap.py.
# Every stage logs to $OUT/<stage>.log and has its own timeout under one global deadline, so a failed or stuck
# stage never keeps the later ones from running; $OUT/summary.txt lists each stage's exit code and duration.
#
#   bash bench/run_device.sh            # needs .devdeps/nlohmann-json3-dev_*.deb carried along (see DEVICE.md)
#   CE_DEVICE_BUDGET_S=540 OUT=/tmp/out bash bench/run_device.sh
set -o pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
BUDGET_S=${CE_DEVICE_BUDGET_S:-550}
START_S=$(date +%s)
DEADLINE_S=$((START_S + BUDGET_S))
STAMP=$(date +%Y%m%d-%H%M%S)
PY=${PYTHON:-python3}
STATUS=()

export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1   # never multicast on the lent machines
export PYTHONUNBUFFERED=1 PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1

# stage NAME CAP_S CMD...: runs CMD with timeout min(CAP_S, time left before the deadline), tee'd to $OUT/NAME.log.
stage() {
  local name=$1 cap=$2
  shift 2
  local now left t t0 rc
  now=$(date +%s)
  left=$((DEADLINE_S - now))
  t=$((cap < left ? cap : left))
  if ((t < 15)); then
    echo "== [$name] skipped: only ${left}s left of the ${BUDGET_S}s budget" | tee "$OUT/$name.log"
    STATUS+=("$name: SKIPPED (out of time)")
    return 0
  fi
  echo "== [$name] (timeout ${t}s) $*" | tee "$OUT/$name.log"
  t0=$(date +%s)
  # bash -c: `timeout` runs programs, and some stages are the shell functions exported below.
  timeout --signal=TERM --kill-after=15 "$t" bash -c '"$@"' "$name" "$@" 2>&1 | tee -a "$OUT/$name.log"
  rc=${PIPESTATUS[0]}
  local took=$(($(date +%s) - t0))
  if ((rc == 124 || rc == 137)); then
    STATUS+=("$name: TIMEOUT after ${took}s (rc=$rc)")
  elif ((rc == 0)); then
    STATUS+=("$name: ok (${took}s)")
  else
    STATUS+=("$name: FAILED rc=$rc (${took}s)")
  fi
  echo "== [$name] rc=$rc in ${took}s" | tee -a "$OUT/$name.log"
  return 0
}

env_info() {
  date
  nvidia-smi || true
  nvidia-smi topo -m || true
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version(), 'gpus', torch.cuda.device_count())"
  nvcc --version | tail -n 2 || true
  cmake --version | head -n 1 || true
  g++ --version | head -n 1 || true
  git log --oneline -n 1 2>/dev/null || true
  git status --short 2>/dev/null | head -n 40 || true
}

build() {
  local deb
  deb=$(ls .devdeps/nlohmann-json3-dev_*.deb 2>/dev/null | head -n 1)
  if [ -n "$deb" ]; then
    rm -rf /tmp/nl && dpkg -x "$deb" /tmp/nl && echo "nlohmann-json unpacked from $deb"
  else
    echo "no .devdeps/nlohmann-json3-dev_*.deb: relying on an installed nlohmann-json (carry .devdeps if this fails)"
  fi
  # The box's default CXX (/opt/gcc/bin/g++, a wrapper) builds objects whose std::string does not match
  # torch's: the first c10::Error with a formatted message segfaulted. The distribution's g++ matches.
  if [ -x /usr/bin/g++ ]; then export CXX=/usr/bin/g++; fi
  echo "CXX=${CXX:-default}"
  CMAKE_PREFIX_PATH=/tmp/nl/usr${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH} CE_OVERLAP_BUILD_TESTS=OFF \
    CE_OVERLAP_BUILD_RUNTIME=ON CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-16} \
    "$PY" -m pip install --no-build-isolation --no-deps -e . || return 1
  "$PY" -c "import ce_overlap.runtime as rt; a = rt.available(); print('ce_overlap.runtime.available():', a); import sys; sys.exit(0 if a else 1)"
}

torchrun2() { "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 "$@"; }
export -f env_info build torchrun2
export PY OUT

stage env 30 env_info
stage build 300 build
stage cpu_tests 90 "$PY" -m pytest tests/runtime/test_runtime_cpu.py -q -rs
stage gpu_tests 220 env CE_OVERLAP_REQUIRE_GPU_TESTS=1 "$PY" -m pytest tests/runtime/test_runtime_gpu.py -v -s -rs
stage collectives 150 torchrun2 bench/collectives.py --out "$OUT/collectives.json"
stage overlap 150 torchrun2 bench/overlap.py --out "$OUT/overlap.json"

# Keep a copy next to the code too; copy $OUT into the repository's bench/results/ to record a run.
mkdir -p "bench/results/device-$STAMP" && cp "$OUT"/*.json "$OUT"/*.log "bench/results/device-$STAMP/" 2>/dev/null

{
  echo "ce_overlap device run $STAMP on $(hostname), $(( $(date +%s) - START_S ))s of ${BUDGET_S}s budget"
  for s in "${STATUS[@]}"; do echo "  $s"; done
} | tee "$OUT/summary.txt"
