"""Measure this machine's matmul peak, for MFU on CPU (``[boost] cpu_peak_flops``).

    boost-titan peak-flops [--threads N] [--n 1024] [--seconds 3]

Run it with the thread count a training rank gets (``run_train.sh`` gives each rank
nproc / NGPU threads unless OMP_NUM_THREADS is set) and put the printed figure in the TOML.
"""

from __future__ import annotations

import argparse

import torch

from boost_titan.config import Parser
from boost_titan.parallel.cpu_runtime import measure_matmul_peak_flops


def main(argv: list[str] | None = None) -> None:
    p = Parser(
        prog="boost-titan peak-flops",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--threads",
        type=int,
        default=torch.get_num_threads(),
        help="CPU threads (default: torch's, here %(default)s)",
    )
    p.add_argument("--n", type=int, default=1024, help="square matmul size")
    p.add_argument("--seconds", type=float, default=3.0, help="time to measure (default 3)")
    p.add_argument(
        "--dtype", choices=["float32", "bfloat16"], default="float32", help="default float32"
    )
    a = p.parse_args(argv)
    if a.threads < 1 or a.n < 1 or not a.seconds > 0:
        p.error(f"--threads and --n must be >= 1 and --seconds > 0, got {a.threads}, {a.n}, "
                f"{a.seconds}")  # fmt: skip
    torch.set_num_threads(a.threads)
    flops = measure_matmul_peak_flops(a.n, getattr(torch, a.dtype), a.seconds)
    print(f"{a.dtype} {a.n}x{a.n}x{a.n} matmul, {a.threads} thread(s): {flops:.3e} FLOP/s")
    print(f"[boost]\ncpu_peak_flops = {flops:.3e}")
