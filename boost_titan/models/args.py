"""Model arguments shared by the dense LLaMA-2 baseline and its low-rank variants."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, replace

from torch import nn
from torchtitan.protocols.model import BaseModelArgs

from boost_titan.config import LATENT_ACTIVATIONS, LATENT_ACTS, LAX_GATES

ARCHITECTURES = ("dense", "svd", "cola", "lax")


def kron_factors(r: int) -> tuple[int, int]:
    """r = a * b with a <= b and a as large as possible (square-ish Kronecker gate)."""
    a = int(math.isqrt(r))
    while a > 1 and r % a:
        a -= 1
    return a, r // a


@dataclass
class LlamaArgs(BaseModelArgs):
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None
    vocab_size: int = 32000
    ffn_dim: int = 11008
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # Llama 3.1's "llama3" rope_scaling (torchtitan's RoPEScalingArgs); factor 1 is
    # LLaMA-2's unscaled RoPE
    rope_scaling_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_positions: int = 8192
    max_positions: int = 0
    """The context the weights were trained for (HF ``max_position_embeddings``), written
    back by exports; 0: unknown (exports write the run's ``max_seq_len``)."""
    max_seq_len: int = 4096
    depth_init: bool = True
    # torchtitan's llama3 Attention reads these two.
    attn_type: str = "sdpa"
    attn_mask_type: str = "causal"

    # --- bottleneck (low-rank) models -----------------------------------------------
    arch: str = "dense"
    """"dense" (W x), "svd" (B A x), "cola" (B silu(A x)), "lax" (latent crossing)."""
    rank: int = 0
    """Rank of q, o, gate, up, down (and k, v for MHA)."""
    kv_rank: int = 0
    """Rank of k and v; 0 = rank for MHA, min(rank, kv_dim // 2) for GQA."""
    swiglu: bool = True
    """False drops SwiGLU's outer SiLU: down(gate(x) * up(x)) (CoLA from 350M up)."""
    latent_act: str = "default"
    lax_gate: str = "kron"
    lax_norm_eps: float = 1e-6
    group_linears: bool = True
    """Grouped A GEMMs / batched B GEMMs (an execution choice: same parameters)."""

    # ------------------------------------------------------------------ derived shapes
    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def rope_scaled(self) -> bool:
        return self.rope_scaling_factor != 1.0

    @property
    def context_length(self) -> int:
        """max_position_embeddings an export writes."""
        return self.max_positions or self.max_seq_len

    @property
    def low_rank(self) -> bool:
        return self.arch != "dense"

    @property
    def effective_kv_rank(self) -> int:
        if self.kv_rank:
            return self.kv_rank
        if self.kv_heads == self.n_heads:
            return self.rank
        return min(self.rank, self.kv_dim // 2)

    @property
    def activation(self) -> str:
        """Activation applied to every latent: "silu" or "none"."""
        if self.latent_act != "default":
            return self.latent_act
        return "none" if self.arch == "svd" else "silu"

    def projection_shapes(self) -> dict[str, tuple[int, int, int]]:
        """name -> (in, out, rank) of the seven projections of a block."""
        d, f, r, rkv = self.dim, self.ffn_dim, self.rank, self.effective_kv_rank
        return {
            "wq": (d, self.n_heads * self.head_dim, r),
            "wk": (d, self.kv_dim, rkv),
            "wv": (d, self.kv_dim, rkv),
            "wo": (self.n_heads * self.head_dim, d, r),
            "w1": (d, f, r),
            "w3": (d, f, r),
            "w2": (f, d, r),
        }

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"unknown architecture {self.arch!r}; valid: {list(ARCHITECTURES)}")
        if self.dim % self.n_heads:
            raise ValueError(f"dim {self.dim} is not divisible by n_heads {self.n_heads}")
        if self.n_heads % self.kv_heads:
            raise ValueError(
                f"n_heads {self.n_heads} is not divisible by n_kv_heads {self.kv_heads}"
            )
        if not self.low_rank:
            return
        if self.activation not in LATENT_ACTIVATIONS:
            raise ValueError(f"latent_act {self.latent_act!r}: use one of {list(LATENT_ACTS)}")
        for name, (din, dout, r) in self.projection_shapes().items():
            if r <= 0 or r > min(din, dout):
                raise ValueError(
                    f"rank {r} of {name} ({din} -> {dout}) must be in "
                    f"[1, {min(din, dout)}] (min(in, out))"
                )
        if self.arch == "lax":
            if self.lax_gate not in LAX_GATES:
                raise ValueError(f"lax_gate {self.lax_gate!r}: use one of {list(LAX_GATES)}")
            if self.lax_gate == "kron":
                for r in {self.rank, self.effective_kv_rank}:
                    a, _ = kron_factors(r)
                    if a == 1:
                        raise ValueError(
                            f"Kronecker LaX gate needs rank = a*b with a, b > 1; "
                            f"rank {r} is prime. Use another rank or lax_gate='dense'"
                        )

    # ------------------------------------------------------------------ torchtitan hooks
    def update_from_config(self, job_config, **kwargs) -> None:
        from boost_titan.config import validate_boost_config

        # RoPE's table must cover the longest sequence the model sees: validation may run
        # longer sequences than training (torchtitan sizes it by training's alone, and a
        # validation step then dies on a bare AssertionError in reshape_for_broadcast)
        self.max_seq_len = job_config.training.seq_len
        validation = getattr(job_config, "validation", None)
        if validation is not None and validation.enable:
            self.max_seq_len = max(self.max_seq_len, validation.seq_len)
        boost = getattr(job_config, "boost", None)
        if boost is not None:
            validate_boost_config(boost)
            if boost.rope_theta:
                self.rope_theta = boost.rope_theta
            if self.low_rank:
                if boost.rank:
                    self.rank = boost.rank
                elif boost.rank_ratio:
                    self.rank = max(1, round(boost.rank_ratio * self.dim))
                if boost.kv_rank:
                    self.kv_rank = boost.kv_rank
                if boost.latent_act != "default":
                    self.latent_act = boost.latent_act
                self.lax_gate = boost.lax_gate
                self.group_linears = boost.group_linears
        self.validate()
        _check_tokenizer_vocab(job_config.model.hf_assets_path, self.vocab_size)

    def get_nparams_and_flops(self, model: nn.Module, seq_len: int) -> tuple[int, int]:
        nparams = sum(p.numel() for p in model.parameters())
        return nparams, self.flops_per_token(seq_len)

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token: 6 x every GEMM's MACs per token (fwd 2, bwd 4),
        plus attention scores and values (12 * layers * heads * head_dim * seq, the
        PaLM convention torchtitan uses, no causal discount). Low-rank models count
        the factored GEMMs they really run, LaX the gate GEMMs too."""
        macs = self.dim * self.vocab_size  # LM head
        for din, dout, r in self.projection_shapes().values():
            macs_proj = din * dout if not self.low_rank else r * (din + dout)
            macs += self.n_layers * macs_proj
        if self.arch == "lax":
            macs += (self.n_layers - 1) * sum(
                self.gate_macs(r) for _, _, r in self.projection_shapes().values()
            )
        attention = 12 * self.n_layers * self.n_heads * self.head_dim * seq_len
        return 6 * macs + attention

    def gate_macs(self, r: int) -> int:
        if self.lax_gate == "dense":
            return r * r
        a, b = kron_factors(r)
        return r * (a + b)  # G1^T H: a*a*b, (.) G0: a*b*b

    def with_overrides(self, **kw) -> LlamaArgs:
        return replace(self, **kw)


def _check_tokenizer_vocab(hf_assets_path: str, vocab_size: int) -> None:
    path = os.path.join(hf_assets_path or "", "tokenizer.json")
    if not os.path.isfile(path):
        return
    with open(path) as f:
        tok = json.load(f)
    n = len(tok.get("model", {}).get("vocab", {}))
    n = max([n] + [t["id"] + 1 for t in tok.get("added_tokens", [])])
    if n > vocab_size:
        raise ValueError(
            f"tokenizer at {hf_assets_path} has {n} tokens but the model's vocab_size "
            f"is {vocab_size}; pick a flavor with vocab_size >= {n} or build a "
            f"tokenizer with `boost-titan data build --vocab-size "
            f"{vocab_size} --out <dir>`"
        )
