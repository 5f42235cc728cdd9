#!/usr/bin/env bash
# One command for a GPU machine (expected 5-7 minutes on one GPU; the sections before
# btp/sdpa/trainer took 81 s on one H200): versions and peak FLOP/s; eager vs compiled
# numerics per architecture (and at TP2 when 2 GPUs are visible); BTP on a 1-rank group
# (24 blocks, bf16: one compiled graph, hi/lo statistic, eager == compiled); the SDPA
# kernel per architecture; per-plan GEMM TFLOP/s at 7B/TP4; CoLA 350m vs dense 350m
# tokens/s and MFU (bf16, eager and compiled); NGPU=1 ./run_train.sh compiled with the
# step profiler and the step guard; peak memory.
#
#   bash benchmarks/gpu_check.sh [--out DIR] [--batch B] [--seq S] [--steps N] [--sections ...]
#   bash benchmarks/gpu_check.sh --smoke --out /tmp/gc     # same code paths, CPU, tiny shapes
#
# Without a CUDA device only --smoke runs (the full check is refused: exit 2).
# Writes DIR/gpu_check.json (default outputs/gpu_check, relative to the repository root)
# and prints a markdown summary; exit status 10 + i names the first failing section
# (numerics 10, tp2 11, btp 12, sdpa 13, gemm 14, throughput 15, trainer 16), and every
# failing section is named on stderr.
# Logic: boost_titan/perf/gpu_check/. PYTHON=... picks the interpreter (default: .venv).
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python; fi
fi

# the trainer's allocator setting (run_train.sh), so peak memory reads as in training
PYTORCH_ALLOC_CONF=${PYTORCH_ALLOC_CONF:-expandable_segments:True} \
exec "$PYTHON" -m boost_titan.cli gpu-check "$@"
