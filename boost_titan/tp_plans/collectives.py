"""The collectives every plan is built from. Autograd-aware ones are DTensor
redistributions on local tensors; the ``raw_*`` ones are plain functional collectives
for custom autograd functions' forward and backward (``LatentUp``). CommDebugMode /
CommCounter see both."""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard


def all_reduce(partial: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Sum a per-rank partial tensor: Partial -> Replicate, one all-reduce.

    Backward is free: the gradient of a replicated sum is the same replicated tensor
    on every rank (DTensor keeps it Replicate through the Partial source)."""
    return (
        DTensor.from_local(partial, mesh, [Partial()]).redistribute(mesh, [Replicate()]).to_local()
    )


def reduce_scatter(partial: torch.Tensor, dim: int, mesh: DeviceMesh) -> torch.Tensor:
    """Sum a per-rank partial tensor, keep this rank's ``dim`` shard: Partial ->
    Shard(dim), one reduce-scatter; backward all-gathers the shards' gradients."""
    return (
        DTensor.from_local(partial, mesh, [Partial()]).redistribute(mesh, [Shard(dim)]).to_local()
    )


def shard(full: torch.Tensor, dim: int, mesh: DeviceMesh) -> torch.Tensor:
    """This rank's ``dim`` slice of a tensor (no collective); backward all-gathers the
    slices' gradients into one gradient for the whole tensor."""
    return (
        DTensor.from_local(full, mesh, [Replicate()], run_check=False)
        .redistribute(mesh, [Shard(dim)])
        .to_local()
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


def _waited(t: torch.Tensor) -> torch.Tensor:
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


def raw_all_reduce(t: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    return _waited(funcol.all_reduce(t, "sum", mesh))


def raw_all_gather(shard: torch.Tensor, dim: int, mesh: DeviceMesh) -> torch.Tensor:
    """The ranks' ``dim`` shards concatenated in rank order."""
    return _waited(funcol.all_gather_single(shard.contiguous(), dim, mesh))


def raw_reduce_scatter(t: torch.Tensor, dim: int, mesh: DeviceMesh) -> torch.Tensor:
    """The sum over ranks, this rank's ``dim`` shard of it."""
    return _waited(funcol.reduce_scatter_single(t.contiguous(), "sum", dim, mesh))
