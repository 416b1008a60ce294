#!/usr/bin/env bash
# Quick start, part 1: set up (.venv/, scripts/setup.sh), then analyze Llama-3-8B under in-graph FSDP at world
# size 8 on the H100 profile (no GPU needed) and plan it: which collectives go to the copy engines and why, and
# the exposed communication and step time against Inductor's overlap scheduler. Extra arguments go to `ce-overlap analyze`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV=${CE_OVERLAP_VENV:-.venv}
echo
echo "$ ce-overlap analyze llama3-8b --world-size 8 --profile h100-sxm --plan $*"
exec "$VENV/bin/ce-overlap" analyze llama3-8b --world-size 8 --profile h100-sxm --plan "$@"
