"""``boost-titan step-time``: one layout's predicted step time, term by term, or the
calibration table (``--paper``) against the BOOST paper's A100 times.

    boost-titan step-time --model cola_llama2 --flavor 7b --gpu a100-40 --tp 4
    boost-titan step-time --paper            # the calibration table (A100)
    boost-titan step-time --paper --calibrate outputs/gpu_check/gpu_check.json

The model: :mod:`boost_titan.perf.step_time`; its calibration:
:mod:`boost_titan.perf.calibration`."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from boost_titan.config import Parser, refuse
from boost_titan.perf.calibration import (
    calibrate_from_gpu_check,
    calibration,
    default_efficiency,
    format_calibration,
)
from boost_titan.perf.hardware import GPUS, resolve_gpu
from boost_titan.perf.step_time import CHECKPOINTS, SCHEDULES, Efficiency, Layout, step_time

PROG = "boost-titan step-time"


def main(argv: list[str] | None = None) -> int:
    from boost_titan.parallel import cpu_runtime

    cpu_runtime.activate()  # before the flavors import torchtitan
    ap = Parser(
        prog=PROG,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--paper", action="store_true", help="fit and print the calibration table")
    ap.add_argument("--calibrate", help="refit on a gpu_check.json (its GEMM rates)")
    ap.add_argument("--model", default="cola_llama2", help="the model (default %(default)s)")
    ap.add_argument("--flavor", default="7b", help="the model's size (default %(default)s)")
    ap.add_argument(
        "--gpu",
        default="a100-40",
        help=f"a known GPU: {', '.join(GPUS)} (default %(default)s)",
    )
    ap.add_argument("--gpu-file", help="a custom GPU (TOML; see boost_titan.perf.hardware)")
    ap.add_argument("--plan", default=None, help="default: btp for low-rank, fullrank for dense")
    ap.add_argument("--tp", type=int, default=4, help="tensor parallel degree (default 4)")
    ap.add_argument("--cp", type=int, default=1, help="context parallel degree")
    ap.add_argument("--pp", type=int, default=1, help="pipeline parallel degree (stages)")
    ap.add_argument("--dp-shard", type=int, default=1, help="FSDP degree (data parallel, sharded)")
    ap.add_argument(
        "--dp-replicate", type=int, default=1, help="data parallel replicas (DDP / HSDP)"
    )
    ap.add_argument(
        "--micro-batch",
        type=int,
        default=4,
        help="sequences per microbatch (default 4)",
    )
    ap.add_argument(
        "--microbatches",
        type=int,
        default=1,
        help="microbatches per step per replica: the pipeline's, or gradient accumulation",
    )
    ap.add_argument("--seq", type=int, default=4096, help="sequence length (default 4096)")
    ap.add_argument(
        "--schedule", default="1F1B", choices=SCHEDULES, help="pipeline schedule (with --pp)"
    )
    ap.add_argument(
        "--stages-per-rank",
        type=int,
        default=1,
        help="pipeline stages per rank (2: a looped / interleaved schedule)",
    )
    ap.add_argument(
        "--checkpoint",
        default="none",
        choices=CHECKPOINTS,
        help="recomputed in backward: latent checkpointing's chunks (mlp, attention, both) "
        "or torchtitan's full AC (full)",
    )
    ap.add_argument(
        "--gpus-per-node", type=int, default=8, help="GPUs per node: where TP and CP stay in NVLink"
    )
    ap.add_argument("--json", action="store_true", help="print the breakdown as JSON")
    a = ap.parse_args(argv)
    try:
        if a.paper:
            cal = calibration()
            print(json.dumps(cal, indent=2) if a.json else format_calibration(cal))
            if a.calibrate:
                print(calibrate_from_gpu_check(a.calibrate, Efficiency(**cal["efficiency"]))[2])
            return 0
        from boost_titan.models.flavors import MODEL_ARCH, flavors_for

        if a.model not in MODEL_ARCH:
            raise ValueError(f"unknown model {a.model!r}; valid: {sorted(MODEL_ARCH)}")
        table = flavors_for(MODEL_ARCH[a.model])
        if a.flavor not in table:
            raise ValueError(f"unknown flavor {a.flavor!r}; valid: {sorted(table)}")
        args = table[a.flavor]
        hw = resolve_gpu(a.gpu, a.gpu_file)
        eff, source = default_efficiency(a.calibrate)
        plan = a.plan or ("btp" if args.low_rank else "fullrank")
        lay = Layout(
            plan,
            a.tp,
            a.pp,
            a.dp_shard,
            a.dp_replicate,
            a.micro_batch,
            a.seq,
            a.microbatches,
            a.schedule,
            a.stages_per_rank,
            a.checkpoint,
            a.gpus_per_node,
            a.cp,
        )
        bd = step_time(args, lay, hw, eff)
    except ValueError as e:
        refuse(PROG, e)
    if a.json:
        print(
            json.dumps(
                dict(
                    layout=asdict(lay),
                    gpu=hw.name,
                    terms=bd.terms,
                    step_s=bd.step_s,
                    tokens_per_s=bd.tokens_per_s(),
                    cp_ring_bytes_per_step=bd.ring_bytes_per_step,
                ),
                indent=2,
            )
        )
    else:
        print(f"{a.model} {a.flavor} on {hw.name}: {lay.describe()}")
        print(source)
        print(bd.format())
        print(f"tokens/s (whole job) {bd.tokens_per_s():,.0f}")
    return 0
