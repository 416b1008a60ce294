# Shared by the device scripts (bench/*_device.sh), sourced from the repo root on the GPU box: the environment,
# a stage runner with per-stage timeouts under one global deadline, an idempotent build, torchrun over every GPU,
# and the closing summary. Not a script of its own.
#
# Before sourcing: BUDGET_S (seconds for the whole script). After: OUT, PY, STAMP, DEADLINE_S.

OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
START_S=$(date +%s)
DEADLINE_S=$((START_S + ${BUDGET_S:?set BUDGET_S before sourcing bench/_device_lib.sh}))
STAMP=$(date +%Y%m%d-%H%M%S)
PY=${PYTHON:-python3}
STATUS=()

export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1   # never multicast on the lent machines
export PYTHONUNBUFFERED=1 PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1

# stage NAME CAP_S CMD...: runs CMD with timeout min(CAP_S, time left before the deadline), tee'd to $OUT/NAME.log.
# A failed or stuck stage never keeps the later ones from running.
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
export -f env_info runtime_ready source_hash build torchrun_all torchrun2
export PY OUT

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
