#!/usr/bin/env bash
# One command for a GPU machine (under 8 minutes on one GPU): eager vs compiled numerics
# per architecture (and at TP2 when 2 GPUs are visible), per-plan GEMM TFLOP/s at 7B/TP4,
# CoLA 350m vs dense 350m tokens/s and MFU (bf16, eager and compiled), peak memory.
#
#   bash benchmarks/gpu_check.sh [--out DIR] [--batch B] [--seq S] [--steps N] [--sections ...]
#   bash benchmarks/gpu_check.sh --smoke --out /tmp/gc     # same code paths, CPU, tiny shapes
#
# Writes DIR/gpu_check.json (default outputs/gpu_check, relative to the repository root)
# and prints a markdown summary; exits non-zero if compiled does not match eager.
# Logic: boost_titan/gpu_check/. PYTHON=... picks the interpreter (default: .venv).
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python; fi
fi

# the trainer's allocator setting (run_train.sh), so peak memory reads as in training
PYTORCH_ALLOC_CONF=${PYTORCH_ALLOC_CONF:-expandable_segments:True} \
exec "$PYTHON" -m boost_titan.gpu_check "$@"
