"""The ``boost`` Hugging Face layout: our own ``transformers`` model class, every architecture.

Names: a tensor's Hugging Face name is ``"model." + <our FQN>``, except our LM head
``output.weight``, which is ``lm_head.weight`` (``transformers``' convention for causal
LMs). Tensors are neither transposed nor permuted: the model class
(``boost_titan/checkpoint/hf/remote/modeling_boost_llama.py``, copied into each exported folder and
named in config.json's ``auto_map``) has our module tree under ``model.`` and computes
exactly what ``boost_titan.models.model.Transformer`` does, interleaved (complex) RoPE
included.

config.json: ``model_type "boost_llama"`` with ``transformers``' standard names where one
exists (``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``,
``num_key_value_heads``, ``intermediate_size``, ``rms_norm_eps``, ``rope_theta``,
``max_position_embeddings``, ``vocab_size``) and ours for the rest (``arch``, ``rank``,
``kv_rank``, ``swiglu``, ``latent_act``, ``lax_gate``, ``lax_norm_eps``). ``kv_rank`` and
``latent_act`` are stored resolved (the rank k/v really have, "silu" or "none"), so the
model class needs none of ``LlamaArgs``' defaulting rules.
"""

from __future__ import annotations

from typing import Any

import torch

from boost_titan.checkpoint.hf import HFFormat, HFFormatError, register
from boost_titan.checkpoint.hf.llama_format import FIELD_KEYS, LLAMA3_ROPE, checked
from boost_titan.models.args import ARCHITECTURES, LlamaArgs

MODEL_TYPE = "boost_llama"
REMOTE_FILES = ("configuration_boost_llama.py", "modeling_boost_llama.py")

# torchtitan's llama3 RoPE with scaling factor 1 (LLaMA-2: no frequency scaling). The
# frequencies still go through llama3's scaling formula, whose "medium" band can move a
# frequency by an ulp: the model class runs the same formula with these constants.
ROPE_SCALING = {
    "factor": 1.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def interleaved_scaling(args: LlamaArgs) -> dict[str, Any]:
    """The model's llama3 scaling constants (``ROPE_SCALING``: LLaMA-2's, none)."""
    return {
        "factor": args.rope_scaling_factor,
        "low_freq_factor": args.rope_low_freq_factor,
        "high_freq_factor": args.rope_high_freq_factor,
        "original_max_position_embeddings": args.rope_original_max_positions,
    }


class BoostFormat(HFFormat):
    name = "boost"
    archs = ARCHITECTURES
    remote_code = REMOTE_FILES
    """Files of ``boost_titan/hf/remote`` the folder writer copies beside config.json."""

    def config(self, args: LlamaArgs) -> dict[str, Any]:
        config = {
            "model_type": MODEL_TYPE,
            "architectures": ["BoostLlamaForCausalLM"],
            "auto_map": {
                "AutoConfig": "configuration_boost_llama.BoostLlamaConfig",
                "AutoModelForCausalLM": "modeling_boost_llama.BoostLlamaForCausalLM",
            },
            "arch": args.arch,
            "vocab_size": args.vocab_size,
            "hidden_size": args.dim,
            "intermediate_size": args.ffn_dim,
            "num_hidden_layers": args.n_layers,
            "num_attention_heads": args.n_heads,
            "num_key_value_heads": args.kv_heads,
            "rms_norm_eps": args.norm_eps,
            "rope_theta": args.rope_theta,
            "rope_interleaved_scaling": interleaved_scaling(args),
            "max_position_embeddings": args.context_length,
            "tie_word_embeddings": False,
        }
        if args.low_rank:
            config.update(
                rank=args.rank,
                kv_rank=args.effective_kv_rank,
                swiglu=args.swiglu,
                latent_act=args.activation,
            )
            if args.arch == "lax":
                config.update(lax_gate=args.lax_gate, lax_norm_eps=args.lax_norm_eps)
        return config

    def args_from_config(self, config: dict[str, Any]) -> LlamaArgs:
        if config.get("model_type") != MODEL_TYPE:
            raise HFFormatError(
                f"config.json has model_type {config.get('model_type')!r}, "
                f"the boost layout's is {MODEL_TYPE!r}"
            )
        missing = [
            k
            for k in (
                "arch",
                "vocab_size",
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
                "rms_norm_eps",
                "rope_theta",
                "max_position_embeddings",
            )
            if k not in config
        ]
        arch = config.get("arch")
        if arch != "dense":
            missing += [k for k in ("rank", "kv_rank", "swiglu", "latent_act") if k not in config]
        if arch == "lax":
            missing += [k for k in ("lax_gate", "lax_norm_eps") if k not in config]
        if missing:
            raise HFFormatError(f"config.json of the boost layout lacks {missing}")
        if arch not in ARCHITECTURES:
            raise HFFormatError(f"config.json has arch {arch!r}; valid: {list(ARCHITECTURES)}")
        keys = {
            **FIELD_KEYS,
            "rope_theta": "rope_theta",
            **{k: k for k in ("rank", "kv_rank", "swiglu", "latent_act", "lax_gate")},
            "lax_norm_eps": "lax_norm_eps",
        }
        values = {f: config[k] for f, k in keys.items() if k in config}
        if values.get("n_kv_heads") is None:
            values.pop("n_kv_heads", None)
        scaling = config.get("rope_interleaved_scaling") or ROPE_SCALING
        if not isinstance(scaling, dict) or set(scaling) < set(LLAMA3_ROPE):
            raise HFFormatError(
                f"config.json: rope_interleaved_scaling = {scaling!r:.60} is not an object "
                f"with {list(LLAMA3_ROPE)}"
            )
        values |= {f: scaling[k] for k, f in LLAMA3_ROPE.items()}
        keys |= {f: f"rope_interleaved_scaling.{k}" for k, f in LLAMA3_ROPE.items()}
        values = checked(values, keys)
        if values.get("n_kv_heads") == values["n_heads"]:
            values["n_kv_heads"] = None
        args = LlamaArgs(**values, arch=arch, max_seq_len=values["max_positions"])
        try:
            args.validate()
        except ValueError as e:
            raise HFFormatError(f"config.json describes no valid model: {e}") from None
        return args

    def to_hf(
        self, state_dict: dict[str, torch.Tensor], args: LlamaArgs
    ) -> dict[str, torch.Tensor]:
        return {hf_name(k): v for k, v in state_dict.items()}

    def from_hf(
        self, hf_state_dict: dict[str, torch.Tensor], args: LlamaArgs
    ) -> dict[str, torch.Tensor]:
        foreign = sorted(k for k in hf_state_dict if not _is_boost_name(k))
        if foreign:
            raise HFFormatError(
                f"{len(foreign)} tensors are not in the boost layout "
                f"('model.<fqn>' or 'lm_head.weight'), e.g. {foreign[:5]}"
            )
        return {our_name(k): v for k, v in hf_state_dict.items()}


def hf_name(fqn: str) -> str:
    return "lm_head.weight" if fqn == "output.weight" else "model." + fqn


def our_name(hf: str) -> str:
    return "output.weight" if hf == "lm_head.weight" else hf.removeprefix("model.")


def _is_boost_name(hf: str) -> bool:
    return hf == "lm_head.weight" or (hf.startswith("model.") and hf != "model.output.weight")


BOOST = register(BoostFormat())
