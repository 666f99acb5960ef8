#!/usr/bin/env bash
# The step tuner on torchtitan's llama3 8B dimensions sliced to 4 layers, seq 2048, global batch 8,
# one GPU (README.md beside this). Run from the checkout; torchtitan and what it imports installed.
# Usage: bash examples/torchtitan/step_tune.sh [WORKDIR] [primus-tune step options]   (PYTHON: python3)
set -euo pipefail
cd "$(dirname "$0")/../.."
workdir=${1:-/tmp/titan-8b}
shift || true
exec "${PYTHON:-python3}" benchmarks/trainer/torchtitan_case.py --workdir "$workdir" --flavor 8B --layers 4 \
    --seq 2048 --local-batch 1 --global-batch 8 \
    -- --budget-min 60 --levers micro_batch,compile,recompute,fp8,optimizer,sdpa,allocator "$@"
