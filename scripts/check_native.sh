#!/usr/bin/env bash
# The torch-free C++ core under sanitizers, then fuzzed (issue: hardening). Called by scripts/test.sh.
# One clang build (build/sanitize, `cmake --preset sanitize`) instruments the core with AddressSanitizer +
# UndefinedBehaviorSanitizer (and libFuzzer coverage), then:
#   1. ctest: the GoogleTest suites under the sanitizers.
#   2. libFuzzer targets for every loader of outside input, each run for
#      CE_OVERLAP_FUZZ_RUNS inputs (default 10000) from the seeds in tests/fuzz/<target>/ (plus the built-in
#      profiles). Any crash, sanitizer report, leak, timeout or non-IrError exception fails the script.
# Installs what it needs (Debian: clang, libclang-rt-14-dev, libfuzzer-14-dev) on first use.
set -euo pipefail
cd "$(dirname "$0")/.."

RUNS=${CE_OVERLAP_FUZZ_RUNS:-10000}
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
missing=()
for pkg in clang libclang-rt-14-dev libfuzzer-14-dev; do
  dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "check_native: installing Debian packages: ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

echo "== sanitizers: core + tests + fuzzers under ASan/UBSan (build/sanitize, clang)"
cmake --preset sanitize >/dev/null
cmake --build --preset sanitize -j "$(nproc)"
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  ctest --test-dir build/sanitize --output-on-failure -j "$(nproc)"

echo "== fuzzing: $RUNS inputs per loader"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for target in ir profile plan; do
  corpus="$work/$target"
  mkdir -p "$corpus"
  cp tests/fuzz/"$target"/* "$corpus"/
  if [ "$target" = profile ]; then cp python/ce_overlap/profiles/*.json "$corpus"/; fi
  # -runs counts executions after the seeds; -timeout: one input taking > 10 s is a hang (a failure).
  if ! ASAN_OPTIONS=detect_leaks=1 "build/sanitize/csrc/fuzz/fuzz_$target" -runs="$RUNS" -timeout=10 -max_len=65536 \
      -artifact_prefix="$work/$target-" -print_final_stats=1 "$corpus" >"$work/$target.log" 2>&1; then
    tail -n 40 "$work/$target.log"
    cp "$work/$target"-* build/sanitize/ 2>/dev/null || true
    echo "fuzz_$target FAILED; the failing input is kept in build/sanitize/ (add it to tests/fuzz/$target/ once fixed)"
    exit 1
  fi
  echo "fuzz_$target: $(grep -o 'Done [0-9]* runs in [0-9]* second(s)' "$work/$target.log"), no crash, corpus $(ls "$corpus" | wc -l) files"
done
