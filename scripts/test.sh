#!/usr/bin/env bash
# Quick start, part 2: set up (.venv/, scripts/setup.sh), then run every test: the C++ suites (ctest), the
# Python suite (pytest, with .venv's python, a worker per core), and the core under sanitizers plus its fuzzers
# (scripts/check_native.sh; CE_OVERLAP_SKIP_NATIVE_CHECKS=1 skips that part for a quick local run).
set -euo pipefail
cd "$(dirname "$0")/.."
started=$SECONDS
bash scripts/setup.sh
VENV=${CE_OVERLAP_VENV:-.venv}
build_dir=$(dirname "$(ls -t build/cp*/CTestTestfile.cmake | head -n 1)")
echo "== ctest ($build_dir)"
ctest --test-dir "$build_dir" --output-on-failure
# One pytest worker per core, a test file's tests on one worker (they share its session fixtures' captures): on a
# 2-core machine with a cold Inductor cache the suite took 10.2-16.3 minutes this way (2026-12-03 and -04; the
# slowest files first, the compiles on ATen kernels, every rank, torchrun and bench script forked from a process with
# torch imported: tests/conftest.py, tests/site/). `-n 0` after the command runs it in one process;
# CE_TEST_ZYGOTES=0 starts every process as usual.
echo "== pytest"
"$VENV/bin/python" -m pytest tests -n auto --dist loadfile "$@"
if [ "${CE_OVERLAP_SKIP_NATIVE_CHECKS:-0}" != 1 ]; then
  bash scripts/check_native.sh
fi
echo "== all tests passed in $(( (SECONDS - started) / 60 )) min $(( (SECONDS - started) % 60 )) s"
