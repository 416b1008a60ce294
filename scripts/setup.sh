#!/usr/bin/env bash
# Installs everything ce_overlap needs on a fresh Debian/Ubuntu machine, then builds and installs it
# (editable). Idempotent: a second run only rebuilds what changed.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
TORCH_VERSION=${CE_OVERLAP_TORCH:-2.14.1}
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi

missing=()
for pkg in cmake ninja-build g++ nlohmann-json3-dev libgtest-dev; do
  dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing Debian packages: ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.__version__.split('+')[0] == '$TORCH_VERSION' else 1)" 2>/dev/null; then
  echo "setup: installing torch==$TORCH_VERSION"
  "$PYTHON" -m pip install -q "torch==$TORCH_VERSION"
fi
"$PYTHON" -m pip install -q "scikit-build-core>=0.8" "pybind11>=2.10" "pytest>=7" "hypothesis>=6"

echo "setup: building ce_overlap (C++ core + tests)"
CE_OVERLAP_BUILD_TESTS=${CE_OVERLAP_BUILD_TESTS:-ON} \
  "$PYTHON" -m pip install -q --no-build-isolation --no-deps -e .
echo "setup: done"
