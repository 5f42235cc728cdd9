"""``transformers``' ``LlamaForCausalLM``: the dense ``llama2`` model, loadable by any
LLaMA tool (``AutoModelForCausalLM``, vLLM, lm-eval) without our code.

===================================  ============================================
ours                                 LlamaForCausalLM
===================================  ============================================
tok_embeddings.weight                model.embed_tokens.weight
layers.i.attention.wq/wk/wv/wo       model.layers.i.self_attn.q/k/v/o_proj
layers.i.feed_forward.w1/w3/w2       model.layers.i.mlp.gate/up/down_proj
layers.i.attention_norm / ffn_norm   model.layers.i.input_layernorm / post_attention_layernorm
norm.weight                          model.norm.weight
output.weight                        lm_head.weight (untied)
===================================  ============================================

Both use ``nn.Linear`` ``[out, in]`` weights; q's and k's rows are permuted from our
interleaved RoPE to HF's rotate-half (``boost_titan.checkpoint.hf.rope``; k with ``n_kv_heads``,
so GQA works). Same mapping as torchtitan's ``Llama3StateDictAdapter``.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from boost_titan.checkpoint.hf import HFFormatError, register
from boost_titan.checkpoint.hf.renames import BLOCK_NORMS, PROJECTIONS, Entry, RenamingFormat
from boost_titan.checkpoint.hf.rope import from_rotate_half, to_rotate_half
from boost_titan.models.args import LlamaArgs


def rope_rows(args: LlamaArgs) -> dict[str, int]:
    """Projections whose output rows carry RoPE'd heads -> their head count."""
    return {"attention.wq": args.n_heads, "attention.wk": args.kv_heads}


def top_entries(args: LlamaArgs) -> list[Entry]:
    d, v = args.dim, args.vocab_size
    return [
        Entry("tok_embeddings.weight", "model.embed_tokens.weight", (v, d)),
        Entry("norm.weight", "model.norm.weight", (d,)),
        Entry("output.weight", "lm_head.weight", (v, d)),
    ]


def norm_entries(args: LlamaArgs, i: int) -> list[Entry]:
    return [
        Entry(f"layers.{i}.{ours}.weight", f"model.layers.{i}.{hf}.weight", (args.dim,))
        for ours, hf in BLOCK_NORMS.items()
    ]


def llama_config(args: LlamaArgs, architecture: str, model_type: str) -> dict[str, Any]:
    """The LlamaConfig keys both layouts share. ``rope_theta`` is written twice: at the
    top (transformers 4, vLLM) and in ``rope_parameters`` (transformers 5)."""
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": args.rope_theta},
        "rope_scaling": None,
        "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }


def llama_args_from_config(config: dict[str, Any], fmt: str) -> LlamaArgs:
    """The LLaMA shape of a config.json; refuses what our model cannot run."""
    need = {
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
    }
    for key, want in need.items():
        if config.get(key, want) != want:
            raise HFFormatError(
                f"config.json {key} = {config[key]!r}: our {fmt!r} model needs {want!r}"
            )
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise HFFormatError(
            f"config.json rope type {rope_type!r}: our LLaMA-2 RoPE has no scaling ('default')"
        )
    theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    dim, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or dim // heads
    if head_dim * heads != dim:
        raise HFFormatError(
            f"config.json head_dim {head_dim} x num_attention_heads {heads} != hidden_size "
            f"{dim}: our attention needs head_dim = hidden_size / heads"
        )
    kv = config.get("num_key_value_heads") or heads
    return LlamaArgs(
        dim=dim,
        n_layers=config["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=None if kv == heads else kv,
        vocab_size=config["vocab_size"],
        ffn_dim=config["intermediate_size"],
        norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=float(theta),
        max_seq_len=config.get("max_position_embeddings", 2048),
    )


class LlamaFormat(RenamingFormat):
    name = "llama"
    archs = ("dense",)

    def entries(self, args: LlamaArgs):
        rope = rope_rows(args)
        yield from top_entries(args)[:2]
        for i in range(args.n_layers):
            for ours, hf in PROJECTIONS.items():
                din, dout, _ = args.projection_shapes()[ours.split(".")[1]]
                heads = rope.get(ours)
                maps = {}
                if heads:
                    maps = {
                        "to_hf": partial(to_rotate_half, heads=heads),
                        "from_hf": partial(from_rotate_half, heads=heads),
                    }
                yield Entry(
                    f"layers.{i}.{ours}.weight",
                    f"model.layers.{i}.{hf}.weight",
                    (dout, din),
                    **maps,
                )
            yield from norm_entries(args, i)
        yield top_entries(args)[2]

    def config(self, args: LlamaArgs) -> dict[str, Any]:
        self.check_args(args)
        return llama_config(args, "LlamaForCausalLM", "llama")

    def args_from_config(self, config: dict[str, Any]) -> LlamaArgs:
        if config.get("model_type") != "llama":
            raise HFFormatError(
                f"config.json model_type {config.get('model_type')!r}: the 'llama' layout "
                "reads model_type 'llama'"
            )
        return llama_args_from_config(config, "llama2")


LLAMA = register(LlamaFormat())
