"""Vanilla low-rank TP: the naive integration BOOST is measured against (baseline).

Every bottleneck is its own Megatron chunk: A column-parallel (splits r), B
row-parallel (splits r), an all-reduce of [b, s, out] after every B. The residual
stream, norms, attention and SwiGLU are replicated: q/k/v come out of their all-reduces
whole, so every rank computes every head, as in the authors' release (splitting heads
would need q/k/v gathered per rank anyway and changes nothing about the volume the
paper compares). Per block and direction:

    forward: all-reduce after B_q, B_k, B_v, B_o, B_gate, B_up, B_down = b s (5d + 2f)
    backward: all-reduce of each A group's input gradient (x for A_q|A_k|A_v, o for A_o,
              h for A_gate|A_up, the SwiGLU output for A_down) = b s (3d + f)
    LaX: the gate and latent norm need whole latents: an all-gather per crossing forward
         and one per latent gradient backward.

Stack ends: vocab-parallel embedding (all-reduce of [b, s, d]), replicated final norm,
vocab-parallel LM head with loss-parallel cross-entropy.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from boost_titan.models.bottleneck import LatentComm, rms_normalize

from .collectives import all_gather_last, all_reduce, all_reduce_grad, shard_last
from .styles import LowRankBlockParallel, ReplicatedModule, ShardParameters


class VanillaComm(LatentComm):
    def __init__(self, mesh: DeviceMesh):
        self.mesh = mesh

    def normalize_input(self, x: torch.Tensor, stats: torch.Tensor, eps: float, dim: int):
        # the residual is replicated, so the statistics are already whole: normalise
        # first, as the authors' release does, then enter the chunk
        return rms_normalize(x, stats, eps, dim), None

    def enter_down(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce_grad(x, self.mesh)

    def leave_up(self, out: torch.Tensor) -> torch.Tensor:
        return all_reduce(out, self.mesh)

    def full_latent(self, latent: torch.Tensor) -> torch.Tensor:
        return all_gather_last(latent, self.mesh)

    def local_latent(self, latent: torch.Tensor) -> torch.Tensor:
        return shard_last(latent, self.mesh)


_BOTTLENECK_VANILLA = ShardParameters({"down.weight": Shard(0), "up.weight": Shard(1)})
_REPLICATED = ShardParameters()


def apply_vanilla(model: nn.Module, tp_mesh: DeviceMesh, loss_parallel: bool) -> None:
    parallelize_module(
        model,
        tp_mesh,
        {
            "tok_embeddings": RowwiseParallel(
                input_layouts=Replicate(), output_layouts=Replicate()
            ),
            "layers.*": LowRankBlockParallel(
                norms=_REPLICATED, bottlenecks=_BOTTLENECK_VANILLA, comm=VanillaComm
            ),
            "norm": ReplicatedModule(),
            "output": ColwiseParallel(
                input_layouts=Replicate(),
                output_layouts=Shard(-1) if loss_parallel else Replicate(),
                use_local_output=not loss_parallel,
            ),
        },
    )
