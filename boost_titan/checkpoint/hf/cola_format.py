"""The CoLA authors' ``ColaForCausalLM`` (github.com/alvin-zyl/CoLA, ``cola/``,
``model_type "cola"``): our ``cola_llama2`` in the layout their code loads.

Their model is ``transformers``' LLaMA with every projection a ``ColaLayer``:
``y = silu(x @ cola_a) @ cola_b`` with ``cola_a`` ``[in, rank]`` and ``cola_b``
``[rank, out]``, i.e. the *transposes* of our ``down.weight`` ``[rank, in]`` and
``up.weight`` ``[out, rank]``; no biases (``attention_bias`` / ``mlp_bias`` false).
Embeddings, the three RMSNorms and the untied ``lm_head`` are full-rank, named as in
``LlamaForCausalLM`` (``boost_titan.checkpoint.hf.llama_format``), and so is their RoPE
(rotate-half): q's and k's output rows (the rows of B, i.e. the columns of
``cola_b``) are permuted as for the dense model.

===================================  ============================================
ours                                 ColaForCausalLM
===================================  ============================================
layers.i.attention.wq.down.weight    model.layers.i.self_attn.q_proj.cola_a (transposed)
layers.i.attention.wq.up.weight      model.layers.i.self_attn.q_proj.cola_b (q/k: rows
                                     permuted to rotate-half, then transposed)
layers.i.feed_forward.w1/w3/w2       model.layers.i.mlp.gate/up/down_proj.cola_a/cola_b
===================================  ============================================

config.json: LlamaConfig's keys plus ``rank`` (one rank for all seven projections),
``only_lr_act`` (true: ``down(gate(x) * up(x))``, our ``swiglu = false``; false: SwiGLU's
outer SiLU kept, our ``swiglu = true``) and ``lr_act_type "silu"`` (their ``ColaLayer``
applies ``hidden_act`` to every latent). What their model cannot express, refused by
:meth:`ColaFormat.config`: grouped-query attention (their k/v always have
``num_heads * head_dim`` outputs), a k/v rank other than ``rank``, and a latent
activation other than SiLU (``latent_act none``).

Loading such a folder needs their code (``ColaForCausalLM`` is not in ``transformers``):
``AutoConfig`` knows no ``model_type "cola"`` unless their ``cola`` package is
imported and registered, and the folder carries no ``auto_map``.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from boost_titan.checkpoint.hf import HFFormatError, register
from boost_titan.checkpoint.hf.llama_format import (
    checked,
    llama_args_from_config,
    llama_config,
    norm_entries,
    rope_rows,
    top_entries,
)
from boost_titan.checkpoint.hf.renames import PROJECTIONS, Entry, RenamingFormat
from boost_titan.checkpoint.hf.rope import from_rotate_half, to_rotate_half
from boost_titan.models.args import LlamaArgs


def _t(w: torch.Tensor) -> torch.Tensor:
    return w.t().contiguous()


def _b_to_hf(w: torch.Tensor, heads: int) -> torch.Tensor:
    return _t(to_rotate_half(w, heads))


def _b_from_hf(w: torch.Tensor, heads: int) -> torch.Tensor:
    return from_rotate_half(_t(w), heads).contiguous()


class ColaFormat(RenamingFormat):
    name = "cola"
    archs = ("cola",)

    def check_args(self, args: LlamaArgs) -> None:
        super().check_args(args)
        cannot = []
        if args.kv_heads != args.n_heads:
            cannot.append(
                f"grouped-query attention (n_kv_heads {args.kv_heads} < n_heads {args.n_heads}: "
                "their k/v projections always have n_heads * head_dim outputs)"
            )
        if args.effective_kv_rank != args.rank:
            cannot.append(
                f"a k/v rank {args.effective_kv_rank} other than rank {args.rank} "
                "(their config has one rank)"
            )
        if args.rope_scaled:
            cannot.append(
                f"llama3 RoPE scaling (factor {args.rope_scaling_factor:g}: their model "
                "predates it)"
            )
        if args.activation != "silu":
            cannot.append(
                f"latent_act {args.activation!r} (their ColaLayer applies SiLU to every latent)"
            )
        if cannot:
            raise HFFormatError(
                "the CoLA authors' model cannot hold this cola_llama2: "
                + "; ".join(cannot)
                + ". Our own layout holds it: export --format hf --hf-layout boost"
            )

    def entries(self, args: LlamaArgs):
        rope = rope_rows(args)
        yield from top_entries(args)[:2]
        for i in range(args.n_layers):
            for ours, hf in PROJECTIONS.items():
                din, dout, r = args.projection_shapes()[ours.split(".")[1]]
                stem, hstem = f"layers.{i}.{ours}", f"model.layers.{i}.{hf}"
                yield Entry(f"{stem}.down.weight", f"{hstem}.cola_a", (r, din), _t, _t)
                heads = rope.get(ours)
                if heads:
                    to_b = partial(_b_to_hf, heads=heads)
                    from_b = partial(_b_from_hf, heads=heads)
                    yield Entry(f"{stem}.up.weight", f"{hstem}.cola_b", (dout, r), to_b, from_b)
                else:
                    yield Entry(f"{stem}.up.weight", f"{hstem}.cola_b", (dout, r), _t, _t)
            yield from norm_entries(args, i)
        yield top_entries(args)[2]

    def config(self, args: LlamaArgs) -> dict[str, Any]:
        self.check_args(args)
        return {
            **llama_config(args, "ColaForCausalLM", "cola"),
            "rank": args.rank,
            "only_lr_act": not args.swiglu,
            "lr_act_type": "silu",
        }

    def args_from_config(self, config: dict[str, Any]) -> LlamaArgs:
        if config.get("model_type") != "cola":
            raise HFFormatError(
                f"config.json model_type {config.get('model_type')!r}: the 'cola' layout "
                "reads the CoLA authors' model_type 'cola'"
            )
        act = config.get("lr_act_type") or config.get("hidden_act", "silu")
        if act != "silu":
            raise HFFormatError(f"config.json lr_act_type {act!r}: our CoLA supports 'silu'")
        if config.get("pretraining_tp", 1) != 1:
            raise HFFormatError(
                f"config.json pretraining_tp {config['pretraining_tp']}: their model "
                "implements only 1"
            )
        args = llama_args_from_config(config, "cola_llama2")
        if args.kv_heads != args.n_heads:
            raise HFFormatError(
                f"config.json num_key_value_heads {args.kv_heads} != num_attention_heads "
                f"{args.n_heads}: the CoLA authors' model has no grouped-query attention"
            )
        rank = config.get("rank") or args.dim // 4  # their ColaConfig's default
        checked({"rank": rank}, {})
        args = args.with_overrides(
            arch="cola",
            rank=rank,
            swiglu=not config.get("only_lr_act", True),  # their default: True
            norm_eps=config.get("rms_norm_eps", 1e-6),
        )
        args.validate()
        return args


COLA = register(ColaFormat())
