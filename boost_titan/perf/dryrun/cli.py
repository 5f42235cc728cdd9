"""``boost-titan dryrun``: see the package docstring."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

import boost_titan.perf.dryrun as package
from boost_titan.config import Parser, refuse
from boost_titan.perf.dryrun.report import GIB, budget_bytes, fits, format_reports
from boost_titan.perf.dryrun.run import dry_run, measure, quiet_warnings

PROG = "boost-titan dryrun"


def main(argv: list[str] | None = None) -> int:
    from boost_titan.parallel import cpu_runtime

    cpu_runtime.activate()
    quiet_warnings()
    from boost_titan.train.config_check import check_config, parse_config

    ap = Parser(
        prog=PROG,
        description=package.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--config", required=True, help="TOML config (a recipe)")
    ap.add_argument("--ngpu", type=int, required=True, help="world size of the launch")
    ap.add_argument("--gpu-memory", type=float, default=80.0, help="GiB per GPU (default 80)")
    ap.add_argument(
        "--headroom",
        type=float,
        default=0.1,
        help="fraction of --gpu-memory kept free for what the trace does not see (CUDA "
        "context, NCCL buffers, fragmentation; default 0.1)",
    )
    ap.add_argument("--json", action="store_true", help="print the reports as JSON")
    ap.add_argument(
        "--measure",
        action="store_true",
        help="measure on real ranks instead (under torchrun with --ngpu processes)",
    )
    a, overrides = ap.parse_known_args(argv)
    if a.ngpu < 1:
        ap.error(f"--ngpu {a.ngpu} must be >= 1")
    config_args = ["--job.config_file", a.config, *overrides]
    try:
        config = parse_config(config_args)
        check_config(config, world_size=a.ngpu, files=False)
    except (ValueError, FileNotFoundError) as e:
        refuse(PROG, e)
    config.compile.enable = False  # eager figures (see the module docstring)
    if a.measure:
        reports = measure(config)
        if reports is None:
            return 0
    else:
        reports = dry_run(config_args, a.ngpu, config.parallelism.pipeline_parallel_degree)
    ok = fits(reports, a.gpu_memory, a.headroom)
    if a.json:
        print(
            json.dumps(
                {
                    "config": a.config,
                    "ngpu": a.ngpu,
                    "gpu_memory_gib": a.gpu_memory,
                    "headroom": a.headroom,
                    "fits": ok,
                    "roles": [asdict(r) for r in reports],
                },
                indent=2,
            )
        )
    else:
        budget = budget_bytes(a.gpu_memory, a.headroom)
        print(
            f"{a.config} on {a.ngpu} GPUs of {a.gpu_memory:g} GiB "
            f"(budget {budget / GIB:.1f} GiB: {a.headroom:.0%} headroom)"
        )
        print(format_reports(reports, a.gpu_memory, a.headroom))
        for r in reports:
            if r.peak_bytes > budget:
                print(
                    f"does not fit: {r.role} needs {r.peak_bytes / GIB:.1f} GiB per rank "
                    f"> {budget / GIB:.1f} GiB ({a.gpu_memory:g} GiB less {a.headroom:.0%})",
                    file=sys.stderr,
                )
    return 0 if ok else 1
