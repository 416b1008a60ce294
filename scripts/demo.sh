#!/usr/bin/env bash
# Quick start, part 1: set up, then analyze Llama-3-8B under in-graph FSDP at world size 8 on the
# H100 profile (no GPU needed). Extra arguments go to `ce-overlap analyze`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
echo
echo "$ ce-overlap analyze llama3-8b --world-size 8 --profile h100-sxm $*"
exec ce-overlap analyze llama3-8b --world-size 8 --profile h100-sxm "$@"
