"""BTP on one GPU (``btp``): a 24-block model (``--smoke``: 9 blocks, 64 wide) under
the BTP plan on a 1-rank process group (NCCL on a GPU, gloo with ``--smoke``), bf16
autocast, its blocks compiled as the trainer compiles them (per block, fullgraph).
Three checks:

* **one graph for all blocks**: Dynamo compiles exactly one graph for all CoLA blocks
  (a per-block Python value read under compile, such as a block's profiler label,
  makes each block its own graph and, past Dynamo's recompile limit of 8, fails at
  block 9: the depth is kept above 8 so that this fails, not just slows). A LaX model
  has exactly two: block 0 has no latent crossing (no previous block's latents, other
  inputs and parameters), every later block shares the second.
* **statistic hi/lo intact**: ``BTPComm.reduce_down`` on a bf16 latent with fp32
  Online-RMSNorm statistics, compiled with **inductor** (the backend whose fusion once
  dropped the hi/lo split's rounding, leaving lo = 0), returns the all-reduced
  statistic bitwise equal to eager's and within 2^-16 relative of the fp32 statistic
  (a collapsed split, plain bf16, is off by up to 2^-9).
* **eager == compiled**: losses and gradients of one bf16 training step, compiled vs
  eager, within bf16 tolerances (``BF16_LOSS_RTOL``, ``BF16_GRAD_RTOL``).
"""

from __future__ import annotations

import copy
import os
import tempfile
import time

import torch
import torch.distributed as dist

from boost_titan.perf.gpu_check.common import (
    Sizes,
    batch,
    build_model,
    graphs_compiled,
    guarded,
    release,
)
from boost_titan.perf.gpu_check.steps import adamw, compare, train_steps

BTP_ARCHS = {"cola": 1, "lax": 2}  # architecture -> Dynamo graphs all its blocks compile to
STAT_RTOL = 2.0**-16  # hi + lo carry 16 mantissa bits: ~2^-17 relative; plain bf16 2^-9
BF16_LOSS_RTOL = 1e-2  # compiled vs eager, bf16 autocast: kernels round differently
BF16_GRAD_RTOL = 5e-2


