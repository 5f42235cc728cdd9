"""Bottleneck-aware tensor parallelism (BTP).

Chunk boundaries sit inside the bottlenecks: every up-projection B is column-parallel
(output d, f or heads split), every down-projection A row-parallel (input split), so the
residual stream stays sharded on d for the whole stack and only [b, s, r] latents cross
ranks. Per block and direction:

    forward                                   backward (mirror, at the B inputs)
    A_q|A_k|A_v + attention_norm stats  3r+c  B_q,B_k,B_v latent grad   3r
    A_o                                  r    B_o latent grad            r
    A_gate|A_up + ffn_norm stats        2r+c  B_gate,B_up latent grad   2r
    A_down                               r    B_down latent grad         r

c, the statistics columns: 1 for an fp32 latent; 2T for 16-bit latents (each rank's
fp32 statistic as an exact hi/lo pair in its own columns, see ``reduce_down``).

Every one of those collectives is in :class:`BTPComm` below; ``ungrouped`` splits them
per projection; the ``sync`` norm ablation (:class:`BTPSyncNormComm`) adds one
statistics all-reduce per norm (and one more for its gradient);
``[boost] sequence_parallel`` (:class:`BTPSequenceComm`) turns each all-reduce into a
reduce-scatter over the sequence plus an all-gather before B. The backward all-reduce
at the B inputs runs inside ``LatentUp``'s backward (``up_input_grad``), which keeps
one copy of each latent. Stack ends: the
embedding is sharded on its embedding dim (the d/T slice costs nothing); after the
last block one all-gather feeds the replicated final norm and a vocab-parallel head
whose logits go to torchtitan's loss-parallel cross-entropy.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

from boost_titan.models.bottleneck import LatentComm, rms_normalize

from .collectives import (
    all_reduce,
    all_reduce_grad,
    raw_all_gather,
    raw_all_reduce,
    raw_reduce_scatter,
    reduce_scatter,
    shard,
)
from .styles import LowRankBlockParallel, ReplicatedModule, ShardParameters

# sign, exponent and the top 7 mantissa bits of an fp32: exactly a bfloat16
_HIGH_16_BITS = -(1 << 16)  # 0xFFFF0000 as an int32


class BTPComm(LatentComm):
    def __init__(self, mesh: DeviceMesh):
        self.mesh = mesh

    def reduce_down(self, latent: torch.Tensor, stats: torch.Tensor | None):
        if stats is None:
            return all_reduce(latent, self.mesh), None
        # Online-RMSNorm: the per-token sum of squares rides in the same all-reduce as
        # extra columns of the latent (one in fp32; 2T in 16-bit dtypes, see below).
        r = latent.shape[-1]
        columns = (
            stats
            if latent.dtype == torch.float32
            else self._exact_16bit_columns(stats, latent.dtype)
        )
        fused = all_reduce(torch.cat([latent, columns.to(latent.dtype)], -1), self.mesh)
        total = fused[..., r:].float().sum(-1, keepdim=True)
        # value: exactly the reduced total (+ 0, bitwise the same on every rank);
        # gradient: straight to this rank's fp32 statistics, d(total)/d(stats) = 1
        # (as through an all-reduce), never through the 16-bit columns
        return fused[..., :r], total.detach() + (stats - stats.detach())

    def _exact_16bit_columns(self, stats: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """fp32 statistics as 2T columns of a 16-bit latent, summed exactly.

        A 16-bit all-reduce rounds every partial sum (bf16: 2^-9 relative, 1e-3 on
        1/rms). Instead each rank writes its statistic as a hi + lo pair (16 mantissa
        bits together, ~2^-17 relative) into its own two columns and zeros elsewhere:
        adding zeros is exact, so after the all-reduce every rank holds all T pairs
        and adds them in fp32.

        hi is rounded on the fp32 bits (to the top 16: sign, exponent, 7 mantissa bits;
        + 0x8000 first rounds to nearest), not by ``stats.to(dtype)``: inductor fuses
        such a round trip and keeps the "rounded" value in fp32 inside its kernel, so
        lo came out 0 and the pair was
        plain bf16 again (937.50739 summed to 936.0), only when compiled. A bit mask has
        no cast to elide, and hi converts to bf16 exactly."""
        T = self.mesh.size()
        hi = ((stats.view(torch.int32) + 0x8000) & _HIGH_16_BITS).view(torch.float32)
        lo = (stats - hi).to(dtype)  # stats - hi: exact in fp32 (|lo| <= half a bf16 ulp)
        hi = hi.to(dtype)
        # this rank's row of the identity: a Replicate -> Shard slice, no collective
        slot = (
            DTensor.from_local(
                torch.eye(T, dtype=dtype, device=stats.device),
                self.mesh,
                [Replicate()],
                run_check=False,
            )
            .redistribute(self.mesh, [Shard(0)])
            .to_local()
        )
        pair = torch.cat([hi, lo], -1)  # [..., 2]
        return (slot.view(T, 1) * pair.unsqueeze(-2)).flatten(-2)  # [..., 2T]

    def up_input_grad(self, grad: torch.Tensor) -> torch.Tensor:
        # column-parallel B: its input gradient is a partial sum
        return raw_all_reduce(grad, self.mesh)


class BTPSyncNormComm(BTPComm):
    """The ``rmsnorm = "sync"`` ablation: RMSNorm statistics get their own all-reduce
    and the input is normalised before the down-projections (one more collective per
    norm and direction than Online-RMSNorm)."""

    def normalize_input(self, x: torch.Tensor, stats: torch.Tensor, eps: float, dim: int):
        # each rank normalises its own shard with the total, so the total's gradient is
        # a partial sum too: it costs one more all-reduce back
        total = all_reduce_grad(all_reduce(stats, self.mesh), self.mesh)
        return rms_normalize(x, total, eps, dim), None


class BTPSequenceComm(BTPComm):
    """``[boost] sequence_parallel``: every latent is sharded on the sequence between
    its A and its B, so each rank keeps (and scales, activates) [b, s/T, r] of it.

        point                      forward                  backward
        after A (+ stats columns)  reduce-scatter over s    all-gather over s
        before B                   all-gather over s        reduce-scatter over s
        B's weight gradient        -                        all-gather again (regather)

    Forward volume equals BTP's all-reduce (a reduce-scatter plus an all-gather);
    backward adds the regather, unless ``keep_gathered`` saves the gathered latent
    (one [b, s, r] copy per latent instead of [b, s/T, r]). The Online-RMSNorm
    statistics are per token: after the reduce-scatter each rank holds the exact
    totals of its own tokens. Needs s % T == 0."""

    SEQ = 1  # latents are [b, s, r]

    def __init__(self, mesh: DeviceMesh, keep_gathered: bool = False):
        super().__init__(mesh)
        self.keep_gathered = keep_gathered

    def reduce_down(self, latent: torch.Tensor, stats: torch.Tensor | None):
        T, seq = self.mesh.size(), latent.shape[self.SEQ]
        if seq % T:
            raise ValueError(
                f"[boost] sequence_parallel: sequence length {seq} is not divisible by "
                f"the tensor-parallel degree {T}; use a seq_len that is"
            )
        if stats is None:
            return reduce_scatter(latent, self.SEQ, self.mesh), None
        r = latent.shape[-1]
        if latent.dtype == torch.float32:
            # the statistic is the last column: its gradient rides back in the
            # latent gradient's all-gather
            fused = reduce_scatter(torch.cat([latent, stats], -1), self.SEQ, self.mesh)
            return fused[..., :r], fused[..., r:]
        columns = self._exact_16bit_columns(stats, latent.dtype)
        fused = reduce_scatter(torch.cat([latent, columns], -1), self.SEQ, self.mesh)
        total = fused[..., r:].float().sum(-1, keepdim=True)
        # value: the exact total of this rank's tokens; gradient: to the fp32
        # statistics of every token (an fp32 all-gather of [b, s/T, 1] backward), not
        # through the 16-bit columns
        own = shard(stats, self.SEQ, self.mesh)
        return fused[..., :r], total.detach() + (own - own.detach())

    def up_input(self, latent: torch.Tensor) -> torch.Tensor:
        return raw_all_gather(latent, self.SEQ, self.mesh)

    def up_input_grad(self, grad: torch.Tensor) -> torch.Tensor:
        # column-parallel B's partial input gradient: summed and re-sharded on s
        return raw_reduce_scatter(grad, self.SEQ, self.mesh)


COMM_FOR_NORM = {"online": BTPComm, "sync": BTPSyncNormComm}

SEQUENCE_PARALLEL_LAX = (
    "[boost] sequence_parallel = true does not support LaX models yet: LaX carries "
    "every block's whole latents to the next block next to the d/T residual, so "
    "they cannot be sequence shards; use sequence_parallel = false for lax_llama2 "
    "(svd_llama2 and cola_llama2 support it)"
)

_BOTTLENECK_BTP = ShardParameters({"down.weight": Shard(1), "up.weight": Shard(0)})
_NORM_SHARDED = ShardParameters({"weight": Shard(0)})


def btp_comm(norm_mode: str, sequence_parallel: bool, keep_gathered: bool):
    """The block collectives for these options (a ``LatentComm`` factory)."""
    if not sequence_parallel:
        if keep_gathered:
            raise ValueError(
                "[boost] sequence_parallel_keep_gathered = true needs sequence_parallel = true"
            )
        return COMM_FOR_NORM[norm_mode]
    if norm_mode != "online":
        raise ValueError(
            f"[boost] sequence_parallel = true needs rmsnorm = 'online' (got {norm_mode!r}): "
            "the 'sync' ablation normalises before the reduction"
        )
    return lambda mesh: BTPSequenceComm(mesh, keep_gathered)


def apply_btp(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    loss_parallel: bool,
    norm_mode: str = "online",
    sequence_parallel: bool = False,
    keep_gathered: bool = False,
) -> None:
    if sequence_parallel and model.model_args.arch == "lax":
        raise ValueError(SEQUENCE_PARALLEL_LAX)
    parallelize_module(
        model,
        tp_mesh,
        {
            # weight [vocab, d] sharded on d: each rank embeds straight into its d/T slice
            "tok_embeddings": ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1)),
            "layers.*": LowRankBlockParallel(
                norms=_NORM_SHARDED,
                bottlenecks=_BOTTLENECK_BTP,
                comm=btp_comm(norm_mode, sequence_parallel, keep_gathered),
            ),
            "norm": ReplicatedModule(input_layout=Shard(-1)),
            "output": ColwiseParallel(
                input_layouts=Replicate(),
                output_layouts=Shard(-1) if loss_parallel else Replicate(),
                use_local_output=not loss_parallel,
            ),
        },
    )
