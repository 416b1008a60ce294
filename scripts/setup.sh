#!/usr/bin/env bash
# Installs everything ce_overlap needs on a fresh Debian/Ubuntu machine into a project-local virtual
# environment, .venv/ at the repository root (`source .venv/bin/activate` to use `ce-overlap` yourself), then
# builds and installs ce_overlap there (editable). Nothing is installed into the global interpreter. Where that
# interpreter already has the torch release we pin, the environment reads it (and its other packages) from
# there instead of installing its ~3 GB again (a venv with --system-site-packages; the packages ce_overlap adds
# still go into .venv); CE_OVERLAP_VENV_ISOLATED=1 makes a fully isolated one. Idempotent: a second run only
# rebuilds what changed. PYTHON picks the interpreter the environment is made from (default python3);
# CE_OVERLAP_VENV another place for it.
set -euo pipefail
cd "$(dirname "$0")/.."

BASE_PYTHON=${PYTHON:-python3}
VENV=${CE_OVERLAP_VENV:-.venv}
TORCH_VERSION=${CE_OVERLAP_TORCH:-2.14.1}
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi

apt_install() {
  echo "setup: installing Debian packages: $*"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "$@" >/dev/null
}

missing=()
for pkg in cmake ninja-build g++ nlohmann-json3-dev libgtest-dev; do
  dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then apt_install "${missing[@]}"; fi

has_torch() {  # has_torch PYTHON: its torch is the pinned release
  "$1" -c "import torch, sys; sys.exit(0 if torch.__version__.split('+')[0] == '$TORCH_VERSION' else 1)" 2>/dev/null
}

if [ ! -x "$VENV/bin/python" ]; then
  venv_args=()
  how="isolated"
  if [ "${CE_OVERLAP_VENV_ISOLATED:-0}" != 1 ] && has_torch "$BASE_PYTHON"; then
    venv_args=(--system-site-packages)
    how="reading torch $TORCH_VERSION from it"
  fi
  echo "setup: creating the virtual environment $VENV from $("$BASE_PYTHON" -c 'import sys; print(sys.executable, sys.version.split()[0])') ($how)"
  if ! "$BASE_PYTHON" -m venv "${venv_args[@]}" "$VENV" 2>/dev/null; then
    # Debian's python3 ships venv's pip bootstrap (ensurepip) separately.
    rm -rf "$VENV"
    version=$("$BASE_PYTHON" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
    apt_install python3-venv "python$version-venv"
    "$BASE_PYTHON" -m venv "${venv_args[@]}" "$VENV"
  fi
fi
PY="$VENV/bin/python"
# pip's own progress bars (downloads, then, from pip 25.1, the packages being installed) instead of -q: torch and
# its CUDA libraries are ~3 GB, a few minutes on a fresh machine.
PIP=("$PY" -m pip install --progress-bar on)

if ! has_torch "$PY"; then
  if ! "$PY" -c "import sys, pip; sys.exit(0 if tuple(map(int, pip.__version__.split('.')[:2])) >= (25, 1) else 1)" 2>/dev/null; then
    "$PY" -m pip install -q --upgrade "pip>=25.1" || echo "setup: keeping $("$PY" -m pip --version | cut -d' ' -f1-2) (no newer one found)"
  fi
  echo "setup: installing torch==$TORCH_VERSION into $VENV (progress below)"
  "${PIP[@]}" "torch==$TORCH_VERSION"
fi
# numpy: torch warns on stderr without it.
if ! "$PY" -c "import numpy, scikit_build_core, pybind11, pytest, xdist, hypothesis" 2>/dev/null; then
  echo "setup: installing numpy and the build and test tools into $VENV"
  "${PIP[@]}" numpy "scikit-build-core>=0.8" "pybind11>=2.10" "pytest>=7" "pytest-xdist>=3" "hypothesis>=6"
fi

echo "setup: building ce_overlap (C++ core + tests) into $VENV"
CE_OVERLAP_BUILD_TESTS=${CE_OVERLAP_BUILD_TESTS:-ON} \
  "$PY" -m pip install -q --no-build-isolation --no-deps -e .
echo "setup: done; ce-overlap is $VENV/bin/ce-overlap (or: source $VENV/bin/activate)"
