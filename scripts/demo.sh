#!/usr/bin/env bash
# Quick start, part 1: set up (.venv/, scripts/setup.sh), then analyze Llama-3-8B under in-graph FSDP over 4 ranks
# on the H200 profile (no GPU needed) and plan it: which collectives go to the copy engines and why, and the exposed
# communication and step time against Inductor's overlap scheduler. The shape is one measured on 4x H200
# (bench/results/fully-shard-2026-11-27): the demo's last line promises a gain that was measured there. Extra
# arguments go to `ce-overlap analyze` (e.g. --world-size 8 --profile h100-sxm: a shape not measured yet).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV=${CE_OVERLAP_VENV:-.venv}
echo
echo "$ ce-overlap analyze llama3-8b --world-size 4 --profile h200-sxm --plan $*"
exec "$VENV/bin/ce-overlap" analyze llama3-8b --world-size 4 --profile h200-sxm --plan "$@"
