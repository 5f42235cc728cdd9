"""One command for a GPU machine: compiled numerics, BTP on one GPU, SDPA kernels, GEMM
rates, throughput, memory, the trainer
(``boost-titan gpu-check``, ``bash benchmarks/gpu_check.sh``; sections, flags
and outputs in :mod:`boost_titan.perf.gpu_check.cli`). One module per job:

    common    constants and tolerances, Sizes/SMOKE, building a seeded model, compiling
              it as the trainer does, peak memory, guarded runs
    steps     training steps timed, eager vs compiled losses and gradients compared
    env       versions (torch, CUDA, cuDNN, NCCL, Triton, driver); no CUDA: refused
    numerics  eager vs compiled on one device, and at TP2 on two spawned ranks
    btp       BTP on a 1-rank group, 24 blocks, bf16: one graph, hi/lo statistic, eager
    sdpa      which attention kernel each architecture ran (profiler)
    perf      GEMM rates, tokens/s and MFU, every run's peak memory
    trainer   NGPU=1 ./run_train.sh, compiled, step profiler, step guard
    report    failures, the exit status and the markdown summary
    cli       argument parsing and the run (``__main__`` calls it)
"""

from __future__ import annotations

from boost_titan.perf.gpu_check.btp import btp
from boost_titan.perf.gpu_check.cli import main, run
from boost_titan.perf.gpu_check.common import (
    ARCHS,
    GRAD_RTOL,
    LOCAL_TENSOR_NOTE,
    LOSS_RTOL,
    NUMERIC_STEPS,
    SECTIONS,
    SMOKE,
    THROUGHPUT_ARCHS,
    PeakMemory,
    Sizes,
    batch,
    build_model,
    compile_like_trainer,
    fail_rather_than_fall_back,
    graphs_compiled,
    guarded,
    model_args,
    release,
)
from boost_titan.perf.gpu_check.env import require_cuda, versions
from boost_titan.perf.gpu_check.numerics import numerics, tp2
from boost_titan.perf.gpu_check.perf import gemm, memory, peak_flops, throughput
from boost_titan.perf.gpu_check.report import exit_status, failures, markdown
from boost_titan.perf.gpu_check.sdpa import sdpa
from boost_titan.perf.gpu_check.steps import (
    adamw,
    compare,
    local,
    plain_name,
    scalar,
    sync,
    train_steps,
)
from boost_titan.perf.gpu_check.trainer import trainer

__all__ = [
    "ARCHS",
    "GRAD_RTOL",
    "LOCAL_TENSOR_NOTE",
    "LOSS_RTOL",
    "NUMERIC_STEPS",
    "PeakMemory",
    "SECTIONS",
    "SMOKE",
    "Sizes",
    "THROUGHPUT_ARCHS",
    "adamw",
    "batch",
    "btp",
    "build_model",
    "compare",
    "compile_like_trainer",
    "exit_status",
    "fail_rather_than_fall_back",
    "failures",
    "gemm",
    "graphs_compiled",
    "guarded",
    "local",
    "main",
    "markdown",
    "memory",
    "model_args",
    "numerics",
    "peak_flops",
    "plain_name",
    "release",
    "require_cuda",
    "run",
    "scalar",
    "sdpa",
    "sync",
    "throughput",
    "tp2",
    "train_steps",
    "trainer",
    "versions",
]
