#!/usr/bin/env bash
# Quick start, part 2: set up (.venv/, scripts/setup.sh), then run every test: the C++ suites (ctest), the
# Python suite (pytest, with .venv's python, a worker per core), and beside it the core under sanitizers plus its
# fuzzers (scripts/check_native.sh; CE_OVERLAP_SKIP_NATIVE_CHECKS=1 skips that part for a quick local run).
set -euo pipefail
cd "$(dirname "$0")/.."
started=$SECONDS
bash scripts/setup.sh
VENV=${CE_OVERLAP_VENV:-.venv}
build_dir=$(dirname "$(ls -t build/cp*/CTestTestfile.cmake | head -n 1)")
echo "== ctest ($build_dir)"
ctest --test-dir "$build_dir" --output-on-failure
# The core under sanitizers and its fuzzers (scripts/check_native.sh, ~1.7 min of clang builds on 2 cores) run beside
# pytest at the lowest CPU priority: they take the cores pytest leaves idle (its ranks waiting on each other, its
# processes starting) and yield the rest; their log follows pytest's, and either failing fails the command.
native_log=""
if [ "${CE_OVERLAP_SKIP_NATIVE_CHECKS:-0}" != 1 ]; then
  native_log=$(mktemp)
  nice -n 19 bash scripts/check_native.sh > "$native_log" 2>&1 &
  native_pid=$!
fi
# One pytest worker per core, a test file's tests on one worker (they share its session fixtures' captures): on a
# 2-core machine with a cold Inductor cache the suite took 12.4 minutes this way (2026-12-03; the slowest files first,
# the compiles on ATen kernels, every rank, torchrun and bench script forked from a process with torch imported:
# tests/conftest.py, tests/site/). `-n 0` after the command runs it in one process; CE_TEST_ZYGOTES=0 starts every
# process as usual.
echo "== pytest"
pytest_rc=0
"$VENV/bin/python" -m pytest tests -n auto --dist loadfile "$@" || pytest_rc=$?
native_rc=0
if [ -n "$native_log" ]; then
  wait "$native_pid" || native_rc=$?
  echo "== native checks (beside pytest, nice 19)"
  cat "$native_log"
  rm -f "$native_log"
fi
if [ "$pytest_rc" != 0 ] || [ "$native_rc" != 0 ]; then
  echo "== FAILED: pytest exit $pytest_rc, native checks exit $native_rc"
  exit 1
fi
echo "== all tests passed in $(( (SECONDS - started) / 60 )) min $(( (SECONDS - started) % 60 )) s"
