"""Bottleneck-aware tensor parallelism (BTP).

Chunk boundaries sit inside the bottlenecks: every up-projection B is column-parallel
(output d, f or heads split), every down-projection A row-parallel (input split), so the
residual stream stays sharded on d for the whole stack and only [b, s, r] latents cross
ranks. Per block and direction:

    forward                                   backward (mirror, at the B inputs)
    A_q|A_k|A_v + attention_norm stats  3r+1  B_q,B_k,B_v latent grad   3r
    A_o                                  r    B_o latent grad            r
    A_gate|A_up + ffn_norm stats        2r+1  B_gate,B_up latent grad   2r
    A_down                               r    B_down latent grad         r

Every one of those collectives is in :class:`BTPComm` below; ``ungrouped`` splits them
per projection, ``sync`` norm adds one statistics all-reduce per norm (and one more
for its gradient). Stack ends: the
embedding is sharded on its embedding dim (the d/T slice costs nothing); after the
last block one all-gather feeds the replicated final norm and a vocab-parallel head
whose logits go to torchtitan's loss-parallel cross-entropy.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

from boost_titan.models.bottleneck import LatentComm
from .collectives import all_reduce, all_reduce_grad
from .styles import ReplicatedModule, ShardParameters, bottleneck_block_plan


class BTPComm(LatentComm):
    def __init__(self, mesh: DeviceMesh, norm_mode: str = "online"):
        self.mesh = mesh
        self.norm_mode = norm_mode

    def reduce_stats(self, stats: torch.Tensor) -> torch.Tensor:
        # sync ablation: each rank then normalises its own shard with the total, so the
        # total's gradient is a partial sum too -- it costs one more all-reduce back.
        return all_reduce_grad(all_reduce(stats, self.mesh), self.mesh)

    def reduce_down(self, latent: torch.Tensor, stats: torch.Tensor | None):
        if stats is None:
            return all_reduce(latent, self.mesh), None
        # Online-RMSNorm: the per-token sum of squares rides in the same all-reduce as
        # one extra column. In a bf16 latent it is rounded like the bf16 output of a
        # plain RMSNorm would be (relative 2^-9), so nothing is lost against it.
        r = latent.shape[-1]
        fused = all_reduce(torch.cat([latent, stats.to(latent.dtype)], -1), self.mesh)
        reduced_stats = fused[..., r:].float()
        return fused[..., :r], reduced_stats

    def enter_up(self, latent: torch.Tensor) -> torch.Tensor:
        # column-parallel B: its input gradient is a partial sum
        return all_reduce_grad(latent, self.mesh)


_BOTTLENECK_BTP = ShardParameters({"down.weight": Shard(1), "up.weight": Shard(0)})
_NORM_SHARDED = ShardParameters({"weight": Shard(0)})


def apply_btp(model: nn.Module, tp_mesh: DeviceMesh, loss_parallel: bool, norm_mode: str = "online") -> None:
    parallelize_module(
        model,
        tp_mesh,
        {
            # weight [vocab, d] sharded on d: each rank embeds straight into its d/T slice
            "tok_embeddings": ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1)),
            "norm": ReplicatedModule(input_layout=Shard(-1)),
            "output": ColwiseParallel(
                input_layouts=Replicate(),
                output_layouts=Shard(-1) if loss_parallel else Replicate(),
                use_local_output=not loss_parallel,
            ),
        },
    )
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, bottleneck_block_plan(_NORM_SHARDED, _BOTTLENECK_BTP))
        block.comm = BTPComm(tp_mesh, norm_mode)
