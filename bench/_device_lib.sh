# Shared by the device drivers (bench/*_device.sh, bench/device_session.sh), sourced from the repo root on the GPU
# box: the knob checks, the environment, a stage runner with per-stage timeouts under one global deadline, an
# idempotent build, torchrun over every GPU, the stages two drivers share, and the closing summary and archive. Not
# a script of its own. Every knob (CE_DEVICE_*, CE_TRAIN_*, CE_SESSION_*): bench/README.md, one table.
#
# Set BUDGET_S (seconds for the whole driver) before sourcing to start a driver: then OUT, STAMP, DEADLINE_S are set
# and `stage` runs. Without BUDGET_S only the functions and checks are loaded (bench/device_session.sh, whose parts
# are drivers with their own budgets).

# A knob renamed so that one knob has one name in every driver: setting the old name stops the driver (it would
# otherwise be ignored without a word).
retired_knobs() {
  local pair old new bad=0
  for pair in CE_COMPUTE_LAYERS:CE_TRAIN_LAYERS CE_TRAIN_PASS_MODELS:CE_DEVICE_PASS_MODELS \
    CE_TRAIN_PASS_VARIANTS:CE_DEVICE_PASS_VARIANTS CE_SESSION_FAULTS_S:CE_DEVICE_FAULTS_S; do
    old=${pair%%:*} new=${pair#*:}
    if [ -n "${!old+set}" ]; then
      echo "bench: $old is now $new (one name per knob, bench/README.md): set $new=${!old} instead" >&2
      bad=1
    fi
  done
  return $bad
}

# Knobs that are whole numbers (seconds, counts): a typo stops the driver naming the knob, before any stage runs.
whole_number_knobs() {
  local name bad=0
  for name in CE_DEVICE_BUDGET_S CE_DEVICE_GPUS CE_DEVICE_GPU_TESTS_S CE_DEVICE_BACKEND_TESTS_S CE_DEVICE_FSDP2_S CE_DEVICE_PASS_S CE_DEVICE_FAULTS_S \
    CE_DEVICE_FAULT_REPEATS CE_DEVICE_MEMCHECK_S CE_TRAIN_LAYERS CE_TRAIN_STEPS CE_TRAIN_KERNEL_PROFILE \
    CE_SESSION_TRAIN_S CE_SESSION_VALIDATION_S CE_PIPE_MICROBATCHES; do
    if [ -n "${!name+set}" ] && ! [[ ${!name} =~ ^[0-9]+$ ]]; then
      echo "bench: $name=${!name}: expected a whole number (bench/README.md, knobs)" >&2
      bad=1
    fi
  done
  return $bad
}

# select_stages KNOB DEFAULT KNOWN...: STAGES from the knob's value (else DEFAULT); a name that is not one of KNOWN
# stops the driver (exit 2), naming the knob. Then `want NAME` says whether a stage was asked for.
select_stages() {
  local knob=$1 default=$2 s
  shift 2
  STAGES=${!knob:-$default}
  for s in $STAGES; do
    if [[ " $* " != *" $s "* ]]; then
      echo "bench: $knob: unknown stage '$s'; the stages of $(basename "$0"): $*" >&2
      exit 2
    fi
  done
}
want() { [[ " $STAGES " == *" $1 "* ]]; }
GPUS=$(nvidia-smi -L 2>/dev/null | wc -l)

retired_knobs && whole_number_knobs || exit 2

PY=${PYTHON:-python3}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1   # never multicast on the lent machines
export PYTHONUNBUFFERED=1 PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1

dry_run() { [ "${CE_DEVICE_DRY_RUN:-0}" = 1 ]; }

# run_cmd CMD...: runs CMD, or with CE_DEVICE_DRY_RUN=1 prints it.
run_cmd() {
  if dry_run; then echo "(dry run) $*"; else "$@"; fi
}

# stage NAME CAP_S CMD...: runs CMD with timeout min(CAP_S, time left before the deadline), tee'd to $OUT/NAME.log.
# A failed or stuck stage never keeps the later ones from running. CE_DEVICE_DRY_RUN=1: logs the command only.
stage() {
  local name=$1 cap=$2
  shift 2
  local now left t t0 rc
  now=$(date +%s)
  left=$((${DEADLINE_S:?stage needs BUDGET_S set before sourcing bench/_device_lib.sh} - now))
  t=$((cap < left ? cap : left))
  if ((t < 15)); then
    echo "== [$name] skipped: only ${left}s left of the ${BUDGET_S}s budget" | tee "$OUT/$name.log"
    STATUS+=("$name: SKIPPED (out of time)")
    return 0
  fi
  echo "== [$name] (timeout ${t}s) $*" | tee "$OUT/$name.log"
  if dry_run; then
    echo "== [$name] dry run: not run" | tee -a "$OUT/$name.log"
    STATUS+=("$name: dry run (timeout ${t}s)")
    return 0
  fi
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
  "$PY" -c "import matplotlib; print('matplotlib', matplotlib.__version__)" 2>/dev/null || echo "matplotlib: not importable"
  nvcc --version | tail -n 2 || true
  g++ --version | head -n 1 || true
  git log --oneline -n 1 2>/dev/null || true
  git status --short 2>/dev/null | head -n 40 || true
}

runtime_ready() {
  "$PY" -c "import ce_overlap._core, ce_overlap.runtime as rt, sys; a = rt.available(); print('ce_overlap.runtime.available():', a); sys.exit(0 if a else 1)"
}

source_hash() { find csrc python CMakeLists.txt pyproject.toml -type f -not -path '*__pycache__*' | sort | xargs sha1sum | sha1sum | cut -c1-16; }

# Builds and installs ce_overlap with its CE runtime, unless this very source was already built on this machine.
build() {
  local marker=build/.device-built-$(source_hash)
  if [ "${CE_DEVICE_REBUILD:-0}" != 1 ] && [ -f "$marker" ] && runtime_ready; then
    echo "this source is already built on this machine ($marker): skipping (CE_DEVICE_REBUILD=1 forces it)"
    return 0
  fi
  local deb
  deb=$(ls .devdeps/nlohmann-json3-dev_*.deb 2>/dev/null | head -n 1)
  if [ -n "$deb" ]; then
    rm -rf /tmp/nl && dpkg -x "$deb" /tmp/nl && echo "nlohmann-json unpacked from $deb"
  else
    echo "no .devdeps/nlohmann-json3-dev_*.deb: relying on an installed nlohmann-json (carry .devdeps if this fails)"
  fi
  # The box's default CXX (/opt/gcc/bin/g++, a wrapper) builds objects whose std::string does not match
  # torch's: the first c10::Error with a formatted message segfaulted. The distribution's g++ matches, and
  # nvcc's host compiler must be the same one.
  if [ -x /usr/bin/g++ ]; then export CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++; fi
  echo "CXX=${CXX:-default} CUDAHOSTCXX=${CUDAHOSTCXX:-default}"
  CMAKE_PREFIX_PATH=/tmp/nl/usr${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH} CE_OVERLAP_BUILD_TESTS=OFF \
    CE_OVERLAP_BUILD_RUNTIME=ON CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-16} \
    "$PY" -m pip install --no-build-isolation --no-deps -e . || return 1
  runtime_ready && mkdir -p build && touch "$marker"
}

