"""Numerics: eager vs ``torch.compile`` for every architecture, fp32, on one device
(``numerics``) and at TP2 under the trainer's plan on two spawned ranks (``tp2``: two
GPUs, or two gloo CPU ranks with ``--smoke``)."""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

from boost_titan.perf.gpu_check.common import (
    ARCHS,
    GRAD_RTOL,
    LOCAL_TENSOR_NOTE,
    LOSS_RTOL,
    NUMERIC_STEPS,
    PeakMemory,
    Sizes,
    batch,
    build_model,
    compile_like_trainer,
    fail_rather_than_fall_back,
    guarded,
    model_args,
    release,
)
from boost_titan.perf.gpu_check.steps import adamw, compare, train_steps


def numerics(sizes: Sizes, device: torch.device, backend: str) -> dict:
    """Eager vs compiled, every architecture, one device, fp32."""
    torch.set_float32_matmul_precision("highest")  # no TF32: compare fp32 with fp32
    rows = {arch: guarded(_numerics_arch, arch, sizes, device, backend) for arch in ARCHS}
    return {
        "dtype": "float32",
        "flavor": sizes.numerics_flavor,
        "batch": sizes.numerics_batch,
        "seq": sizes.numerics_seq,
        "steps": NUMERIC_STEPS,
        "loss_rtol": LOSS_RTOL,
        "grad_rtol": GRAD_RTOL,
        "archs": rows,
    }


def _numerics_arch(arch: str, sizes: Sizes, device: torch.device, backend: str) -> dict:
    from torchtitan.components.loss import cross_entropy_loss

    mem = PeakMemory(device)
    args = model_args(arch, sizes.numerics_flavor, sizes.numerics_seq, sizes.numerics_dim)
    tokens, labels = batch(args.vocab_size, sizes.numerics_batch, sizes.numerics_seq, device)
    runs, peaks = {}, {}
    try:
        for mode in ("eager", "compiled"):
            model = build_model(args, device)
            loss_fn = (
                compile_like_trainer(model, backend) if mode == "compiled" else cross_entropy_loss
            )
            mem.start()
            runs[mode] = train_steps(
                model, adamw(model), loss_fn, tokens, labels, NUMERIC_STEPS, keep_grads=True
            )
            peaks[f"{mode}_peak_mem_mib"] = mem.peak_mib()
            del model
    finally:
        release(device)
    return {**compare(runs["eager"], runs["compiled"]), **peaks}


def _tp2_worker(rank: int, cfg: dict, init_file: str, out_file: str) -> None:
    from boost_titan.parallel import cpu_runtime

    cpu_runtime.activate()
    cuda = cfg["cuda"]
    if cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)
    dist.init_process_group(
        "nccl" if cuda else "gloo", init_method=f"file://{init_file}", rank=rank, world_size=2
    )
    try:
        from boost_titan.parallel.compile import use_rank_local_compile_cache

        use_rank_local_compile_cache()  # before anything compiles (see compile.py)
        fail_rather_than_fall_back()
        device = torch.device("cuda", rank) if cuda else torch.device("cpu")
        rows = {arch: _tp2_arch(arch, cfg, device) for arch in cfg["sizes"]["tp2_archs"]}
        if rank == 0:
            Path(out_file).write_text(json.dumps(rows))
    finally:
        dist.destroy_process_group()


def _tp2_arch(arch: str, cfg: dict, device: torch.device) -> dict:
    """One architecture at TP2 under the trainer's plan for it, eager vs compiled."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel
    from torchtitan.components.loss import cross_entropy_loss

    from boost_titan.tp_plans import apply_tp_plan, resolve_tp_plan

    sizes = Sizes(**cfg["sizes"])
    args = model_args(arch, sizes.numerics_flavor, sizes.numerics_seq, sizes.numerics_dim)
    plan = resolve_tp_plan("auto", args)  # fullrank for dense, btp for low-rank
    mesh = init_device_mesh(device.type, (2,))
    job = SimpleNamespace(
        boost=SimpleNamespace(
            rmsnorm="online", sequence_parallel=False, sequence_parallel_keep_gathered=False
        )
    )
    tokens, labels = batch(args.vocab_size, sizes.numerics_batch, sizes.numerics_seq, device)
    runs = {}
    for mode in ("eager", "compiled"):
        model = build_model(
            args, device, lambda m: apply_tp_plan(plan, m, mesh, loss_parallel=True, job_config=job)
        )
        loss_fn = (
            compile_like_trainer(model, cfg["backend"])
            if mode == "compiled"
            else cross_entropy_loss
        )
        runs[mode] = train_steps(
            model,
            adamw(model),
            loss_fn,
            tokens,
            labels,
            NUMERIC_STEPS,
            context=loss_parallel,
            keep_grads=True,
        )
        del model
        release(device)
    row = compare(runs["eager"], runs["compiled"])
    # gradients were compared shard by shard: the worst over both ranks
    worst = torch.tensor([row["grad_max_rel_diff"]], device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    row["grad_max_rel_diff"] = worst.item()
    row["ok"] = row["loss_max_rel_diff"] <= LOSS_RTOL and row["grad_max_rel_diff"] <= GRAD_RTOL
    return {"plan": plan, **row}


def tp2(sizes: Sizes, smoke: bool, backend: str) -> dict:
    """TP2 eager vs compiled on two real ranks, when there are two."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < 2 and not (smoke and gpus == 0):
        return {
            "ran": False,
            "reason": f"needs 2 GPUs, {gpus} visible",
            "note": LOCAL_TENSOR_NOTE,
            "archs": {},
        }
    cfg = {"cuda": gpus >= 2, "sizes": asdict(sizes), "backend": backend}
    with tempfile.TemporaryDirectory() as tmp:
        out_file = os.path.join(tmp, "tp2.json")
        torch.multiprocessing.spawn(
            _tp2_worker, args=(cfg, os.path.join(tmp, "init"), out_file), nprocs=2
        )
        rows = json.loads(Path(out_file).read_text())
    return {
        "ran": True,
        "ranks": "2 GPUs (nccl)" if cfg["cuda"] else "2 CPU ranks (gloo)",
        "dtype": "float32",
        "note": LOCAL_TENSOR_NOTE,
        "loss_rtol": LOSS_RTOL,
        "grad_rtol": GRAD_RTOL,
        "archs": rows,
    }
