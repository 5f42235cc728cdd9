"""LLaMA-2 with dense (baseline) or bottleneck (SVD, CoLA, LaX) projections.

FQNs follow torchtitan's llama3 (``tok_embeddings``, ``layers.<i>``, ``norm``,
``output``; ``attention.wq/wk/wv/wo``, ``feed_forward.w1/w2/w3``) so torchtitan's
pipeline splitting, activation checkpointing, FSDP2 and, for the dense model, its
Megatron TP plan apply unchanged. Low-rank projections add ``.down`` (A) / ``.up`` (B).

LaX carries the previous block's latents with the hidden state: blocks exchange one
tensor ``cat([hidden, latent_q, ..., latent_down], -1)``, so pipeline stage boundaries
and activation checkpointing need nothing special.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torchtitan.models.attention import ScaledDotProductAttentionWrapper
from torchtitan.models.llama3.model.args import RoPEScalingArgs
from torchtitan.models.llama3.model.model import (
    Attention as DenseAttention,
)
from torchtitan.models.llama3.model.model import (
    apply_rotary_emb,
    precompute_freqs_cis,
)
from torchtitan.models.utils import trunc_normal_
from torchtitan.protocols.train_spec import ModelProtocol

from .args import LlamaArgs
from .bottleneck import (
    SINGLE_DEVICE,
    Bottleneck,
    LatentComm,
    LatentCross,
    down_finish,
    down_partial,
    down_reduce,
    latent_up,
    up_group,
)


def rope_freqs_cis(args: LlamaArgs, end: int) -> torch.Tensor:
    """torchtitan's llama3 RoPE table for ``end`` positions with the model's scaling
    (factor 1, LLaMA-2's, makes llama3's rule the identity up to an ulp)."""
    scaling = RoPEScalingArgs(
        scaling_factor=args.rope_scaling_factor,
        low_freq_factor=args.rope_low_freq_factor,
        high_freq_factor=args.rope_high_freq_factor,
        original_max_position_embeddings=args.rope_original_max_positions,
    )
    return precompute_freqs_cis(args.head_dim, end, args.rope_theta, scaling)


ATTN_PROJS = ("wq", "wk", "wv", "wo")
FFN_PROJS = ("w1", "w3", "w2")
PROJ_ORDER = ATTN_PROJS + FFN_PROJS


# ----------------------------------------------------------------------------- dense
class DenseFeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, init_std: float) -> None:
        trunc_normal_(self.w1.weight, mean=0.0, std=0.02)
        for linear in (self.w2, self.w3):
            trunc_normal_(linear.weight, mean=0.0, std=init_std)


class DenseBlock(nn.Module):
    """The LLaMA-2 block (torchtitan llama3 attention, explicit FFN width)."""

    def __init__(self, layer_id: int, args: LlamaArgs):
        super().__init__()
        self.attention = DenseAttention(args)
        self.feed_forward = DenseFeedForward(args.dim, args.ffn_dim)
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        depth = layer_id + 1 if args.depth_init else args.n_layers
        self.weight_init_std = 0.02 / (2 * depth) ** 0.5

    def forward(self, x, freqs_cis, attention_masks=None, positions=None):
        h = x + self.attention(self.attention_norm(x), freqs_cis, attention_masks, positions)
        return h + self.feed_forward(self.ffn_norm(h))

    def init_weights(self) -> None:
        for norm in (self.attention_norm, self.ffn_norm):
            norm.reset_parameters()
        self.attention.init_weights(self.weight_init_std)
        self.feed_forward.init_weights(self.weight_init_std)


# ----------------------------------------------------------------------------- low-rank
class LowRankAttention(nn.Module):
    def __init__(self, args: LlamaArgs, projs: dict[str, Bottleneck]):
        super().__init__()
        self.head_dim = args.head_dim
        self.enable_gqa = args.n_heads > args.kv_heads
        for name in ATTN_PROJS:
            setattr(self, name, projs[name])
        # the dense blocks' kernel choice (torchtitan's SDPA wrapper: cuDNN, then Flash,
        # then math), so low-rank vs dense compares the architectures, not the kernels
        self.inner_attention = ScaledDotProductAttentionWrapper()

    def attend(self, q, k, v, freqs_cis, positions=None) -> torch.Tensor:
        # -1: the local head count (q/k/v may hold a tensor-parallel slice of heads)
        bs, seqlen, _ = q.shape
        q = q.view(bs, seqlen, -1, self.head_dim)
        k = k.view(bs, seqlen, -1, self.head_dim)
        v = v.view(bs, seqlen, -1, self.head_dim)
        q, k = apply_rotary_emb(q, k, freqs_cis=freqs_cis, positions=positions)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = self.inner_attention(q, k, v, enable_gqa=self.enable_gqa)
        return out.transpose(1, 2).reshape(bs, seqlen, -1)


class LowRankFeedForward(nn.Module):
    def __init__(self, projs: dict[str, Bottleneck]):
        super().__init__()
        for name in FFN_PROJS:
            setattr(self, name, projs[name])


class LowRankBlock(nn.Module):
    """A LLaMA block whose seven projections are bottlenecks.

    The forward is written chunk by chunk, the way BTP cuts it: every partial latent
    (``down_partial``) ends a chunk, its all-reduce (``down_reduce``) sits between
    chunks, and the next chunk starts from the reduced latent. ``self.comm`` holds the
    collectives: identities here, a tensor-parallel plan's ``LatentComm`` once its
    ``ParallelStyle`` is applied.
    """

    # The chunk bodies (methods) by chunk: local compute only under BTP, so latent
    # checkpointing (boost_titan/parallel/latent_checkpoint.py) can wrap them from outside.
    CHUNK_BODIES = {"attention": ("_entry", "_attention"), "mlp": ("_ffn_entry", "_mlp")}
    ATTENTION_BODY = "_attention"  # the body holding the attention kernel

    def __init__(self, layer_id: int, args: LlamaArgs):
        super().__init__()
        self.dim = args.dim
        self.swiglu = args.swiglu
        self.grouped = args.group_linears
        self.lax = args.arch == "lax"
        self.comm: LatentComm = SINGLE_DEVICE
        projs = {}
        for name, (din, dout, r) in args.projection_shapes().items():
            cross = None
            if self.lax and layer_id > 0:
                cross = LatentCross(r, args.lax_gate, args.lax_norm_eps)
            projs[name] = Bottleneck(din, dout, r, args.activation, cross)
        self.attention = LowRankAttention(args, projs)
        self.feed_forward = LowRankFeedForward(projs)
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.latent_widths = [projs[n].rank for n in PROJ_ORDER]

    def forward(self, x, freqs_cis, attention_masks=None, positions=None):
        prev: list[torch.Tensor | None] = [None] * len(PROJ_ORDER)
        if self.lax:
            x, *prev = x.split([x.shape[-1] - sum(self.latent_widths)] + self.latent_widths, -1)
        comm, f = self.comm, self.feed_forward

        # A chunk runs from a reduced latent (its norm scale and activation first) to
        # the next partial latent; between chunks sits only the collective
        # (down_reduce). With latent checkpointing a chunk keeps just its inputs: the
        # reduced latents and the residual stream.
        # attention chunk: attention_norm + A_q|A_k|A_v ... B_q,B_k,B_v -> heads -> A_o
        parts, stats = self._entry(x)
        z_qkv, stats = down_reduce(parts, stats, comm, "qkv")
        parts, carry_qkv = self._attention(freqs_cis, positions, stats, prev[0:3], *z_qkv)
        z_o, _ = down_reduce(parts, None, comm, "o")
        # MLP chunk: B_o -> residual -> ffn_norm + A_gate|A_up ... B_gate,B_up -> SwiGLU -> A_down
        h, parts, stats, carry_o = self._ffn_entry(x, prev[3:4], *z_o)
        z_gu, stats = down_reduce(parts, stats, comm, "gate_up")
        parts, carry_gu = self._mlp(stats, prev[4:6], *z_gu)
        z_d, _ = down_reduce(parts, None, comm, "down")
        # B_down -> residual stays outside: it would keep the d/T residual h instead
        # of the r-wide latent
        (ffn_out,), carry_d = self._up([f.w2], z_d, None, None, prev[6:7], "down")
        out = h + ffn_out

        if self.lax:
            out = torch.cat([out, *carry_qkv, *carry_o, *carry_gu, *carry_d], -1)
        return out

    # The chunk bodies (CHUNK_BODIES): local compute only under BTP (no forward
    # collective), so latent checkpointing can recompute them without communicating.
    def _entry(self, x):
        a = self.attention
        return down_partial(
            x, [a.wq, a.wk, a.wv], self.comm, self.grouped, self.attention_norm, self.dim, "qkv"
        )

    def _attention(self, freqs_cis, positions, stats, prevs, *z_qkv):
        a = self.attention
        qkv = [a.wq, a.wk, a.wv]
        (q, k, v), carry = self._up(qkv, list(z_qkv), stats, self.attention_norm, prevs, "qkv")
        o = a.attend(q, k, v, freqs_cis, positions)
        parts, _ = down_partial(o, [a.wo], self.comm, self.grouped, group="o")
        return parts, carry

    def _ffn_entry(self, x, prevs, *z_o):
        a, f = self.attention, self.feed_forward
        (attn_out,), carry = self._up([a.wo], list(z_o), None, None, prevs, "o")
        h = x + attn_out
        parts, stats = down_partial(
            h, [f.w1, f.w3], self.comm, self.grouped, self.ffn_norm, self.dim, "gate_up"
        )
        return h, parts, stats, carry

    def _mlp(self, stats, prevs, *z_gu):
        f = self.feed_forward
        (gate, up), carry = self._up(
            [f.w1, f.w3], list(z_gu), stats, self.ffn_norm, prevs, "gate_up"
        )
        mid = (F.silu(gate) if self.swiglu else gate) * up
        parts, _ = down_partial(mid, [f.w2], self.comm, self.grouped, group="down")
        return parts, carry

    def _up(self, projs, reduced, stats, norm, prevs, group):
        """Reduced latents -> (the B's outputs, latents carried to the next block): the
        norm's 1/rms scale, the activation, the B's. Without LaX one fused op keeps a
        single copy of each latent (``latent_up``); LaX's crossing (a gate GEMM and a
        LayerNorm with the previous block's latent) runs through plain autograd."""
        if not self.lax:
            return latent_up(reduced, stats, projs, self.comm, norm, self.dim, group), []
        z, carry = self._lax_latents(projs, reduced, stats, norm, prevs)
        return up_group(z, projs, self.comm, self.grouped, group), carry

    def _lax_latents(self, projs, reduced, stats, norm, prevs):
        """LaX: reduced latents -> (latents for the B's, latents carried to the next
        block): the norm's 1/rms scale, the crossing with ``prevs``, act. The crossing
        needs whole latents: a plan that splits r (vanilla) gathers them here and
        gives the B's back their slices; only then is this not collective-free."""
        latents = down_finish(reduced, stats, projs, norm, self.dim)
        carry = []
        for p, latent, prev in zip(projs, latents, prevs):
            with self.comm.scope("lax_full_latent"):
                latent = self.comm.full_latent(latent)
            carry.append(p.activate(latent, prev))
        with self.comm.scope("lax_local_latent"):
            return [self.comm.local_latent(z) for z in carry], carry

    def projections(self) -> list[Bottleneck]:
        return [getattr(self.attention, n) for n in ATTN_PROJS] + [
            getattr(self.feed_forward, n) for n in FFN_PROJS
        ]

    def init_weights(self) -> None:
        for norm in (self.attention_norm, self.ffn_norm):
            norm.reset_parameters()
        for p in self.projections():
            p.init_weights()


# ----------------------------------------------------------------------------- model
class Transformer(ModelProtocol):
    def __init__(self, args: LlamaArgs):
        super().__init__(args)
        args.validate()
        self.model_args = args
        self.vocab_size = args.vocab_size
        self.n_layers = args.n_layers
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.register_buffer("freqs_cis", self._precompute_freqs_cis(), persistent=False)
        block_cls = LowRankBlock if args.low_rank else DenseBlock
        self.layers = nn.ModuleDict({str(i): block_cls(i, args) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        # LaX: width of the latents carried next to the hidden state between blocks
        self.lax_width = (
            sum(args.projection_shapes()[n][2] for n in PROJ_ORDER) if args.arch == "lax" else 0
        )

    def _precompute_freqs_cis(self) -> torch.Tensor:
        return rope_freqs_cis(self.model_args, self.model_args.max_seq_len)

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        buffer_device = buffer_device or self.freqs_cis.device
        with torch.device(buffer_device):
            self.freqs_cis = self._precompute_freqs_cis()
        if self.tok_embeddings is not None:
            nn.init.normal_(self.tok_embeddings.weight)
        for layer in self.layers.values():
            if layer is not None:
                layer.init_weights()
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.output is not None:
            std = self.model_args.dim**-0.5
            trunc_normal_(self.output.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)

    def get_attention_masks(self, input_batch, tokenizer, extra_inputs=None):
        # causal SDPA needs no mask; torchtitan's validator expects TypeError here
        raise TypeError("boost_titan models use causal SDPA: no attention masks")

    def forward(self, tokens: torch.Tensor, attention_masks=None, positions=None):
        # tokens are hidden states on non-first pipeline stages
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(tokens)
            if self.lax_width:  # block 0 has no crossing: its "previous latents" are unused
                h = torch.cat([h, h.new_zeros(*h.shape[:-1], self.lax_width)], -1)
        else:
            h = tokens
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis, attention_masks=attention_masks, positions=positions)
        if self.norm is None:
            return h
        if self.lax_width:
            h = h[..., : h.shape[-1] - self.lax_width]
        h = self.norm(h)
        return self.output(h) if self.output is not None else h