torchrun_all() { "$PY" -m torch.distributed.run --standalone --nproc-per-node "${CE_DEVICE_GPUS:-$(nvidia-smi -L | wc -l)}" "$@"; }
torchrun2() { "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 "$@"; }

# sanitize TOOL MODES: tests/runtime/gpu_worker.py MODES on 2 ranks, each rank its own process under
# compute-sanitizer TOOL (launched directly: under torchrun the sanitizer did not follow the workers), one log per
# rank; any report fails the stage (exit code 99). On a 1-GPU box both ranks share the GPU (gpu_worker.py).
sanitize() {
  local tool=$1 modes=$2 cs=${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer
  [ -x "$cs" ] || cs=$(command -v compute-sanitizer) || { echo "compute-sanitizer not found"; return 1; }
  "$cs" --version | tail -n 1
  local shared=0 port=$((29600 + RANDOM % 400)) pids=() rc=0 r
  [ "$(nvidia-smi -L | wc -l)" -lt 2 ] && shared=1 && echo "one GPU: both ranks share it"
  for r in 0 1; do
    RANK=$r LOCAL_RANK=$r WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
      CE_TEST_SHARED_GPU=$shared CE_OVERLAP_POOL_MB=128 CE_OVERLAP_STAGING_MB=1 CE_OVERLAP_P2P_MB=1 \
      CE_OVERLAP_TIMEOUT_S=120 CE_TEST_STEP_DEADLINE_S=300 \
      "$cs" --tool "$tool" --error-exitcode 99 --print-limit 20 --log-file "$OUT/sanitizer-$tool-rank$r.log" \
      "$PY" tests/runtime/gpu_worker.py "$modes" --cases 60 --rs-cases 36 --parts-cases 30 --a2a-cases 60 --p2p-cases 60 &
    pids+=($!)
  done
  for r in 0 1; do wait "${pids[$r]}" || rc=$?; done
  for r in 0 1; do echo "-- rank $r: $(grep -c . "$OUT/sanitizer-$tool-rank$r.log") lines"; tail -n 4 "$OUT/sanitizer-$tool-rank$r.log"; done
  return $rc
}
export -f env_info runtime_ready source_hash build torchrun_all torchrun2 sanitize

# pass_gpu_stage MODELS CAP_S: the pass's GPU check (tests/pass_gpu/run_pass_gpu.py) on 2 ranks, with this driver's
# default models and timeout; CE_DEVICE_PASS_MODELS, CE_DEVICE_PASS_VARIANTS and CE_DEVICE_PASS_S override them;
# CE_DEVICE_PASS_VOCAB_PARALLEL=1 shards every variant with vocab_parallel_embeddings.
pass_gpu_stage() {
  stage pass_gpu "${CE_DEVICE_PASS_S:-$2}" torchrun2 tests/pass_gpu/run_pass_gpu.py \
    --models "${CE_DEVICE_PASS_MODELS:-$1}" ${CE_DEVICE_PASS_VARIANTS:+--variants "$CE_DEVICE_PASS_VARIANTS"} \
    $([ "${CE_DEVICE_PASS_VOCAB_PARALLEL:-0}" = 1 ] && echo --vocab-parallel-embeddings) \
    --out "$OUT/pass_gpu.json"
}

# summary TITLE: every stage's result, to stdout and $OUT/summary.txt.
summary() {
  {
    echo "$1 $STAMP on $(hostname), $(($(date +%s) - START_S))s of ${BUDGET_S}s budget"
    for s in "${STATUS[@]}"; do echo "  $s"; done
  } | tee "$OUT/summary.txt"
}

# pack: the device tool brings back only a few files per call, so everything under $OUT goes into one archive
# (keeping summary.txt beside it). Call last.
pack() {
  local name=${1:-results}
  (cd "$OUT" && tar czf "/tmp/$name.tgz" . && find . -mindepth 1 -not -name summary.txt -delete && mv "/tmp/$name.tgz" .)
  echo "packed into $OUT/$name.tgz"
}

# finish TITLE ARCHIVE: the summary, then (unless CE_DEVICE_PACK=0) everything in $OUT packed into ARCHIVE.tgz.
finish() {
  summary "$1"
  if [ "${CE_DEVICE_PACK:-1}" = 1 ]; then pack "$2"; fi
}

# A driver: its deadline and output folder.
if [ -n "${BUDGET_S:-}" ]; then
  OUT=${OUT:-$PWD/out}
  mkdir -p "$OUT"
  START_S=$(date +%s)
  DEADLINE_S=$((START_S + BUDGET_S))
  STAMP=$(date +%Y%m%d-%H%M%S)
  STATUS=()
  if dry_run; then echo "CE_DEVICE_DRY_RUN=1: every stage's command is printed, none runs"; fi
fi
export PY OUT
