#!/usr/bin/env bash
# Quick start, part 2: set up, then run every test: the C++ suites (ctest) and the Python suite (pytest).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
build_dir=$(dirname "$(ls -t build/*/CTestTestfile.cmake | head -n 1)")
echo "== ctest ($build_dir)"
ctest --test-dir "$build_dir" --output-on-failure
echo "== pytest"
python3 -m pytest tests "$@"
