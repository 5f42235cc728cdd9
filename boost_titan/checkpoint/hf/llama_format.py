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
from boost_titan.models.fields import FieldError, check_fields


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


def rope_config(args: LlamaArgs) -> dict[str, Any]:
    """The RoPE keys of a LlamaConfig: ``rope_parameters`` (transformers 5) and the top
    ``rope_theta`` / ``rope_scaling`` (transformers 4, vLLM)."""
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": args.rope_theta}
    scaling = None
    if args.rope_scaled:
        scaling = {
            "rope_type": "llama3",
            "factor": args.rope_scaling_factor,
            "low_freq_factor": args.rope_low_freq_factor,
            "high_freq_factor": args.rope_high_freq_factor,
            "original_max_position_embeddings": args.rope_original_max_positions,
        }
        params = {**scaling, "rope_theta": args.rope_theta}
    return {"rope_theta": args.rope_theta, "rope_parameters": params, "rope_scaling": scaling}


def llama_config(args: LlamaArgs, architecture: str, model_type: str) -> dict[str, Any]:
    """The LlamaConfig keys both layouts share. The LM head is always written as its own
    matrix (``tie_word_embeddings`` false): ours trains apart from the embeddings."""
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
        **rope_config(args),
        "max_position_embeddings": args.context_length,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }


# llama3 rope_scaling keys -> LlamaArgs fields
LLAMA3_ROPE = {
    "factor": "rope_scaling_factor",
    "low_freq_factor": "rope_low_freq_factor",
    "high_freq_factor": "rope_high_freq_factor",
    "original_max_position_embeddings": "rope_original_max_positions",
}
# LlamaConfig keys -> LlamaArgs fields (the first five required)
LLAMA_KEYS = {
    "hidden_size": "dim",
    "num_hidden_layers": "n_layers",
    "num_attention_heads": "n_heads",
    "vocab_size": "vocab_size",
    "intermediate_size": "ffn_dim",
    "num_key_value_heads": "n_kv_heads",
    "rms_norm_eps": "norm_eps",
    "max_position_embeddings": "max_positions",
}
FIELD_KEYS = {field: key for key, field in LLAMA_KEYS.items()}  # for the refusal lines


def checked(values: dict[str, Any], keys: dict[str, str]) -> dict[str, Any]:
    """``values`` (LlamaArgs field -> config.json value), each checked by the one rule
    every model file's fields are (``boost_titan.models.fields``): the key, its value
    and what is valid in one line otherwise."""
    try:
        check_fields(values, "config.json", keys)
    except FieldError as e:
        raise HFFormatError(str(e)) from None
    return values


def rope_args(config: dict[str, Any]) -> dict[str, Any]:
    """LlamaArgs' RoPE fields of a config.json: theta and "default" or "llama3" scaling;
    any other scaling is refused, naming it."""
    key = "rope_parameters" if config.get("rope_parameters") else "rope_scaling"
    rope = config.get(key) or {}
    if not isinstance(rope, dict):
        raise HFFormatError(f"config.json: {key} = {rope!r:.60} is not a JSON object")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if "rope_theta" in rope:
        out = checked({"rope_theta": rope["rope_theta"]}, {"rope_theta": f"{key}.rope_theta"})
    else:
        theta = config.get("rope_theta")
        out = checked({"rope_theta": 10000.0 if theta is None else theta}, {})
    out["rope_theta"] = float(out["rope_theta"])
    if rope_type == "default":
        return out
    if rope_type != "llama3":
        raise HFFormatError(
            f"config.json rope type {rope_type!r}: our RoPE runs 'default' (none) and "
            "Llama 3.1's 'llama3' scaling only"
        )
    missing = [k for k in LLAMA3_ROPE if k not in rope]
    if missing:
        raise HFFormatError(f"config.json llama3 rope scaling lacks {missing}")
    out |= checked(
        {field: rope[k] for k, field in LLAMA3_ROPE.items()},
        {field: f"{key}.{k}" for k, field in LLAMA3_ROPE.items()},
    )
    if out["rope_scaling_factor"] == 1.0:  # the identity: what "default" computes
        return {"rope_theta": out["rope_theta"]}
    positions = "rope_original_max_positions"
    return {k: v if k == positions else float(v) for k, v in out.items()}


def llama_args_from_config(config: dict[str, Any], fmt: str, tied_ok: bool = False) -> LlamaArgs:
    """The LLaMA shape of a config.json; refuses what our model cannot run, naming the
    key and its value. A tied LM head (``tied_ok``) is read as its own copy of the
    embeddings (:func:`untie`)."""
    need = {
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
    }
    if not tied_ok:
        need["tie_word_embeddings"] = False
    for key, want in need.items():
        if config.get(key, want) != want:
            raise HFFormatError(
                f"config.json {key} = {config[key]!r}: our {fmt!r} model needs {want!r}"
            )
    required = list(LLAMA_KEYS)[:5]
    missing = [k for k in required if k not in config]
    if missing:
        raise HFFormatError(f"config.json lacks the LLaMA keys {missing}")
    given = {k: config[k] for k in LLAMA_KEYS if config.get(k) is not None or k in required}
    fields = checked({LLAMA_KEYS[k]: v for k, v in given.items()}, FIELD_KEYS)
    dim, heads = fields["dim"], fields["n_heads"]
    head_dim = config.get("head_dim")
    if head_dim is not None and (not isinstance(head_dim, int) or isinstance(head_dim, bool)):
        raise HFFormatError(f"config.json: head_dim = {head_dim!r:.60} is not a JSON integer")
    head_dim = head_dim or dim // heads
    if head_dim * heads != dim:
        raise HFFormatError(
            f"config.json head_dim {head_dim} x num_attention_heads {heads} != hidden_size "
            f"{dim}: our attention needs head_dim = hidden_size / heads"
        )
    kv = fields.get("n_kv_heads", heads)
    positions = fields.get("max_positions", 0)  # 0: the config does not say
    fields.update(
        n_kv_heads=None if kv == heads else kv,
        norm_eps=float(fields.get("norm_eps", 1e-6)),
        max_seq_len=positions or 2048,
        max_positions=positions,
    )
    args = LlamaArgs(**fields, **rope_args(config))
    try:
        args.validate()
    except ValueError as e:
        raise HFFormatError(f"config.json describes no model we run: {e}") from None
    return args


def untie(config: dict[str, Any], tensors: dict[str, Any]) -> dict[str, Any]:
    """A tied folder stores no ``lm_head.weight``: ours is a copy of the embeddings."""
    if config.get("tie_word_embeddings") and "lm_head.weight" not in tensors:
        if "model.embed_tokens.weight" in tensors:
            tensors = {**tensors, "lm_head.weight": tensors["model.embed_tokens.weight"]}
    return tensors


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
        return llama_args_from_config(config, "llama2", tied_ok=True)


LLAMA = register(LlamaFormat())
