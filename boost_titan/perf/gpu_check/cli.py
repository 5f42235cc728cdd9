"""One command for a GPU machine: compiled numerics, BTP on one GPU, SDPA kernels, GEMM
rates, throughput, memory and the trainer end to end.

    bash benchmarks/gpu_check.sh                  # one GPU (refused without CUDA)
    bash benchmarks/gpu_check.sh --smoke          # the same code paths on CPU, tiny shapes
    boost-titan gpu-check [--out DIR] [--smoke] [--batch B] [--seq S] [--steps N]

Sections, all in ``<out>/gpu_check.json`` (default ``outputs/gpu_check``), with a
markdown summary printed at the end; ``versions`` (torch, CUDA, cuDNN, NCCL, Triton,
driver) and ``peak_flops`` (the figure MFU divides by, and its source; on CPU measured
just before the throughput runs) are recorded too:

* ``numerics``: eager vs ``torch.compile`` (per block, as the trainer via
  ``boost_titan.parallel.compile.apply_compile``, loss compiled too) for every architecture
  (dense, svd, cola, lax) on one device, fp32: loss and gradient differences over two
  AdamW steps. Must agree within 1e-4 relative (loss) and 1e-3 (gradients).
* ``tp2``: the same at TP2 (full-rank plan for dense, BTP for low-rank) on two ranks:
  GPUs 0 and 1 when two are visible, two gloo CPU ranks with ``--smoke``; skipped
  otherwise. Simulated TP in one process (tests/tp_sim.py, LocalTensorMode) cannot be
  compiled: AOTAutograd fails on LocalTensor x FunctionalTensor (torch 2.13).
* ``btp``: BTP on a 1-rank group, 24 blocks, bf16, compiled: one Dynamo graph for all
  CoLA blocks (LaX: two), the Online-RMSNorm statistic's hi/lo split intact under
  inductor, eager == compiled (:mod:`boost_titan.perf.gpu_check.btp`).
* ``sdpa``: which attention kernel (flash, efficient, cuDNN, math) each architecture's
  forward ran, fp32 and bf16, from a profiler trace (:mod:`boost_titan.perf.gpu_check.sdpa`).
* ``gemm``: per-plan per-rank GEMM TFLOP/s at 7B/TP4 shapes (``bench.gemm.gemm_bench``,
  as ``boost-titan bench --gemm``).
* ``throughput``: tokens/s and MFU of CoLA 350m and its dense twin, bf16 autocast
  (torchtitan's single-device mixed precision), eager and compiled, a few steps after
  warm-up (the first, compiling step timed separately).
* ``trainer``: ``NGPU=1 ./run_train.sh`` on the one-process CoLA debug config,
  compiled, with the step profiler and an injected NaN loss the step guard must skip
  (:mod:`boost_titan.perf.gpu_check.trainer`).
* ``memory``: peak memory of every run above (``torch.cuda.max_memory_allocated``;
  on CPU the peak RSS rise, a coarser figure).

Exit status: 0 when every section passed; otherwise ``10 + i`` for the first failing
section, ``i`` its index in ``SECTIONS`` (numerics 10, tp2 11, btp 12, sdpa 13, gemm 14,
throughput 15, trainer 16), and every failing section named on stderr; 2 for a refused
command line (the full check without CUDA, a bad flag).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from boost_titan.config import Parser
from boost_titan.perf.gpu_check.btp import btp
from boost_titan.perf.gpu_check.common import (
    SECTIONS,
    SMOKE,
    Sizes,
    fail_rather_than_fall_back,
    guarded,
)
from boost_titan.perf.gpu_check.env import require_cuda, versions
from boost_titan.perf.gpu_check.numerics import numerics, tp2
from boost_titan.perf.gpu_check.perf import gemm, memory, peak_flops, throughput
from boost_titan.perf.gpu_check.report import exit_status, failures, markdown
from boost_titan.perf.gpu_check.sdpa import sdpa
from boost_titan.perf.gpu_check.trainer import trainer


def run(
    sizes: Sizes,
    smoke: bool,
    backend: str,
    sections: tuple[str, ...] = SECTIONS,
    out: Path = Path("outputs/gpu_check"),
) -> dict:
    """The chosen sections, in order, each one's wall time recorded; then memory."""
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    fail_rather_than_fall_back()
    start = time.perf_counter()
    results = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
        "torch": torch.__version__,
        "versions": versions(),
        "backend": backend,
        "smoke": smoke,
        "sizes": asdict(sizes),
        "section_seconds": {},
    }
    fns = {
        "numerics": lambda: numerics(sizes, device, backend),
        "tp2": lambda: tp2(sizes, smoke, backend),
        "btp": lambda: btp(sizes, device, backend),
        "sdpa": lambda: sdpa(sizes, device),
        "gemm": lambda: gemm(sizes),
        "throughput": lambda: throughput(sizes, device, backend),
        "trainer": lambda: trainer(sizes, backend, out),
    }
    for name in sections:
        t0 = time.perf_counter()
        results[name] = guarded(fns[name])
        results["section_seconds"][name] = time.perf_counter() - t0
        print(f"[gpu_check] {name} done in {results['section_seconds'][name]:.0f} s", flush=True)
    # the figure MFU divided by: the GPU's datasheet value; on CPU measured, just before
    # the throughput runs (a figure from minutes earlier can be far off on a busy CPU)
    t = results.get("throughput", {})
    peak, source = (
        (t["peak_flops"], t["peak_flops_source"]) if "peak_flops" in t else peak_flops(device)
    )
    results["peak_flops"] = {"value": peak, "source": source}
    results["memory"] = memory(results, device)
    results["seconds"] = time.perf_counter() - start
    return results


