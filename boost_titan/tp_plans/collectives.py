"""The autograd-aware collectives every plan is built from (DTensor redistributions
on local tensors, so CommDebugMode / CommCounter see them)."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard


def all_reduce(partial: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Sum a per-rank partial tensor: Partial -> Replicate, one all-reduce.

    Backward is free: the gradient of a replicated sum is the same replicated tensor
    on every rank (DTensor keeps it Replicate through the Partial source)."""
    return (
        DTensor.from_local(partial, mesh, [Partial()]).redistribute(mesh, [Replicate()]).to_local()
    )


def all_reduce_grad(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Identity forward; all-reduce of the gradient backward (Megatron's "f"): for a
    replicated tensor consumed by a sharded GEMM, whose input gradient is partial."""
    return DTensor.from_local(x, mesh, [Replicate()], run_check=False).to_local(
        grad_placements=[Partial()]
    )


def all_gather_last(shard: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Concatenate the ranks' last-dim shards (all-gather); backward keeps this rank's
    slice of the (replicated) gradient, no collective."""
    return (
        DTensor.from_local(shard, mesh, [Shard(-1)], run_check=False)
        .redistribute(mesh, [Replicate()])
        .to_local()
    )


def shard_last(full: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """This rank's slice of a replicated tensor's last dim; backward all-gathers the
    slices' gradients back into a replicated gradient."""
    return (
        DTensor.from_local(full, mesh, [Replicate()], run_check=False)
        .redistribute(mesh, [Shard(-1)])
        .to_local()
    )