def btp_args(arch: str, sizes: Sizes):
    """The numerics flavor at ``btp_layers`` blocks (smoke: ``btp_dim`` wide)."""
    from boost_titan.models.flavors import flavors_for

    args = copy.deepcopy(flavors_for(arch)[sizes.numerics_flavor])
    args.n_layers, args.max_seq_len = sizes.btp_layers, sizes.btp_seq
    if sizes.btp_dim is not None:
        args.dim, args.ffn_dim, args.vocab_size, args.n_heads = (
            sizes.btp_dim,
            -(-sizes.btp_dim * 8 // 3 // 8) * 8,
            512,
            4,
        )
        args.rank = sizes.btp_dim // 4
    args.validate()
    return args


def btp(sizes: Sizes, device: torch.device, backend: str) -> dict:
    """The three checks on a 1-rank process group in this process."""
    cuda = device.type == "cuda"
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group(
            "nccl" if cuda else "gloo",
            init_method=f"file://{os.path.join(tmp, 'init')}",
            rank=0,
            world_size=1,
            **({"device_id": device} if cuda else {}),
        )
        try:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh(device.type, (1,))
            stat = guarded(_statistic, mesh, device)
            archs = {
                arch: guarded(_btp_arch, arch, sizes, device, backend, mesh) for arch in BTP_ARCHS
            }
        finally:
            dist.destroy_process_group()
    return {
        "group": f"1 rank ({'nccl' if cuda else 'gloo'})",
        "layers": sizes.btp_layers,
        "dtype": "bfloat16 autocast, fp32 weights",
        "batch": sizes.btp_batch,
        "seq": sizes.btp_seq,
        "backend": backend,
        "loss_rtol": BF16_LOSS_RTOL,
        "grad_rtol": BF16_GRAD_RTOL,
        "statistic": stat,
        "archs": archs,
    }


def _statistic(mesh, device: torch.device) -> dict:
    """``reduce_down`` eager vs inductor on a bf16 latent: the all-reduced statistic."""
    from boost_titan.tp_plans.btp import BTPComm

    comm = BTPComm(mesh)
    g = torch.Generator().manual_seed(7)
    # per-token sums of squares of a d/T = 512 shard: O(100-1000), full fp32 mantissas
    stats = (torch.rand(4, 64, 1, generator=g) * 1000 + 100).to(device)
    latent = torch.randn(4, 64, 32, generator=g).to(device, torch.bfloat16)

    def fn(latent, stats):
        return comm.reduce_down(latent, stats)

    eager_latent, eager_total = fn(latent, stats)
    t0 = time.perf_counter()
    compiled_latent, compiled_total = torch.compile(fn, backend="inductor", fullgraph=True)(
        latent, stats
    )
    seconds = time.perf_counter() - t0
    torch._dynamo.reset()
    rel = ((compiled_total - stats).abs() / stats).max().item()
    plain_bf16 = ((stats.to(torch.bfloat16).float() - stats).abs() / stats).max().item()
    bitwise = torch.equal(compiled_total, eager_total) and torch.equal(
        compiled_latent, eager_latent
    )
    return {
        "backend": "inductor",
        "bitwise_equal_eager": bitwise,
        "max_rel_diff_vs_fp32": rel,
        "plain_bf16_max_rel_diff": plain_bf16,  # what a collapsed split (lo = 0) gives
        "rtol": STAT_RTOL,
        "compile_s": seconds,
        "ok": bitwise and rel <= STAT_RTOL,
    }


def _btp_arch(arch: str, sizes: Sizes, device: torch.device, backend: str, mesh) -> dict:
    from types import SimpleNamespace

    from torchtitan.components.loss import cross_entropy_loss

    from boost_titan.parallel.compile import apply_compile
    from boost_titan.tp_plans import apply_tp_plan

    args = btp_args(arch, sizes)
    job = SimpleNamespace(
        boost=SimpleNamespace(
            rmsnorm="online", sequence_parallel=False, sequence_parallel_keep_gathered=False
        )
    )
    tokens, labels = batch(args.vocab_size, sizes.btp_batch, sizes.btp_seq, device)
    runs, graphs = {}, None
    for mode in ("eager", "compiled"):
        model = build_model(
            args,
            device,
            lambda m: apply_tp_plan("btp", m, mesh, loss_parallel=False, job_config=job),
        )
        if mode == "compiled":
            # the blocks only (the loss stays eager): every graph counted is a block's
            apply_compile(model, SimpleNamespace(backend=backend))
        before = graphs_compiled()
        try:
            runs[mode] = train_steps(
                model,
                adamw(model),
                cross_entropy_loss,
                tokens,
                labels,
                1,
                amp_dtype=torch.bfloat16,
                keep_grads=True,
            )
        except torch._dynamo.exc.FailOnRecompileLimitHit as e:
            raise RuntimeError(
                f"{arch}: the blocks recompiled past Dynamo's recompile limit "
                f"({torch._dynamo.config.recompile_limit}) after "
                f"{graphs_compiled() - before} graphs for {args.n_layers} blocks "
                f"(expected {BTP_ARCHS[arch]}): a compiled block reads a per-block Python "
                "value (TORCH_LOGS=recompiles names the guard)"
            ) from e
        if mode == "compiled":
            graphs = graphs_compiled() - before
        del model
        release(device)
    row = compare(runs["eager"], runs["compiled"])
    expected = BTP_ARCHS[arch]
    row["block_graphs"] = graphs
    row["block_graphs_expected"] = expected
    row["ok"] = (
        graphs == expected
        and row["loss_max_rel_diff"] <= BF16_LOSS_RTOL
        and row["grad_max_rel_diff"] <= BF16_GRAD_RTOL
    )
    return row