def _sizes(a: argparse.Namespace) -> Sizes:
    base = SMOKE if a.smoke else Sizes()
    given = {
        k: v
        for k, v in (
            ("throughput_batch", a.batch),
            ("throughput_seq", a.seq),
            ("steps", a.steps),
            ("warmup", a.warmup),
        )
        if v is not None
    }
    return Sizes(**{**asdict(base), **given})


def main(argv: list[str] | None = None) -> None:
    p = Parser(
        prog="boost-titan gpu-check",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", default="outputs/gpu_check", help="folder for gpu_check.json")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="CPU, tiny shapes: checks the code paths in a few minutes (without it, "
        "no CUDA device is refused)",
    )
    p.add_argument(
        "--backend",
        default=None,
        help="torch.compile backend (default inductor; --smoke: aot_eager, which traces and "
        "partitions as inductor does but skips C++ code generation, minutes on a small CPU)",
    )
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list of {list(SECTIONS)}")
    p.add_argument(
        "--batch",
        type=int,
        default=None,
        help=f"throughput batch (default {Sizes.throughput_batch})",
    )
    p.add_argument(
        "--seq",
        type=int,
        default=None,
        help=f"throughput sequence length (default {Sizes.throughput_seq})",
    )
    p.add_argument(
        "--steps", type=int, default=None, help=f"timed throughput steps (default {Sizes.steps})"
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=None,
        help=f"untimed steps after the compiling one (default {Sizes.warmup})",
    )
    a = p.parse_args(argv)
    for flag in ("batch", "seq", "steps"):
        if getattr(a, flag) is not None and getattr(a, flag) < 1:
            p.error(f"--{flag} must be >= 1, got {getattr(a, flag)}")
    if a.warmup is not None and a.warmup < 0:
        p.error(f"--warmup must be >= 0, got {a.warmup}")
    sections = tuple(s.strip() for s in a.sections.split(","))
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        p.error(f"unknown sections {unknown}; valid: {list(SECTIONS)}")
    require_cuda(a.smoke)
    backend = a.backend or ("aot_eager" if a.smoke else "inductor")
    from boost_titan.parallel import cpu_runtime

    cpu_runtime.activate()
    out = Path(a.out)
    results = run(_sizes(a), a.smoke, backend, sections, out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(results, indent=2))
    print(markdown(results))
    print(f"wrote {out / 'gpu_check.json'}")
    bad = failures(results)
    if bad:  # the file is written first, so the numbers can be inspected
        failed = list(dict.fromkeys(section for section, _ in bad))
        print(
            f"gpu_check: FAILED sections: {', '.join(failed)}\n  "
            + "\n  ".join(f"{section}: {line}" for section, line in bad),
            file=sys.stderr,
        )
        raise SystemExit(exit_status(failed))
